"""A local cluster: N replicas and a router as processes on loopback ports.

    with LocalCluster(replicas=3, policy="prefix") as c:
        c.router.url, [r.url for r in c.replicas]

``python -m loadtest cluster`` runs one until Ctrl-C (what ``make run`` starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .processes import ServerProcess


class LocalCluster:
    def __init__(self, replicas: int = 3, policy: str = "prefix",
                 replica_args: Sequence[str] = ("--engine", "sim"),
                 router_args: Sequence[str] = (), log_dir: Path | None = None,
                 router_port: int | None = None) -> None:
        self.n = replicas
        self.policy = policy
        self.replica_args = tuple(replica_args)
        self.router_args = tuple(router_args)
        self.log_dir = log_dir
        self.router_port = router_port
        self.replicas: list[ServerProcess] = []
        self.router: ServerProcess | None = None

    def start(self) -> LocalCluster:
        try:
            for _ in range(self.n):
                self.replicas.append(ServerProcess("replicas", *self.replica_args,
                                                   log_dir=self.log_dir))
            urls = ",".join(r.url for r in self.replicas)
            self.router = ServerProcess("router", "--replicas", urls, "--policy", self.policy,
                                        *self.router_args, log_dir=self.log_dir,
                                        port=self.router_port)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for r in self.replicas:
            r.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
