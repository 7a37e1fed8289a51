"""Soak: a mixed workload through the router for minutes, restarting replicas periodically.

Reports lost requests (target: 0 that had not started streaming), leaked KV pages after the
load stops (target: 0), and the router's memory growth (RSS sampled every 30 s). Every
answer is checked to its end (``loadtest/checked.py``: a stream without ``[DONE]``, an error
event, a short answer or an unreadable body is a failure), and a fifth of the requests are
streams whose client disconnects after two content events (their KV pages must be freed:
the leak count covers them).

Setup: 4 sim replicas (speed-up 5) behind the router (prefix policy, health checks every
0.5 s). Load: 8 closed-loop clients mixing shared-prefix completions (streaming and not),
multi-turn chat that carries its history, one-off prompts, and streams left mid-way. Every ``--restart-every``
seconds one replica is restarted on the same port, alternating a graceful SIGTERM (drain)
and a SIGKILL. Only processes this benchmark started are signalled.

    .venv/bin/python -m bench.soak [--minutes 10] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import time

import httpx

from loadtest.checked import checked_request
from loadtest.processes import ServerProcess

from ._common import print_table, write_result

REPLICA = ("--engine", "sim", "--sim-speedup", "5", "--kv-pages", "256", "--log-level",
           "warning")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Soak:
    def __init__(self, args) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.systems = ["".join(self.rng.choices("abcdefghij ", k=1500)) for _ in range(12)]
        self.outcomes: dict[str, int] = {}
        self.lost_before_streaming: list[str] = []
        self.broken: list[str] = []

    def count(self, key: str) -> None:
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    async def client(self, c: httpx.AsyncClient, cid: int, deadline: float) -> None:
        rng = random.Random(cid)
        history: list[dict] = []
        while time.monotonic() < deadline:
            kind = rng.choice(["prefix", "prefix-stream", "chat", "oneoff", "disconnect"])
            if kind == "chat":
                history = history[-6:] + [{"role": "user", "content": f"turn {rng.random()}"}]
                path, body = "/v1/chat/completions", {"messages": history, "max_tokens": 24}
            elif kind == "oneoff":
                path, body = "/v1/completions", {"prompt": f"{rng.random()} " * 40,
                                                  "max_tokens": 8}
            else:
                path, body = "/v1/completions", {
                    "prompt": rng.choice(self.systems) + f" q{rng.random()}", "max_tokens": 16}
            body["stream"] = kind in ("prefix-stream", "disconnect") or (
                kind == "chat" and rng.random() < .5)
            await self.one(c, path, body, kind)
            if kind == "chat":
                history.append({"role": "assistant", "content": "ok"})

    async def one(self, c: httpx.AsyncClient, path: str, body: dict, kind: str) -> None:
        """One request, checked to its end (``loadtest/checked.py``); ``disconnect``
        leaves after two content events."""
        o = await checked_request(c, path, body,
                                  disconnect_after=2 if kind == "disconnect" else None)
        if o.ok:
            self.count("left on purpose mid-stream" if o.disconnected else "ok")
        elif o.started:
            self.count("broken after streaming began")
            self.broken.append(f"{kind} on {o.replica}: {o.error}")
        else:
            self.count("lost before streaming")
            self.lost_before_streaming.append(f"{kind} on {o.replica}: {o.error}")


async def restarts(reps: list[ServerProcess], every: float, deadline: float, log: list) -> None:
    n = 0
    while time.monotonic() + every < deadline:
        await asyncio.sleep(every)
        old = reps[n % len(reps)]
        how = "SIGTERM (drain)" if n % 2 == 0 else "SIGKILL"
        old.signal(signal.SIGTERM if n % 2 == 0 else signal.SIGKILL)
        await asyncio.to_thread(old.proc.wait, 60)
        old.stop()
        reps[n % len(reps)] = await asyncio.to_thread(
            lambda: ServerProcess("replicas", *REPLICA, "--drain-timeout-s", "10", port=old.port))
        log.append({"at_s": round(time.monotonic() - (deadline - every), 1), "replica": old.url,
                    "how": how})
        n += 1


def idle_used_pages(url: str, wait_s: float = 30.0) -> int:
    """The replica's used KV pages once it runs and queues nothing (a request cancelled as
    the load stopped may still be finishing: waited for, up to ``wait_s``)."""
    end = time.monotonic() + wait_s
    while True:
        stats = httpx.get(url + "/stats", timeout=10).json()
        if stats["load"]["running"] == stats["load"]["waiting"] == 0 or \
                time.monotonic() > end:
            return stats["kv_cache"]["used_pages"]
        time.sleep(0.1)


async def sample_rss(pid: int, deadline: float, out: list) -> None:
    while time.monotonic() < deadline:
        out.append(round(rss_mb(pid), 1))
        await asyncio.sleep(30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--restart-every", type=float, default=60.0, help="seconds")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="1 minute, a restart every 20 s")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.restart_every = 1.0, 20.0
    reps = [ServerProcess("replicas", *REPLICA, "--drain-timeout-s", "10") for _ in range(4)]
    soak = Soak(args)
    restart_log: list[dict] = []
    rss: list[float] = []
    try:
        with ServerProcess("router", "--replicas", ",".join(r.url for r in reps),
                           "--health-interval-s", "0.5", "--log-level", "warning") as router:
            async def run():
                deadline = time.monotonic() + args.minutes * 60
                async with httpx.AsyncClient(base_url=router.url, timeout=60) as c:
                    await asyncio.gather(
                        restarts(reps, args.restart_every, deadline, restart_log),
                        sample_rss(router.proc.pid, deadline, rss),
                        *(soak.client(c, i, deadline) for i in range(args.clients)))
            t0 = time.monotonic()
            asyncio.run(run())
            elapsed = time.monotonic() - t0
            rss.append(round(rss_mb(router.proc.pid), 1))
            leaked = {r.url: idle_used_pages(r.url) for r in reps}
    finally:
        for r in reps:
            r.stop()
    total = sum(soak.outcomes.values())
    result = {"minutes": args.minutes, "seconds": round(elapsed, 1), "requests": total,
              "outcomes": soak.outcomes, "lost_before_streaming": len(soak.lost_before_streaming),
              "lost_examples": soak.lost_before_streaming[:10],
              "broken_examples": soak.broken[:10], "leaked_pages": leaked,
              "router_rss_mb": rss, "restarts": restart_log}
    print_table(["requests", "ok", "left mid-stream on purpose", "lost before streaming",
                 "broken after streaming began", "leaked pages",
                 "router RSS MB (first -> last)"],
                [[total, soak.outcomes.get("ok", 0),
                  soak.outcomes.get("left on purpose mid-stream", 0),
                  len(soak.lost_before_streaming),
                  soak.outcomes.get("broken after streaming began", 0), sum(leaked.values()),
                  f"{rss[0]} -> {rss[-1]}"]])
    print(f"{len(restart_log)} restarts; outcomes {soak.outcomes}")
    if not args.no_write:
        write_result("soak", result)


if __name__ == "__main__":
    main()
