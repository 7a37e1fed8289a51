"""Shared by the fault tests: bounded load, outcome summaries, recorded figures."""

import asyncio
import json
import time
from pathlib import Path

import httpx

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
                ok = r.status_code == 200 and 'data: {"error"' not in r.text
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
    chosen_during = sum(1 for t in chose if marks["fault_wall"] <= t < marks["back_wall"])
    last_before = max((t for t in chose if t < marks["back_wall"]), default=marks["fault_wall"])
    first_after = min((t for t in chose if t >= marks["back_wall"]), default=None)
    return {
        "sent": len(records), "succeeded": sum(ok for _, _, ok, _ in records),
        "failed": sum(not ok for _, _, ok, _ in records),
        "p99_during_fault_s": during[int(0.99 * (len(during) - 1))] if during else None,
        "chosen_during_fault": chosen_during,
        "stopped_sending_after_s": max(0.0, last_before - marks["fault_wall"]),
        "took_back_after_s": None if first_after is None else first_after - marks["back_wall"],
    }


def mark(marks, name):
    """Note when a phase (``fault``, ``back``) began: monotonic for client-side figures,
    wall clock to compare with the router's decision log."""
    marks[name], marks[name + "_wall"] = time.monotonic(), time.time()


def record(name, data):
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / f"faults-{name}.json").write_text(json.dumps(data, indent=2))
