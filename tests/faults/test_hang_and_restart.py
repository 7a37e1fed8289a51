"""Faults under load: a replica that hangs (SIGSTOP), and one restarted with an empty cache.

Each test records what happened (requests sent, succeeded, failed, p99 latency during the
fault, how long until the router stopped sending to the replica and took it back) in
artifacts/faults-<name>.json. Only processes the test started are signalled; SIGCONT goes
out before any kill (tests/procs.py).
"""

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx

from tests.procs import Proc

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
ROUTER = ("--health-interval-s", "0.2", "--health-timeout-s", "0.3", "--open-seconds", "1",
          "--first-byte-timeout-s", "2", "--idle-timeout-s", "2", "--policy", "round_robin",
          "--decisions-kept", "5000")
REPLICA = ("--engine", "sim", "--sim-step-overhead-s", "0.005", "--log-level", "warning")


async def load(url, seconds, events, stream_every=3):
    """Bounded closed-loop load (6 clients, `seconds` long); returns per-request records."""
    records = []
    deadline = time.monotonic() + seconds

    async def client(c, cid):
        i = 0
        while time.monotonic() < deadline:
            body = {"prompt": f"client {cid} request {i} " + "p" * 100, "max_tokens": 16,
                    "stream": i % stream_every == 0}
            t0 = time.monotonic()
            try:
                r = await c.post("/v1/completions", json=body)
                ok = r.status_code == 200 and "error" not in r.text.split("data: [DONE]")[0][-300:]
                records.append((t0, time.monotonic() - t0, ok, r.headers.get("x-replica")))
            except httpx.HTTPError as exc:
                records.append((t0, time.monotonic() - t0, False, repr(exc)))
            i += 1

    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        await asyncio.gather(events(), *(client(c, n) for n in range(6)))
    return records


def summary(records, decisions, victim_url, marks):
    """Client-side outcomes; when the router stopped and resumed choosing the victim comes
    from its own decision log (wall-clock times)."""
    fault_at, back_at = marks["fault"], marks["back"]
    during = sorted(d for t, d, _, _ in records if fault_at <= t < back_at)
    chose = [d["at"] for d in decisions if d["chosen"] == victim_url]
    last_before = max((t for t in chose if t < marks["back_wall"]), default=marks["fault_wall"])
    first_after = min((t for t in chose if t >= marks["back_wall"]), default=None)
    return {
        "sent": len(records), "succeeded": sum(ok for _, _, ok, _ in records),
        "failed": sum(not ok for _, _, ok, _ in records),
        "p99_during_fault_s": during[int(0.99 * (len(during) - 1))] if during else None,
        "stopped_sending_after_s": max(0.0, last_before - marks["fault_wall"]),
        "took_back_after_s": None if first_after is None else first_after - marks["back_wall"],
    }


def record(name, data):
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / f"faults-{name}.json").write_text(json.dumps(data, indent=2))


def test_a_hung_replica_is_routed_around_and_taken_back():
    reps = [Proc("replicas", *REPLICA) for _ in range(3)]
    try:
        with Proc("router", "--replicas", ",".join(r.url for r in reps), *ROUTER) as router:
            victim = reps[0]
            marks = {}

            async def events():
                await asyncio.sleep(1.0)
                marks["fault"], marks["fault_wall"] = time.monotonic(), time.time()
                victim.signal(signal.SIGSTOP)
                await asyncio.sleep(3.0)
                marks["back"], marks["back_wall"] = time.monotonic(), time.time()
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
                marks["fault"], marks["fault_wall"] = time.monotonic(), time.time()
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(5)
                await asyncio.to_thread(lambda: reps.__setitem__(
                    0, Proc("replicas", *REPLICA, port=victim.port)))
                marks["back"], marks["back_wall"] = time.monotonic(), time.time()
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
