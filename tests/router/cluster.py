"""A local cluster for router tests: sim replicas and a router, as real processes."""

from __future__ import annotations

import contextlib

from tests.procs import Proc


# Tests assert exact routing (the replica holding a prefix gets its repeat); a probe that
# misses the default 25 ms deadline reads as no reuse, and on CI's two cores, shared by
# every process of a test, a stall can last that long. Tests of the deadline pass their own.
WAIT_FOR_PROBES = ("--probe-deadline-ms", "2000")


@contextlib.contextmanager
def cluster(n: int, replica_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (),
            replica_env: dict | None = None, per_replica_args: dict[int, tuple] | None = None):
    replicas: list[Proc] = []
    router = None
    try:
        for i in range(n):
            extra = (per_replica_args or {}).get(i, ())
            replicas.append(Proc("replicas", "--engine", "sim", "--log-level", "warning",
                                 *replica_args, *extra, env=replica_env))
        if "--probe-deadline-ms" not in router_args:
            router_args = (*router_args, *WAIT_FOR_PROBES)
        router = Proc("router", "--replicas", ",".join(r.url for r in replicas),
                      "--log-level", "warning", *router_args)
        yield router, replicas
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()
