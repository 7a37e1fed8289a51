"""``python -m loadtest simulate``: policies side by side in the discrete-event simulator.

Defaults are the project's reference workload (BENCHMARKS.md): 32 groups x 16 prompts,
2048-token system prompts, 128-token questions, 32 output tokens, Poisson arrivals at 40
requests/s, 8 replicas with 512 KV pages of 32 tokens each (a quarter of the groups' system
prompts per replica).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from replicas.engines.sim import SimTiming

from .driver import arrival_offsets
from .simulate import SimConfig, SimResult, bound_hit_rate, simulate, to_sim_requests
from .workloads import add_workload_arguments, use_reference_workload, workload_from_args

DEFAULT_POLICIES = "prefix,approx_prefix,round_robin,random,least_loaded,power_of_two,session"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    use_reference_workload(p)
    s = p.add_argument_group("simulation")
    s.add_argument("--rate", type=float, default=12.0,
                   help="Poisson arrivals per second (12: the reference workload's, as in "
                        "loadtest compare)")
    s.add_argument("--burstiness", type=float, default=1.0)
    s.add_argument("--replicas", type=int, default=8)
    s.add_argument("--kv-pages", type=int, default=512, help="per replica (512)")
    s.add_argument("--tokens-per-block", type=int, default=32)
    s.add_argument("--max-batched-tokens", type=int, default=2048)
    s.add_argument("--prefill-tokens-per-s", type=float, default=SimTiming.prefill_tokens_per_s)
    s.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated")
    s.add_argument("--probe-k", default="", help="also run the prefix policy probing k "
                   "replicas, for each k in this comma-separated list")
    s.add_argument("--no-bounds", action="store_true", help="skip the pooled/infinite bounds")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", help="write the JSON report here")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    workload, desc = workload_from_args(args)
    offsets = arrival_offsets(len(workload), args.rate, args.burstiness, seed=args.seed) \
        if args.rate > 0 else [r.arrival_s for r in workload]
    requests = to_sim_requests(workload, offsets, args.tokens_per_block)
    prep_s = time.perf_counter() - t0
    timing = SimTiming(prefill_tokens_per_s=args.prefill_tokens_per_s)
    cfg = dict(replicas=args.replicas, kv_pages=args.kv_pages,
               tokens_per_block=args.tokens_per_block,
               max_batched_tokens=args.max_batched_tokens, timing=timing, seed=args.seed)
    print(f"{len(requests)} requests ({desc['name']}), prepared in {prep_s:.1f} s; "
          f"{args.replicas} replicas x {args.kv_pages} pages", file=sys.stderr)
    runs: list[tuple[str, SimResult]] = []
    for policy in [p for p in args.policies.split(",") if p]:
        runs.append((policy, _one(requests, policy, SimConfig(**cfg))))
    for k in [int(x) for x in args.probe_k.split(",") if x]:
        runs.append((f"prefix k={k}", _one(requests, "prefix", SimConfig(**cfg, probe_k=k))))
    bounds = {}
    if not args.no_bounds:
        t = time.perf_counter()
        bounds = {"pooled": bound_hit_rate(requests, args.replicas * args.kv_pages,
                                           args.tokens_per_block),
                  "infinite": bound_hit_rate(requests, None, args.tokens_per_block)}
        print(f"bounds in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    report = _report(desc, vars(args), runs, bounds)
    print(format_table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _one(requests, policy: str, cfg: SimConfig) -> SimResult:
    label = policy if cfg.probe_k is None else f"{policy} k={cfg.probe_k}"
    progress = lambda done, total: print(f"  {label}: {done}/{total}", file=sys.stderr)
    result = simulate(requests, policy, cfg, progress)
    print(f"{label}: {result.wall_s:.1f} s for {result.requests} requests", file=sys.stderr)
    return result


def _summary(r: SimResult) -> dict:
    ttft = sorted(r.ttft_s)
    return {"requests": r.requests, "token_hit_rate": r.hit_rate,
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
            "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
            "load_imbalance": r.imbalance, "requests_per_replica": r.requests_per_replica,
            "prefill_tokens_per_replica": r.prefill_tokens_per_replica,
            "simulated_s": r.sim_s, "wall_s": r.wall_s}


def _report(desc: dict, args: dict, runs, bounds: dict) -> dict:
    return {"schema": "loadtest.simulate/1", "workload": desc,
            "settings": {k: v for k, v in args.items() if k != "func"},
            "bounds": bounds, "runs": {label: _summary(r) for label, r in runs}}


def format_table(report: dict) -> str:
    bounds = report["bounds"]
    rr = report["runs"].get("round_robin")
    lines = [f"{'policy':<16}{'hit rate':>9}{'/pooled':>8}{'/rr':>6}{'TTFT mean':>11}"
             f"{'TTFT p99':>10}{'/rr mean':>9}{'imbalance':>10}{'wall s':>8}"]
    for label, s in report["runs"].items():
        pooled = f"{s['token_hit_rate'] / bounds['pooled']:.2f}" if bounds.get("pooled") else "-"
        vs_rr = f"{s['token_hit_rate'] / rr['token_hit_rate']:.1f}" if rr else "-"
        ttft_rr = f"{s['ttft_mean_s'] / rr['ttft_mean_s']:.2f}" if rr else "-"
        lines.append(f"{label:<16}{s['token_hit_rate']:>9.3f}{pooled:>8}{vs_rr:>6}"
                     f"{s['ttft_mean_s'] * 1e3:>9.1f}ms{s['ttft_p99_s'] * 1e3:>8.1f}ms"
                     f"{ttft_rr:>9}{s['load_imbalance']:>10.2f}{s['wall_s']:>8.1f}")
    if bounds:
        lines.append(f"bounds: pooled {bounds['pooled']:.3f}, infinite {bounds['infinite']:.3f}")
    return "\n".join(lines)
