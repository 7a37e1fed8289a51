"""Probe misses under load: do the prefix policy's probes still answer in time when the
cluster is busy, and what does the hit rate lose when they do not?

The reference workload (BENCHMARKS.md: 32 groups x 16 prompts, 2048-token system prompts,
128-token questions, 32 output tokens) through a fresh local cluster per concurrency (8 sim
replicas at speed-up 1 with 512 KV pages of 32 tokens, our router with ``--policy prefix``
and its default probe deadline), closed loop at concurrency 1, 4, 16 and 32: the identical
request sequence each time. Reported per concurrency: the token hit rate (from the answers'
``cached_tokens``), its difference from the sequential run (concurrency 1), probes sent,
probes without an answer by the deadline (router ``router_probe_failures_total``; a miss is
a decision made without that replica's reuse), the probe round trip's p50/p99 (from the
router's ``router_probe_latency_seconds`` histogram, bucket upper bounds), the router's
decision overhead p50/p99 (arrival to upstream request, same kind of histogram), TTFT,
the connections the router opened to the replicas (``router_upstream_connections_opened``),
the probe round trips' whole histogram (cumulative counts per bucket),
and the CPU time of the router, of the replicas and of the load generator over the run
(from ``/proc``), so the 2 cores' share is visible.

    .venv/bin/python -m bench.probe_misses [--concurrency 1,4,16,32] [--quick]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import httpx

from loadtest.cluster import LocalCluster
from loadtest.driver import DriverConfig, run
from loadtest.report import build_report
from loadtest.workloads import shared_prefix

from ._common import metric_samples, print_table, write_result

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def total(samples, name: str, **match: str) -> float:
    return sum(v for n, labels, v in samples
               if n == name and all(labels.get(k) == m for k, m in match.items()))


def histogram_quantile(samples, name: str, q: float) -> float | None:
    """The upper bound (ms) of the bucket holding quantile ``q``, summed over labels."""
    buckets: dict[float, float] = {}
    for n, labels, v in samples:
        if n == name + "_bucket":
            le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    if not buckets or buckets[max(buckets)] == 0:
        return None
    count = buckets[max(buckets)]
    for le in sorted(buckets):
        if buckets[le] >= q * count:
            return le * 1e3
    return None


def buckets(samples, name: str) -> dict[str, float]:
    """A histogram's cumulative bucket counts (upper bound -> count), summed over labels."""
    out: dict[str, float] = {}
    for n, labels, v in samples:
        if n == name + "_bucket":
            out[labels["le"]] = out.get(labels["le"], 0.0) + v
    return out


def one_run(concurrency: int, requests, args) -> dict:
    replica_args = ["--engine", "sim", "--kv-pages", str(args.kv_pages), "--tokens-per-block",
                    str(args.tokens_per_block), "--log-level", "warning"]
    router_args = ["--tokens-per-block", str(args.tokens_per_block), "--seed", str(args.seed),
                   "--log-level", "warning", *args.router_args.split()]
    with LocalCluster(args.replicas, "prefix", replica_args, router_args) as c:
        pids = {"router": c.router.proc.pid, "replicas": [r.proc.pid for r in c.replicas]}
        before = (cpu_seconds(pids["router"]), sum(map(cpu_seconds, pids["replicas"])),
                  self_cpu())
        t0 = time.monotonic()
        result = run(requests, DriverConfig(url=c.router.url, concurrency=concurrency,
                                            max_seconds=args.max_seconds, seed=args.seed))
        wall = time.monotonic() - t0
        after = (cpu_seconds(pids["router"]), sum(map(cpu_seconds, pids["replicas"])),
                 self_cpu())
        samples = metric_samples(httpx.get(c.router.url + "/metrics", timeout=10).text)
        alive = sum(r.proc.poll() is None for r in c.replicas)
    summary = build_report(result)["summary"]
    probes_ok = total(samples, "router_probe_latency_seconds_count")
    misses = total(samples, "router_probe_failures_total", kind="timeout")
    errors = total(samples, "router_probe_failures_total", kind="error")
    sent = probes_ok + misses + errors
    return {
        "concurrency": concurrency,
        "requests": summary["requests"], "completed": summary["completed"],
        "failed": summary["failed"], "replicas_alive": alive,
        "token_hit_rate": summary["token_hit_rate"],
        "probes_sent": int(sent), "probe_misses": int(misses), "probe_errors": int(errors),
        "probe_miss_rate": misses / sent if sent else None,
        "connections_opened": int(total(samples, "router_upstream_connections_opened_total")),
        "probe_p50_ms_le": histogram_quantile(samples, "router_probe_latency_seconds", 0.5),
        "probe_p99_ms_le": histogram_quantile(samples, "router_probe_latency_seconds", 0.99),
        "probe_latency_buckets_s": buckets(samples, "router_probe_latency_seconds"),
        "overhead_p50_ms_le": histogram_quantile(samples, "router_overhead_seconds", 0.5),
        "overhead_p99_ms_le": histogram_quantile(samples, "router_overhead_seconds", 0.99),
        "ttft_ms": summary["ttft_ms"],
        "request_throughput": summary["request_throughput"],
        "wall_s": wall,
        "cpu_s": {"router": after[0] - before[0], "replicas": after[1] - before[1],
                  "load_generator": after[2] - before[2]},
        "cpu_utilisation_of_2_cores": (sum(after) - sum(before)) / wall / os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--kv-pages", type=int, default=512)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--router-args", default="", help="more router flags, one string")
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 groups x 8 prompts (a smoke run)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    groups, per_group = (8, 8) if args.quick else (32, 16)
    requests = shared_prefix(groups=groups, prompts_per_group=per_group, system_len=2048,
                             question_len=128, output_len=32, seed=args.seed)
    runs = []
    for c in [int(x) for x in args.concurrency.split(",") if x]:
        print(f"concurrency {c}: {len(requests)} requests ...", flush=True)
        r = one_run(c, requests, args)
        runs.append(r)
        print(f"  hit rate {r['token_hit_rate']:.3f}, {r['probe_misses']} of "
              f"{r['probes_sent']} probes missed, {r['failed']} failed", flush=True)
    base = runs[0]["token_hit_rate"] if runs and runs[0]["concurrency"] == 1 else None
    for r in runs:
        r["hit_rate_vs_sequential"] = (r["token_hit_rate"] / base - 1
                                       if base and r["token_hit_rate"] is not None else None)
    rows = [[r["concurrency"], f"{r['token_hit_rate']:.3f}",
             "" if r["hit_rate_vs_sequential"] is None else f"{r['hit_rate_vs_sequential']:+.1%}",
             r["probes_sent"], r["probe_misses"],
             f"{(r['probe_miss_rate'] or 0):.2%}",
             f"<={r['probe_p50_ms_le']:g}/<={r['probe_p99_ms_le']:g}",
             f"{r['ttft_ms']['p50']:.1f}/{r['ttft_ms']['p99']:.1f}",
             f"{r['cpu_utilisation_of_2_cores']:.0%}", r["failed"], r["connections_opened"]]
            for r in runs]
    print_table(["concurrency", "hit rate", "vs sequential", "probes", "missed", "miss rate",
                 "probe p50/p99 ms", "TTFT p50/p99 ms", "CPU of 2 cores", "failed",
                 "connections opened"], rows)
    if not args.no_write:
        write_result("probe_misses", {
            "setup": {"workload": {"groups": groups, "prompts_per_group": per_group,
                                   "system_len": 2048, "question_len": 128, "output_len": 32,
                                   "seed": args.seed},
                      "replicas": args.replicas, "kv_pages": args.kv_pages,
                      "tokens_per_block": args.tokens_per_block,
                      "router_args": args.router_args},
            "runs": runs, "args": vars(args)}, out=args.out)


if __name__ == "__main__":
    main()
