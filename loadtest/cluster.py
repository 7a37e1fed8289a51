"""A local cluster: N replicas and a router (or several) as processes on loopback ports.

    with LocalCluster(replicas=3, policy="prefix") as c:
        c.router.url, [r.url for r in c.replicas]

``routers=K`` starts K independent routers in front of the same replicas (``c.routers``;
``c.router`` is the first): no state is shared between them.

``python -m loadtest cluster`` runs one until Ctrl-C (what ``make run`` starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .processes import ServerProcess


def start_replicas(n: int, args: Sequence[str], log_dir: Path | None,
                   into: list[ServerProcess]) -> list[ServerProcess]:
    """``n`` replica processes, each ready before the next starts, appended to ``into``
    (so that the caller stops those that started if one fails). One at a time: started
    together, a drawn port was taken before its replica bound it often enough to lose a
    run (seen at 8 replicas)."""
    for _ in range(n):
        into.append(ServerProcess("replicas", *args, log_dir=log_dir))
    return into


class LocalCluster:
    def __init__(self, replicas: int = 3, policy: str = "prefix",
                 replica_args: Sequence[str] = ("--engine", "sim"),
                 router_args: Sequence[str] = (), log_dir: Path | None = None,
                 router_port: int | None = None, routers: int = 1) -> None:
        self.n = replicas
        self.policy = policy
        self.replica_args = tuple(replica_args)
        self.router_args = tuple(router_args)
        self.log_dir = log_dir
        self.router_port = router_port
        self.n_routers = routers  # independent routers before the same replicas
        self.replicas: list[ServerProcess] = []
        self.router: ServerProcess | None = None  # the first of ``routers``
        self.routers: list[ServerProcess] = []

    def start(self) -> LocalCluster:
        try:
            start_replicas(self.n, self.replica_args, self.log_dir, self.replicas)
            urls = ",".join(r.url for r in self.replicas)
            for i in range(self.n_routers):
                self.routers.append(ServerProcess(
                    "router", "--replicas", urls, "--policy", self.policy,
                    *_router_seed(self.router_args, i),
                    log_dir=self.log_dir, port=self.router_port if i == 0 else None))
            self.router = self.routers[0]
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for router in self.routers:
            router.stop()
        for r in self.replicas:
            r.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _router_seed(args: Sequence[str], i: int) -> tuple[str, ...]:
    """Router ``i``'s arguments: a ``--seed S`` becomes ``S + i``, so that independent
    routers draw random streams of their own, as separate deployments would (the same seed
    everywhere would make their random choices, tie-breaks and round-robin starts move in
    step); reproducible all the same."""
    args = list(args)
    for j, arg in enumerate(args[:-1]):
        if arg == "--seed":
            args[j + 1] = str(int(args[j + 1]) + i)
    for j, arg in enumerate(args):
        if arg.startswith("--seed="):
            args[j] = f"--seed={int(arg.split('=', 1)[1]) + i}"
    return tuple(args)
