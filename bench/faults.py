"""Faults under load: what the router does when one replica is killed, hangs, restarts
empty, answers 500s, probes slowly or cuts its streams (BENCHMARKS.md, "Reliability").

Each scenario: one faulty and one or two healthy sim replicas behind the router (round
robin, or prefix for the slow-probe case; health checks every 0.2 s with a 0.3 s timeout;
first-byte and idle timeouts 2 s; circuits open after 3 failures for 1 s), 6 closed-loop
clients for 5-7 s, every third request streaming, 16 tokens each, every answer checked to
its end (``loadtest/checked.py``). For a fault that strikes mid-run, the requests the router
had open on the victim just before it are read from its ``router_replica_in_flight`` (it
strikes at a moment when there are some, waiting up to 2 s for one).

Reported per scenario: requests, ok, failed, how many failed before anything reached the
client ("lost": the router should have retried them) and after ("broken": streams that had
begun, which can only end with an error event), on which replica, the p99 latency while the
fault lasted, how often the router chose the victim meanwhile, how long until it stopped
and took it back (its decision log, wall clock). ``tests/faults`` runs the same scenarios
and asserts the claims: nothing lost, every failure a stream that had begun on the victim,
requests in flight on the victim when the fault struck.

    .venv/bin/python -m bench.faults [--only kill9,sigstop,...]

Only processes this benchmark started are signalled; SIGCONT goes out before any kill.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from loadtest.checked import Outcome, checked_request
from loadtest.processes import ServerProcess

from ._common import metric_sum, print_table, write_result

ROUTER = ("--health-interval-s", "0.2", "--health-timeout-s", "0.3", "--open-seconds", "1",
          "--first-byte-timeout-s", "2", "--idle-timeout-s", "2", "--policy", "round_robin",
          "--decisions-kept", "5000", "--log-level", "warning")
REPLICA = ("--engine", "sim", "--sim-step-overhead-s", "0.005", "--log-level", "warning")
CLIENTS = 6
MAX_TOKENS = 16


class Run:
    """One scenario's processes and the marks of its phases."""

    def __init__(self, reps: list[ServerProcess], router: ServerProcess) -> None:
        self.reps, self.router = reps, router
        self.victim = reps[0]
        self.marks: dict[str, float] = {}
        self.in_flight_at_fault: float | None = None

    def mark(self, name: str) -> None:
        """When a phase (``fault``, ``back``) began: monotonic for the clients' figures,
        wall clock to compare with the router's decision log."""
        self.marks[name], self.marks[name + "_wall"] = time.monotonic(), time.time()

    async def strike(self, within_s: float = 2.0) -> None:
        """Wait (at most ``within_s``) for a moment when the router has requests open on the
        victim, note how many, then mark the fault: with 6 clients over 2 or 3 replicas
        the victim can hold none at a given instant, and a fault then tests nothing."""
        deadline = time.monotonic() + within_s
        while True:
            text = (await asyncio.to_thread(httpx.get, self.router.url + "/metrics",
                                            timeout=5)).text
            self.in_flight_at_fault = metric_sum(text, "router_replica_in_flight",
                                                 replica=self.victim.url)
            if self.in_flight_at_fault > 0 or time.monotonic() >= deadline:
                break
        self.mark("fault")


Act = Callable[[Run], Awaitable[None]]


@dataclass
class Scenario:
    name: str
    what: str
    act: Act | None = None  # strikes 1 s in (None: faulty from the start)
    faulty_args: tuple[str, ...] = ()
    healthy: int = 2
    seconds: float = 5.0
    router_args: tuple[str, ...] = ()
    comes_back: bool | None = None  # whether the router takes the victim back (None: n/a)


async def _kill9(run: Run) -> None:
    await run.strike()
    run.victim.signal(signal.SIGKILL)


async def _sigstop(run: Run) -> None:
    await run.strike()
    run.victim.signal(signal.SIGSTOP)
    await asyncio.sleep(3.0)
    run.mark("back")
    run.victim.signal(signal.SIGCONT)


async def _restart(run: Run) -> None:
    await run.strike()
    victim = run.victim
    victim.proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(victim.proc.wait, 5)
    fresh = await asyncio.to_thread(lambda: ServerProcess("replicas", *REPLICA,
                                                          port=victim.port))
    run.reps[0] = fresh
    run.mark("back")


SCENARIOS = {s.name: s for s in [
    Scenario("kill9", "kill -9 (for good)", _kill9, comes_back=False),
    Scenario("sigstop", "SIGSTOP for 3 s", _sigstop, seconds=7.0, comes_back=True),
    Scenario("restart", "killed, restarted empty on the same port", _restart, healthy=1,
             seconds=6.0, comes_back=True),
    Scenario("http500", "answers every request with 500", None, ("--fault-error-rate", "1")),
    Scenario("slow_probes", "probes take 2 s (deadline 25 ms)", None,
             ("--fault-probe-delay-s", "2"), router_args=("--policy", "prefix",
                                                          "--probe-deadline-ms", "25")),
    Scenario("cut_streams", "cuts every stream after 3 chunks", None,
             ("--fault-cut-stream-after", "3")),
]}


async def drive(url: str, seconds: float, events: Callable[[], Awaitable[None]]
                ) -> list[Outcome]:
    """``CLIENTS`` closed-loop clients for ``seconds`` (bounded), ``events`` beside them."""
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + seconds

    async def client(c: httpx.AsyncClient, cid: int) -> None:
        i = 0
        while time.monotonic() < deadline:
            body = {"prompt": f"client {cid} request {i} " + "p" * 100,
                    "max_tokens": MAX_TOKENS, "stream": i % 3 == 0}
            outcomes.append(await checked_request(c, "/v1/completions", body))
            i += 1

    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        await asyncio.gather(events(), *(client(c, n) for n in range(CLIENTS)))
    return outcomes


def run_scenario(sc: Scenario) -> dict:
    """Run one scenario; its figures (``summary``) and every request's outcome."""
    reps = [ServerProcess("replicas", *REPLICA, *sc.faulty_args)]
    reps += [ServerProcess("replicas", *REPLICA) for _ in range(sc.healthy)]
    run = None
    try:
        router = ServerProcess("router", "--replicas", ",".join(r.url for r in reps),
                               *ROUTER, *sc.router_args)
        try:
            run = Run(reps, router)

            async def events() -> None:
                if sc.act is None:
                    run.mark("fault")
                    await asyncio.sleep(sc.seconds)
                else:
                    await asyncio.sleep(1.0)
                    await sc.act(run)
                if "back" not in run.marks:
                    await asyncio.sleep(max(0.0, run.marks["fault"] + sc.seconds - 1.0
                                            - time.monotonic()))
                    run.mark("back")

            outcomes = asyncio.run(drive(router.url, sc.seconds, events))
            stats = httpx.get(router.url + "/stats", timeout=10).json()
            metrics = httpx.get(router.url + "/metrics", timeout=10).text
        finally:
            router.stop()
    finally:
        for r in reps:
            r.stop()
    return {"summary": summary(sc, run, outcomes, stats["decisions"], metrics),
            "outcomes": [o.to_dict() for o in outcomes]}


def summary(sc: Scenario, run: Run, outcomes: list[Outcome], decisions: list[dict],
            metrics: str) -> dict:
    victim, marks = run.victim.url, run.marks
    failed = [o for o in outcomes if not o.ok]
    during = sorted(o.seconds for o in outcomes if marks["fault"] <= o.t0 < marks["back"])
    chose = [d["at"] for d in decisions if d["chosen"] == victim]
    chosen_during = sum(1 for t in chose if marks["fault_wall"] <= t < marks["back_wall"])
    last_before = max((t for t in chose if t < marks["back_wall"]), default=marks["fault_wall"])
    first_after = min((t for t in chose if t >= marks["back_wall"]), default=None)
    return {
        "scenario": sc.name, "what": sc.what,
        "sent": len(outcomes), "ok": len(outcomes) - len(failed), "failed": len(failed),
        "streams": sum(o.stream for o in outcomes),
        "lost_before_start": sum(o.lost_before_start for o in outcomes),
        "broken_after_start": sum(o.started for o in failed),
        "failed_on_victim": sum(o.replica == victim for o in failed),
        "failed_not_a_started_stream_on_victim": sum(
            not (o.stream and o.started and o.replica == victim) for o in failed),
        "errors": sorted({o.error for o in failed})[:10],
        "in_flight_on_victim_at_fault": run.in_flight_at_fault,
        "victim_probe_failures": metric_sum(metrics, "router_probe_failures_total",
                                            replica=victim),
        "chosen_during_fault": chosen_during,
        "p99_during_fault_s": during[int(0.99 * (len(during) - 1))] if during else None,
        "stopped_choosing_after_s": max(0.0, last_before - marks["fault_wall"]),
        "took_back_after_s": None if first_after is None else first_after - marks["back_wall"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SCENARIOS), help="scenarios, comma-separated")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    results = {}
    for name in [n for n in args.only.split(",") if n]:
        print(f"{name}: {SCENARIOS[name].what} ...", flush=True)
        results[name] = run_scenario(SCENARIOS[name])
        s = results[name]["summary"]
        print(f"  {s['sent']} requests, {s['failed']} failed ({s['lost_before_start']} lost "
              f"before anything reached the client)", flush=True)
    rows = []
    for name, r in results.items():
        s = r["summary"]
        back = s["took_back_after_s"]
        rows.append([s["what"], s["sent"], s["failed"], s["lost_before_start"],
                     s["broken_after_start"], s["in_flight_on_victim_at_fault"],
                     f"{s['p99_during_fault_s']:.2f} s" if s["p99_during_fault_s"] else "-",
                     s["chosen_during_fault"], f"{s['stopped_choosing_after_s']:.2f} s",
                     "never" if back is None else f"{back:.2f} s"])
    print_table(["fault", "requests", "failed", "lost before start", "broken after start",
                 "in flight on it at the fault", "p99 during", "chosen during",
                 "stopped choosing after", "took back after"], rows)
    if not args.no_write:
        write_result("faults", {"args": vars(args), "router": ROUTER, "replica": REPLICA,
                                "clients": CLIENTS, "max_tokens": MAX_TOKENS,
                                "scenarios": {n: r["summary"] for n, r in results.items()}},
                     out=args.out)


if __name__ == "__main__":
    main()
