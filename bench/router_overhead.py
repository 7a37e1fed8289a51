"""What the router adds to each request: its own CPU time, and latency over going straight
to the replica it chose; the SGLang gateway in front of the same replicas, for comparison.

Set-up: 8 sim replicas (``--sim-speedup 10000``, so modelled compute is ~0.01 ms and what is
measured is HTTP, parsing, tokenizing, probing and bookkeeping), ~4k-token prompts (3,999
random letters; the byte-level tokenizer makes one token per byte, plus BOS = 4,000 tokens),
``max_tokens`` 1, non-streaming, one request at a time. A pool of distinct prompts is sent
straight to *every* replica first, so every request later is a full cache hit wherever it
goes: the routed and the direct request do the same work on the replica.

1. For each router configuration (``--policy prefix --probe-k K``, K in 0, 1, 2, 8; K = 0
   means no probes), after a warm-up, each timed request goes through the router and then,
   identically, straight to the replica named in ``x-replica`` (same run, one after the
   other). Reported: the router process's CPU time per routed request (utime + stime from
   ``/proc/PID/stat``, all threads, before and after the timed run; it includes the
   router's 1 s health checks over that window), and p50/p90/p99 of the latency through
   the router, straight to the replica, and of the per-request difference (the router
   overhead as BENCHMARKS.md defines it).
2. The SGLang model gateway (sglang-router, ``cache_aware``) in front of the same 8 replicas,
   same prompts: it does not say which replica it chose, so each request through it is
   followed by the same request straight to the replicas in turn (round robin); reported
   are both distributions, their difference at each percentile, the per-request difference,
   and the gateway's CPU time per request. Skipped, with a note, if it cannot be installed.
3. Routed requests/s through the router at K = 8, closed loop with 16 concurrent clients
   for 15 s (the load generator, the router and the 8 replicas share the machine's cores).

With ``--clients http1,aiohttp,httpx`` each router configuration of step 1 and the
throughput run of step 3 are made once per HTTP client the router uses towards its replicas
(its own ``router/http1.py``, or the same interface on aiohttp or httpx:
``bench/router_client_variant.py``), interleaved in every round; the A/B lines give the
router CPU per request of each and what the router's own client saves against the best
maintained one.

With ``--tracing`` each router configuration of step 1 is made a second time with tracing on
(``--otel-endpoint`` to a sink in this process that answers every OTLP/HTTP export 200): the
spans of every routed request made and batched for export by the router's own thread;
the replicas do not trace. Its CPU and added latency, against the same K untraced, are what
tracing costs the router when it is on.

Steps 1 and 2 run ``--rounds`` times (3), one configuration after the other in each round,
and each row reports the round with the median added p50 (and the median CPU per request
over the rounds); every round's figures are in the JSON. This machine's speed drifts by
tens of percent within minutes, so one pass can favour whichever configuration ran at a
quiet moment.

    .venv/bin/python -m bench.router_overhead [--quick] [--no-sglang] [--clients ...] [--tracing]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import http.client
import json
import os
import time
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from loadtest.processes import ServerProcess

from ._common import OTLPSink, metric_sum, percentiles_ms, print_table, write_result

MODEL = "sim-byte-lm"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def start_replica(*args: str) -> ServerProcess:
    """``python -m replicas ARGS`` on a free loopback port."""
    return ServerProcess("replicas", *args)


def dead(procs) -> list[str]:
    """'URL (exit N)' for each server process that has exited."""
    return [f"{p.url} (exit {p.proc.returncode})" for p in procs if p.proc.poll() is not None]


# --------------------------------------------------------------------------- helpers

def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of a process (all its threads), in seconds, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the ")" closing comm: field 3 (state) is fields[0]; utime is 14, stime 15
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    return sum(cpu_times(pid))


class Conn:
    """One keep-alive HTTP/1.1 connection to a server, for sequential requests."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.url = url
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)

    def post(self, path: str, body: bytes) -> tuple[int, dict, bytes]:
        for attempt in (0, 1):  # servers close idle keep-alive connections (uvicorn: 5 s)
            try:
                self.conn.request("POST", path, body=body,
                                  headers={"content-type": "application/json"})
                r = self.conn.getresponse()
                data = r.read()
                return r.status, {k.lower(): v for k, v in r.getheaders()}, data
            except (ConnectionError, http.client.RemoteDisconnected):
                self.conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the connection; the next request opens a new one."""
        self.conn.close()


def make_prompts(n: int, chars: int, seed: int) -> list[bytes]:
    """``n`` distinct random-letter prompts as request bodies (model, prompt, max_tokens 1)."""
    rng = np.random.default_rng(seed)
    bodies = []
    for i in range(n):
        text = f"{i:05d} " + "".join(map(chr, rng.integers(97, 123, size=chars - 6)))
        bodies.append(json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1}).encode())
    return bodies


def diff_percentiles(a_ns: list[int], b_ns: list[int]) -> dict[str, float]:
    """Difference of the two distributions at each percentile (a - b), in ms."""
    pa, pb = percentiles_ms(a_ns), percentiles_ms(b_ns)
    return {k: pa[k] - pb[k] for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")}


def ok(resp: tuple[int, dict, bytes], where: str) -> dict:
    return check(resp[0], resp[2], where)


def check(status: int, data: bytes, where: str) -> dict:
    """The JSON body of a 200 answer; RuntimeError otherwise."""
    if status != 200:
        raise RuntimeError(f"{where} answered {status}: {data[:300]!r}")
    return json.loads(data)


# --------------------------------------------------------------------------- phases

def preload(replica_urls: list[str], bodies: list[bytes]) -> None:
    """Every prompt straight to every replica, so later requests are full hits anywhere."""
    for url in replica_urls:
        c = Conn(url)
        try:
            for b in bodies:
                ok(c.post("/v1/completions", b), url)
        finally:
            c.close()


def upper_median(values) -> float:
    """The median, the upper one of an even count (a value that was measured)."""
    values = sorted(values)
    return values[len(values) // 2]


def median_round(rounds: list[dict], key) -> dict:
    """The round whose ``key`` is the median (the upper one of an even count), with the
    median of the per-request CPU of all rounds (CPU and latency can drift separately)."""
    chosen = dict(sorted(rounds, key=key)[len(rounds) // 2])
    for name in ("router_cpu_ms_per_request", "gateway_cpu_ms_per_request"):
        if name in chosen:
            chosen[name] = upper_median(r[name] for r in rounds)
    chosen["rounds"] = len(rounds)
    return chosen


def paired_router_run(router: ServerProcess, direct: dict[str, Conn], bodies: list[bytes],
                      requests: int, warmup: int, replica_pids: list[int]) -> dict:
    """Through the router, then the same request straight to the replica it named."""
    for c in direct.values():
        c.close()  # reconnect during the warm-up, not in the timed loop
    front = Conn(router.url)
    routed, straight, added = [], [], []
    chosen: dict[str, int] = {}
    hits = prompt_tokens = 0
    try:
        for i in range(warmup):
            s, h, d = front.post("/v1/completions", bodies[i % len(bodies)])
            check(s, d, "router")
            ok(direct[h["x-replica"]].post("/v1/completions", bodies[i % len(bodies)]),
               h["x-replica"])
        gc.collect()
        gc.disable()
        clock = time.perf_counter_ns
        u0, s0 = cpu_times(router.proc.pid)
        rcpu0 = sum(cpu_seconds(p) for p in replica_pids)
        own0 = time.process_time()
        wall0 = time.perf_counter()
        for i in range(requests):
            body = bodies[(warmup + i) % len(bodies)]
            t0 = clock()
            s, h, d = front.post("/v1/completions", body)
            t1 = clock()
            url = h.get("x-replica")
            if s != 200 or url not in direct:
                raise RuntimeError(f"router answered {s} x-replica={url!r}: {d[:300]!r}")
            conn = direct[url]
            t2 = clock()
            s2, _, d2 = conn.post("/v1/completions", body)
            t3 = clock()
            check(s2, d2, url)
            routed.append(t1 - t0)
            straight.append(t3 - t2)
            added.append((t1 - t0) - (t3 - t2))
            chosen[url] = chosen.get(url, 0) + 1
            usage = json.loads(d)["usage"]
            prompt_tokens += usage["prompt_tokens"]
            hits += usage["prompt_tokens_details"]["cached_tokens"]
        wall = time.perf_counter() - wall0
        u1, s1 = cpu_times(router.proc.pid)
        cpu = (u1 - u0) + (s1 - s0)
        rcpu = sum(cpu_seconds(p) for p in replica_pids) - rcpu0
        own = time.process_time() - own0
    finally:
        gc.enable()
        front.close()
    metrics = http.client.HTTPConnection("127.0.0.1", urlsplit(router.url).port, timeout=10)
    metrics.request("GET", "/metrics")
    mtext = metrics.getresponse().read().decode()
    metrics.close()
    ov_sum = metric_sum(mtext, "router_overhead_seconds_sum")
    ov_n = metric_sum(mtext, "router_overhead_seconds_count")
    return {
        "requests": requests,
        "router_cpu_ms_per_request": cpu / requests * 1e3,
        "router_cpu_seconds": cpu,
        "router_user_ms_per_request": (u1 - u0) / requests * 1e3,
        "router_system_ms_per_request": (s1 - s0) / requests * 1e3,
        "replicas_cpu_ms_per_pair": rcpu / requests * 1e3,
        "client_cpu_ms_per_pair": own / requests * 1e3,
        "wall_seconds": wall,
        "through_router": percentiles_ms(routed),
        "direct": percentiles_ms(straight),
        "added": percentiles_ms(added),
        "hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
        "replicas_chosen": len(chosen),
        "max_share": max(chosen.values()) / requests,
        "probe_failures": metric_sum(mtext, "router_probe_failures_total"),
        "router_self_reported_pre_upstream_mean_ms": ov_sum / ov_n * 1e3 if ov_n else None,
    }


def paired_gateway_run(gw, direct: list[Conn], bodies: list[bytes], requests: int,
                       warmup: int, replica_pids: list[int]) -> dict:
    """Through the gateway, then the same request straight to the replicas in turn."""
    for c in direct:
        c.close()  # reconnect during the warm-up, not in the timed loop
    front = Conn(gw.url)
    through, straight, added = [], [], []
    hits = prompt_tokens = 0
    try:
        for i in range(warmup):
            ok(front.post("/v1/completions", bodies[i % len(bodies)]), "sglang gateway")
            ok(direct[i % len(direct)].post("/v1/completions", bodies[i % len(bodies)]),
               "replica")
        gc.collect()
        gc.disable()
        clock = time.perf_counter_ns
        cpu0 = cpu_seconds(gw.proc.pid)
        rcpu0 = sum(cpu_seconds(p) for p in replica_pids)
        wall0 = time.perf_counter()
        for i in range(requests):
            body = bodies[(warmup + i) % len(bodies)]
            t0 = clock()
            s, _, d = front.post("/v1/completions", body)
            t1 = clock()
            conn = direct[i % len(direct)]
            t2 = clock()
            s2, _, d2 = conn.post("/v1/completions", body)
            t3 = clock()
            check(s, d, "sglang gateway")
            check(s2, d2, conn.url)
            through.append(t1 - t0)
            straight.append(t3 - t2)
            added.append((t1 - t0) - (t3 - t2))
            usage = json.loads(d)["usage"]
            prompt_tokens += usage["prompt_tokens"]
            hits += usage["prompt_tokens_details"]["cached_tokens"]
        wall = time.perf_counter() - wall0
        cpu = cpu_seconds(gw.proc.pid) - cpu0
        rcpu = sum(cpu_seconds(p) for p in replica_pids) - rcpu0
    finally:
        gc.enable()
        front.close()
    return {
        "requests": requests,
        "gateway_cpu_ms_per_request": cpu / requests * 1e3,
        "gateway_cpu_seconds": cpu,
        "replicas_cpu_ms_per_pair": rcpu / requests * 1e3,
        "wall_seconds": wall,
        "through_gateway": percentiles_ms(through),
        "direct_round_robin": percentiles_ms(straight),
        "added_per_request": percentiles_ms(added),
        "distribution_difference": diff_percentiles(through, straight),
        "hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
    }


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    done = failures = 0
    latencies: list[int] = []
    deadline = time.monotonic() + seconds
    headers = {"content-type": "application/json"}

    async def client(session: aiohttp.ClientSession, cid: int) -> None:
        nonlocal done, failures
        i = cid
        while time.monotonic() < deadline:
            t0 = time.perf_counter_ns()
            try:
                async with session.post(url + "/v1/completions", data=bodies[i % len(bodies)],
                                        headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                done += 1
                latencies.append(time.perf_counter_ns() - t0)
            else:
                failures += 1
            i += concurrency

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(client(session, c) for c in range(concurrency)))
        elapsed = time.monotonic() - t0
    return {"requests": done, "failures": failures, "seconds": elapsed,
            "requests_per_s": done / elapsed,
            "latency": percentiles_ms(latencies) if latencies else None}


def throughput_run(router: ServerProcess, bodies: list[bytes], concurrency: int,
                   seconds: float) -> dict:
    def metrics() -> str:
        c = http.client.HTTPConnection("127.0.0.1", urlsplit(router.url).port, timeout=10)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
        return text

    fails0 = metric_sum(metrics(), "router_probe_failures_total")
    cpu0 = cpu_seconds(router.proc.pid)
    own0 = time.process_time()
    out = asyncio.run(closed_loop(router.url, bodies, concurrency, seconds))
    cpu = cpu_seconds(router.proc.pid) - cpu0
    own = time.process_time() - own0
    out.update({
        "concurrency": concurrency,
        "router_cpu_ms_per_request": cpu / out["requests"] * 1e3 if out["requests"] else None,
        "router_cpu_utilisation": cpu / out["seconds"],
        "client_cpu_utilisation": own / out["seconds"],
        "probe_failures": metric_sum(metrics(), "router_probe_failures_total") - fails0,
    })
    return out


# --------------------------------------------------------------------------- main

def tracing_ab(rounds: dict[str, list[dict]], clients: list[str], ks: list[int], name,
               sink: OTLPSink) -> dict:
    """What tracing costs the router when on: per client and k, router CPU per request and
    added p50 (medians over the rounds) traced against untraced."""
    cost, lines = {}, []

    for client in clients:
        for k in ks:
            off, on = rounds.get(name(client, k)), rounds.get(name(client, k, True))
            if not off or not on:
                continue
            row = {}
            for key, get in (("cpu_ms_per_request", lambda r: r["router_cpu_ms_per_request"]),
                             ("added_p50_ms", lambda r: r["added"]["p50_ms"])):
                row[key] = {"off": upper_median(map(get, off)), "on": upper_median(map(get, on))}
            cost[name(client, k)] = row
            cpu, added = row["cpu_ms_per_request"], row["added_p50_ms"]
            lines.append(f"tracing {name(client, k)}: router CPU/request {cpu['on']:.3f} ms "
                         f"on, {cpu['off']:.3f} ms off ({cpu['on'] / cpu['off'] - 1:+.1%}); "
                         f"added p50 {added['on']:.2f} / {added['off']:.2f} ms")
    cost["exports"] = {"requests": sink.exports, "bytes": sink.bytes}
    lines.append(f"tracing: the sink took {sink.exports} OTLP exports, {sink.bytes:,} bytes")
    if sink.exports == 0:
        raise RuntimeError("the traced routers exported nothing: tracing was not on")
    return {"cost": cost, "lines": lines}


def client_ab(rounds: dict[str, list[dict]], tputs: dict[str, dict], clients: list[str],
              ks: list[int], name) -> dict:
    """The router's own client (http1) against the best maintained one: router CPU per
    request per k (median over the rounds) and in the throughput run; ``saving`` = 1 -
    http1 / best other. Home-made infrastructure stays only where this pays (15% at k = 8
    was the bar issue 15 set for the router's own server)."""
    others = [c for c in clients if c != "http1"]
    if "http1" not in clients or not others:
        return {}
    saving, lines = {}, []

    def compare(label: str, cpu: dict[str, float], extra: dict) -> None:
        best = min((c for c in others if c in cpu), key=cpu.get)
        saving[label] = {"cpu_ms_per_request": cpu, "best_other": best,
                         "saving": 1 - cpu["http1"] / cpu[best], **extra}
        lines.append(f"A/B {label}: router CPU/request " + ", ".join(
            f"{c} {v:.3f} ms" for c, v in cpu.items()) +
            f"; http1 saves {saving[label]['saving']:+.1%} against {best}")

    for k in ks:
        cpu = {c: upper_median(r["router_cpu_ms_per_request"]
                                for r in rounds[name(c, k)])
               for c in clients if rounds.get(name(c, k))}
        if "http1" in cpu and any(c in cpu for c in others):
            compare(f"k={k}", cpu, {})
    if "http1" in tputs and any(c in tputs for c in others):
        compare("closed loop", {c: t["router_cpu_ms_per_request"] for c, t in tputs.items()},
                {"requests_per_s": {c: t["requests_per_s"] for c, t in tputs.items()}})
    return {"saving": saving, "lines": lines}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--ks", default="0,1,2,8", help="probe fan-outs to measure (--probe-k)")
    p.add_argument("--clients", default="http1",
                   help="the router's HTTP client to its replicas, comma-separated: http1 "
                        "(its own, as it ships), aiohttp, httpx (bench/router_client_variant"
                        ".py); every (client, k) pair is one configuration of each round, "
                        "and the throughput run is made once per client")
    p.add_argument("--requests", type=int, default=500, help="timed requests per configuration")
    p.add_argument("--rounds", type=int, default=3,
                   help="measure every configuration this many times, in turn, and report "
                        "the median round (this machine's speed drifts by tens of percent "
                        "within minutes)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts in the pool")
    p.add_argument("--prompt-chars", type=int, default=3999)
    p.add_argument("--probe-deadline-ms", type=float, default=None,
                   help="router --probe-deadline-ms (default: the router's own default)")
    p.add_argument("--throughput-k", type=int, default=8)
    p.add_argument("--throughput-concurrency", type=int, default=16)
    p.add_argument("--throughput-seconds", type=float, default=15.0)
    p.add_argument("--no-sglang", action="store_true", help="skip the SGLang gateway")
    p.add_argument("--tracing", action="store_true",
                   help="also measure each configuration with the router tracing (OTLP/HTTP "
                        "to a sink in this process; needs the otel extra)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small, fast smoke run")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.prompts, args.rounds = 40, 10, 16, 1
        args.throughput_seconds = 2.0
    ks = [int(k) for k in args.ks.split(",")]
    clients = [c for c in args.clients.split(",") if c]
    configs = [(c, k, traced) for c in clients for k in ks
               for traced in ((False, True) if args.tracing else (False,))]
    sink = OTLPSink() if args.tracing else None
    bodies = make_prompts(args.prompts, args.prompt_chars, args.seed)
    pages = args.prompts * (-(-(args.prompt_chars + 2) // 32)) * 2 + 256

    load_start = os.getloadavg()
    t_start = time.monotonic()
    results: dict[str, dict] = {}
    rounds: dict[str, list[dict]] = {}  # every round's figures, per configuration
    gateway_rounds: list[dict] = []
    gateway: dict | None = None
    gateway_note = ""
    tputs: dict[str, dict] = {}
    deaths: list[str] = []

    def name(client: str, k: int, traced: bool = False) -> str:
        label = f"k={k}" if clients == ["http1"] else f"{client} k={k}"
        return label + " traced" if traced else label

    def start_router(client: str, k: int, traced: bool = False) -> ServerProcess:
        a = ["--replicas", ",".join(urls), "--policy", "prefix", "--probe-k", str(k),
             "--tokens-per-block", "32", "--log-level", "warning", "--seed", str(args.seed)]
        if traced:
            a += ["--otel-endpoint", sink.url]
        if args.probe_deadline_ms is not None:
            a += ["--probe-deadline-ms", str(args.probe_deadline_ms)]
        if client == "http1":
            return ServerProcess("router", *a)
        return ServerProcess("bench.router_client_variant", "--client", client, *a)

    def check_alive(phase: str) -> None:
        gone = dead(reps)
        if gone:
            deaths.append(f"after {phase}: {', '.join(gone)}")
            raise RuntimeError(
                f"replicas died during {phase}: {', '.join(gone)} (exit -13 is SIGPIPE: "
                f"a replica that dies when it writes to a connection the router closed, "
                f"e.g. a probe cancelled at its deadline)")

    with contextlib.ExitStack() as stack:
        if sink is not None:
            stack.callback(sink.close)
        reps = [stack.enter_context(start_replica(
            "--engine", "sim", "--kv-pages", str(pages), "--tokens-per-block", "32",
            "--sim-speedup", "10000", "--max-num-seqs", "64", "--log-level", "warning"))
            for _ in range(args.replicas)]
        urls = [r.url for r in reps]
        pids = [r.proc.pid for r in reps]
        print(f"{len(reps)} sim replicas up; preloading {len(bodies)} prompts of "
              f"{args.prompt_chars + 1} tokens into each", flush=True)
        preload(urls, bodies)
        direct = {u: Conn(u) for u in urls}
        stack.callback(lambda: [c.close() for c in direct.values()])

        try:
            for rnd in range(1, args.rounds + 1):
                for client, k, traced in configs:
                    with start_router(client, k, traced) as router:
                        r = paired_router_run(router, direct, bodies, args.requests,
                                              args.warmup, pids)
                    rounds.setdefault(name(client, k, traced), []).append(r)
                    check_alive(f"the sequential run at {name(client, k, traced)}")
                    print(f"round {rnd}/{args.rounds} {name(client, k, traced)}: added p50 "
                          f"{r['added']['p50_ms']:.2f} ms, router CPU "
                          f"{r['router_cpu_ms_per_request']:.2f} ms/request", flush=True)
                if args.no_sglang:
                    gateway_note = "SGLang gateway skipped (--no-sglang)"
                elif not gateway_note:
                    try:
                        from loadtest.peers import SGLangRouter
                        with SGLangRouter(urls, policy="cache_aware", model=MODEL) as gw:
                            g = paired_gateway_run(gw, list(direct.values()), bodies,
                                                   args.requests, args.warmup, pids)
                            g["version"] = gw.executable.parent.parent.joinpath(
                                ".installed").read_text().strip()
                        gateway_rounds.append(g)
                        print(f"round {rnd}/{args.rounds} SGLang gateway: CPU "
                              f"{g['gateway_cpu_ms_per_request']:.2f} ms/request", flush=True)
                    except Exception as exc:  # no network to install it, or it would not start
                        check_alive("the SGLang gateway run")
                        gateway_note = f"SGLang gateway skipped: {type(exc).__name__}: " \
                                       f"{str(exc).splitlines()[0] if str(exc) else ''}"
                        print(gateway_note, flush=True)

            for client in clients if args.throughput_seconds > 0 else ():
                # last: the only phase that overloads anything
                with start_router(client, args.throughput_k) as router:
                    tput = throughput_run(router, bodies, args.throughput_concurrency,
                                          args.throughput_seconds)
                tput["k"] = args.throughput_k
                tput["client"] = client
                tputs[client] = tput
                gone = dead(reps)
                tput["replicas_died"] = gone
                print(f"{name(client, args.throughput_k)}: {tput['requests_per_s']:.0f} "
                      f"requests/s at concurrency {args.throughput_concurrency}", flush=True)
                check_alive("the throughput run")
        except RuntimeError as exc:
            if not deaths:
                raise
            print(f"\nERROR: {exc}", flush=True)

    # ---- report
    results = {k: median_round(rs, lambda r: r["added"]["p50_ms"]) for k, rs in rounds.items()}
    if gateway_rounds:
        gateway = median_round(gateway_rounds, lambda g: g["gateway_cpu_ms_per_request"])
    if deaths:
        print("REPLICAS DIED: " + "; ".join(deaths) + " (figures after that are missing "
              "or invalid)")
    print(f"\nrouter overhead, {args.replicas} sim replicas (speed-up 10000), "
          f"{args.prompt_chars + 1}-token prompts (full cache hits), max_tokens 1, "
          f"sequential, {args.requests} requests per row; each row is the median of "
          f"{args.rounds} rounds (ranges below) (ms)")
    rows = []
    for k, r in results.items():
        a, t, d = r["added"], r["through_router"], r["direct"]
        rows.append([f"prefix {k}", r["router_cpu_ms_per_request"],
                     f"{r['router_user_ms_per_request']:.2f}/"
                     f"{r['router_system_ms_per_request']:.2f}",
                     t["p50_ms"], t["p99_ms"], d["p50_ms"], d["p99_ms"],
                     a["p50_ms"], a["p90_ms"], a["p99_ms"], r["replicas_cpu_ms_per_pair"],
                     int(r["probe_failures"])])
    if gateway is not None:
        a, t, d = gateway["added_per_request"], gateway["through_gateway"], \
            gateway["direct_round_robin"]
        rows.append(["sglang cache_aware", gateway["gateway_cpu_ms_per_request"], "-",
                     t["p50_ms"], t["p99_ms"], d["p50_ms"], d["p99_ms"],
                     a["p50_ms"], a["p90_ms"], a["p99_ms"], gateway["replicas_cpu_ms_per_pair"],
                     "-"])
    print_table(["front", "CPU/req", "user/sys", "via p50", "via p99", "direct p50", "direct p99",
                 "added p50", "added p90", "added p99", "replicas CPU/pair", "probe fails"],
                rows)
    for k, rs in rounds.items():
        cpu = sorted(r["router_cpu_ms_per_request"] for r in rs)
        added = sorted(r["added"]["p50_ms"] for r in rs)
        print(f"{k} over {len(rs)} rounds: router CPU {cpu[0]:.2f}-{cpu[-1]:.2f} ms "
              f"(median {cpu[len(cpu) // 2]:.2f}), added p50 {added[0]:.2f}-{added[-1]:.2f} ms "
              f"(median {added[len(added) // 2]:.2f})")
    ab = client_ab(rounds, tputs, clients, ks, name)
    for line in ab.get("lines", []):
        print(line)
    tracing = tracing_ab(rounds, clients, ks, name, sink) if sink is not None else None
    for line in (tracing or {}).get("lines", []):
        print(line)
    if gateway is not None:
        dd = gateway["distribution_difference"]
        print(f"sglang: difference of distributions (via - direct round robin): "
              f"p50 {dd['p50_ms']:.2f}, p90 {dd['p90_ms']:.2f}, p99 {dd['p99_ms']:.2f} ms")
    if gateway_note:
        print(gateway_note)
    for client, tput in tputs.items():
        lat = tput["latency"] or {}
        print(f"\nthroughput through the router ({client} client, prefix, k={tput['k']}), "
              f"closed loop, "
              f"concurrency {tput['concurrency']}, {tput['seconds']:.1f} s: "
              f"{tput['requests_per_s']:.0f} requests/s, {tput['failures']} failures, "
              f"latency p50 {lat.get('p50_ms', float('nan')):.1f} ms p99 "
              f"{lat.get('p99_ms', float('nan')):.1f} ms; router CPU "
              f"{tput['router_cpu_ms_per_request']:.2f} ms/request "
              f"({tput['router_cpu_utilisation'] * 100:.0f}% of a core), load generator "
              f"{tput['client_cpu_utilisation'] * 100:.0f}% of a core, "
              f"{int(tput['probe_failures'])} probes without an answer in time")
    elapsed = time.monotonic() - t_start
    print(f"(run took {elapsed:.0f} s)")
    if not args.no_write:
        write_result("router_overhead", {
            "args": vars(args),
            "loadavg_at_start": load_start,
            "setup": {"replicas": args.replicas, "sim_speedup": 10000, "kv_pages": pages,
                      "prompt_tokens": args.prompt_chars + 1, "max_tokens": 1,
                      "cache_state": "every prompt preloaded on every replica (full hits)",
                      "cpu_clock_ticks_per_s": CLK_TCK},
            "router": results,
            "router_rounds": rounds,
            "client_ab": ab.get("saving"),
            "tracing_ab": (tracing or {}).get("cost"),
            "sglang_gateway": gateway,
            "sglang_gateway_rounds": gateway_rounds,
            "sglang_note": gateway_note or None,
            "throughput": tputs.get("http1") if clients == ["http1"] else tputs,
            "replicas_died": deaths,
            "run_seconds": elapsed,
        }, args.out)


if __name__ == "__main__":
    main()
