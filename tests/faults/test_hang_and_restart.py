"""Faults under load: a replica that hangs (SIGSTOP), and one restarted with an empty cache.

Each test records what happened (requests sent, succeeded, failed, p99 latency during the
fault, how long until the router stopped sending to the replica and took it back) in
artifacts/faults-<name>.json. Only processes the test started are signalled; SIGCONT goes
out before any kill (tests/procs.py).
"""

import asyncio
import signal

import httpx

from tests.procs import Proc

from .harness import REPLICA, ROUTER, load, mark, record, summary


def test_a_hung_replica_is_routed_around_and_taken_back():
    reps = [Proc("replicas", *REPLICA) for _ in range(3)]
    try:
        with Proc("router", "--replicas", ",".join(r.url for r in reps), *ROUTER) as router:
            victim = reps[0]
            marks = {}

            async def events():
                await asyncio.sleep(1.0)
                mark(marks, "fault")
                victim.signal(signal.SIGSTOP)
                await asyncio.sleep(3.0)
                mark(marks, "back")
                victim.signal(signal.SIGCONT)
            records = asyncio.run(load(router.url, 7.0, events))
            decisions = httpx.get(router.url + "/stats").json()["decisions"]
    finally:
        for r in reps:
            r.stop()
    result = summary(records, decisions, victim.url, marks)
    record("sigstop", result)
    assert result["failed"] == 0, result  # stuck requests time out and are retried elsewhere
    # Health checks every 0.2 s with a 0.3 s timeout: the router stops choosing it soon.
    assert result["stopped_sending_after_s"] < 1.0, result
    assert result["took_back_after_s"] is not None and result["took_back_after_s"] < 2.5


def test_a_replica_restarted_with_an_empty_cache_rejoins():
    reps = [Proc("replicas", *REPLICA) for _ in range(2)]
    try:
        with Proc("router", "--replicas", ",".join(r.url for r in reps), *ROUTER) as router:
            victim = reps[0]
            marks = {}

            async def events():
                await asyncio.sleep(1.0)
                mark(marks, "fault")
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(5)
                await asyncio.to_thread(lambda: reps.__setitem__(
                    0, Proc("replicas", *REPLICA, port=victim.port)))
                mark(marks, "back")
            records = asyncio.run(load(router.url, 6.0, events))
            decisions = httpx.get(router.url + "/stats").json()["decisions"]
            stats = httpx.get(reps[0].url + "/stats").json()
    finally:
        for r in reps:
            r.stop()
    result = summary(records, decisions, victim.url, marks)
    record("restart", result)
    # Only answers already streaming from the killed process may fail.
    assert result["failed"] <= 6, result
    assert result["stopped_sending_after_s"] < 1.0, result
    assert result["took_back_after_s"] is not None and result["took_back_after_s"] < 2.5
    assert stats["reuse"]["queries"] > 0  # the new process serves traffic
