"""LocalCluster's independent routers draw random streams of their own."""

from loadtest.cluster import _router_seed


def test_each_router_gets_the_seed_plus_its_index():
    args = ("--tokens-per-block", "32", "--seed", "7", "--log-level", "warning")
    assert _router_seed(args, 0) == args
    assert _router_seed(args, 3) == ("--tokens-per-block", "32", "--seed", "10",
                                     "--log-level", "warning")
    assert _router_seed(("--seed=5",), 2) == ("--seed=7",)


def test_without_a_seed_the_arguments_are_unchanged():
    args = ("--policy", "random", "--probe-k", "2")
    assert _router_seed(args, 5) == args
