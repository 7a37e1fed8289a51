"""The driver's several front ends (``DriverConfig.more_urls``): requests without a session
go to each in turn, a session's requests always to the same one."""

from loadtest.driver import DriverConfig, _Run
from loadtest.workloads import Request


def fronts(requests, n=3):
    config = DriverConfig(url="http://a", more_urls=tuple(f"http://{c}" for c in "bc"[:n - 1]))
    run = _Run(None, config, "m", requests, None, None)
    return [run._front(r) for r in requests]


def req(i, session=None):
    return Request(request_id=f"r{i}", max_tokens=1, prompt="p", session=session)


def test_requests_without_a_session_go_to_each_front_in_turn():
    assert fronts([req(i) for i in range(7)]) == ["http://a", "http://b", "http://c"] * 2 + \
        ["http://a"]


def test_a_sessions_requests_stay_on_one_front_and_sessions_spread():
    reqs = [req(i, f"s{i % 20}") for i in range(60)]
    got = fronts(reqs)
    by_session = {}
    for r, front in zip(reqs, got):
        by_session.setdefault(r.session, set()).add(front)
    assert all(len(f) == 1 for f in by_session.values())
    assert {f for fs in by_session.values() for f in fs} == {"http://a", "http://b", "http://c"}


def test_one_front_is_the_url():
    assert set(fronts([req(i) for i in range(3)] + [req(9, "s")], n=1)) == {"http://a"}
