"""More faults under load, each with recorded figures (artifacts/faults-<name>.json):
a replica killed for good, one answering 500s, one with slow probes, one cutting streams."""

import asyncio
import signal

import httpx

from tests.procs import Proc

from .harness import REPLICA, ROUTER, load, mark, record, summary



def run(name, faulty_args=(), act=None, seconds=5.0, healthy=2, router_args=()):
    """Load through a router in front of ``healthy`` good replicas and one faulty one;
    ``act(victim)`` runs 1 s in (None: the replica is faulty from the start)."""
    reps = [Proc("replicas", *REPLICA, *faulty_args)]
    reps += [Proc("replicas", *REPLICA) for _ in range(healthy)]
    victim = reps[0]
    marks = {}
    try:
        with Proc("router", "--replicas", ",".join(r.url for r in reps), *ROUTER,
                  "--probe-deadline-ms", "25", *router_args) as router:
            async def events():
                mark(marks, "fault")
                if act is not None:
                    await asyncio.sleep(1.0)
                    mark(marks, "fault")
                    act(victim)
                await asyncio.sleep(seconds - 1.0)
                mark(marks, "back")
            records = asyncio.run(load(router.url, seconds, events))
            decisions = httpx.get(router.url + "/stats").json()["decisions"]
    finally:
        for r in reps:
            r.stop()
    result = summary(records, decisions, victim.url, marks)
    result["failed_on_victim"] = sum(1 for _, _, ok, rep in records
                                     if not ok and rep == victim.url)
    record(name, result)
    return result


def test_kill_9():
    r = run("kill9", act=lambda v: v.proc.send_signal(signal.SIGKILL))
    # Only streams already flowing from the dead replica may fail.
    assert r["failed"] == r["failed_on_victim"] <= 6, r
    assert r["stopped_sending_after_s"] < 1.0, r
    assert r["took_back_after_s"] is None  # it never came back


def test_a_replica_answering_500s():
    r = run("http500", ("--fault-error-rate", "1"))
    assert r["failed"] == 0, r  # every 500 is retried on another replica
    # Its circuit opens after 3 failures and lets one trial request through a second later
    # (then opens again): a handful of choices in 5 s, each retried elsewhere.
    assert r["chosen_during_fault"] <= 3 + 6, r


def test_slow_probes():
    r = run("slow_probes", ("--fault-probe-delay-s", "2"), router_args=("--policy", "prefix"))
    assert r["failed"] == 0, r
    assert r["p99_during_fault_s"] < 1.0, r  # a 2 s probe never holds a request


def test_cut_streams():
    r = run("cut_streams", ("--fault-cut-stream-after", "3"))
    # Streams cut by the faulty replica end with an error event; non-streaming requests
    # are retried (nothing was sent), so they all succeed.
    assert r["failed"] == r["failed_on_victim"], r
    assert r["failed"] <= r["sent"] // 3, r
