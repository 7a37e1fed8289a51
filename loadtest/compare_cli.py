"""``python -m loadtest compare``: see ``loadtest/compare.py``.

Defaults are the project's reference workload (BENCHMARKS.md): 32 groups x 16 prompts,
2048-token system prompts, 128-token questions, 32 output tokens, Poisson arrivals at 12
requests/s (the round-robin cluster's replicas are then about 13% busy with prefill: well
below saturation), 8 sim replicas with 512 KV pages of 32 tokens each (a quarter of the
groups' system prompts per replica).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from . import compare
from .driver import DriverConfig
from .workloads import add_workload_arguments, use_reference_workload, workload_from_args

ALL_POLICIES = "prefix,approx_prefix,round_robin,random,least_loaded,power_of_two,session"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    use_reference_workload(p)
    c = p.add_argument_group("clusters")
    c.add_argument("--policies", default=ALL_POLICIES, help="comma-separated (all seven)")
    c.add_argument("--replicas", type=int, default=8)
    c.add_argument("--kv-pages", type=int, default=512, help="per replica (512)")
    c.add_argument("--cache-pressure", type=float, default=None, metavar="X",
                   help="size --kv-pages so that the workload's working set (its distinct "
                        "prompt blocks) is X times the cluster's pages, e.g. 3")
    c.add_argument("--tokens-per-block", type=int, default=32)
    c.add_argument("--routers", default="1",
                   help="independent routers before the same replicas (requests spread over "
                        "them, sessions sticky); a comma-separated list makes one column per "
                        "policy and count, e.g. 1,2,4,8 (1)")
    c.add_argument("--restart-at", type=float, default=None, metavar="SECONDS",
                   help="kill replica 0 this long into each run and start it again, empty, "
                        "on its port; the table then shows how the hit rate recovered")
    c.add_argument("--window-s", type=float, default=5.0,
                   help="with --restart-at: the windows the hit rate is measured over (5)")
    c.add_argument("--replica-args", default="", help="more replica flags, one string")
    c.add_argument("--router-args", default="", help="more router flags, one string")
    c.add_argument("--external", action="append", default=[],
                   choices=["sglang", "vllm-router"],
                   help="add a peer router as a column: the SGLang model gateway or vLLM's "
                        "router, cache_aware (installed in .peers/ on first use)")
    c.add_argument("--external-cmd", action="append", default=[], metavar="NAME=COMMAND",
                   help="add any router: COMMAND with {port}, {workers}, {workers_comma}")
    d = p.add_argument_group("load")
    d.add_argument("--rate", type=float, default=12.0, help="Poisson requests/s (12)")
    d.add_argument("--burstiness", type=float, default=1.0)
    d.add_argument("--concurrency", type=int, default=None)
    d.add_argument("--max-seconds", type=float, default=900.0, help="per run (900)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out-dir", default="artifacts/compare")


def run(args: argparse.Namespace) -> int:
    requests, desc = workload_from_args(args)
    if args.cache_pressure is not None:
        blocks = compare.working_set_blocks(requests, args.tokens_per_block)
        args.kv_pages = max(1, int(blocks / (args.cache_pressure * args.replicas)))
        print(f"cache pressure {args.cache_pressure:g}: working set {blocks} blocks, "
              f"{args.kv_pages} KV pages per replica", file=sys.stderr)
    config = DriverConfig(url="", rate=args.rate, burstiness=args.burstiness,
                          concurrency=args.concurrency, max_seconds=args.max_seconds,
                          seed=args.seed)
    replica_args = ["--engine", "sim", "--kv-pages", str(args.kv_pages), "--tokens-per-block",
                    str(args.tokens_per_block), "--log-level", "warning",
                    *shlex.split(args.replica_args)]
    router_args = ["--tokens-per-block", str(args.tokens_per_block), "--seed", str(args.seed),
                   "--log-level", "warning", *shlex.split(args.router_args)]
    out_dir = Path(args.out_dir)
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    docs: dict[str, dict] = {}
    counts = [int(n) for n in args.routers.split(",") if n]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--routers needs counts >= 1, got {args.routers!r}")
    label = (lambda name, n: name) if counts == [1] else (lambda name, n: f"{name} x{n}")
    for policy in [p for p in args.policies.split(",") if p]:
        for n in counts:
            print(f"== {label(policy, n)}: {args.replicas} replicas + {n} router(s), "
                  f"{len(requests)} requests", file=sys.stderr)
            docs[label(policy, n)] = compare.run_policy(
                policy, requests, config, args.replicas, replica_args, router_args, log_dir,
                routers=n, restart_at=args.restart_at, window_s=args.window_s)
    for name in args.external:
        for n in counts:
            print(f"== {label(name, n)} (external)", file=sys.stderr)
            docs[label(name, n)] = compare.run_external(
                name, None, requests, config, args.replicas, replica_args, log_dir,
                routers=n, restart_at=args.restart_at, window_s=args.window_s)
    for spec in args.external_cmd:
        name, _, command = spec.partition("=")
        if not command:
            raise SystemExit(f"--external-cmd needs NAME=COMMAND, got {spec!r}")
        print(f"== {name} (external command)", file=sys.stderr)
        docs[name] = compare.run_external(name, command, requests, config, args.replicas,
                                          replica_args, log_dir)
    bound = compare.bounds(requests, config, args.replicas, args.kv_pages,
                           args.tokens_per_block)
    rr = docs.get(label("round_robin", counts[0]))
    rows = [compare.summary_row(name, doc, rr) for name, doc in docs.items()]
    setup = {"workload": desc, "replicas": args.replicas, "kv_pages": args.kv_pages,
             "tokens_per_block": args.tokens_per_block, "rate": args.rate,
             "burstiness": args.burstiness, "concurrency": args.concurrency,
             "routers": counts, "restart_at": args.restart_at,
             "cache_pressure": args.cache_pressure,
             "replica_args": replica_args, "router_args": router_args}
    text = (f"Workload {desc}; {args.replicas} sim replicas x {args.kv_pages} KV pages of "
            f"{args.tokens_per_block} tokens; arrivals: rate {args.rate}/s, burstiness "
            f"{args.burstiness}" +
            (f"; {'/'.join(map(str, counts))} independent routers (xN)" if counts != [1]
             else "") +
            (f"; replica 0 restarted empty {args.restart_at:g} s in" if args.restart_at
             else "") + ".")
    compare.write(out_dir, docs, rows, bound, setup, text)
    print(compare.markdown(rows, bound, text))
    print(f"wrote {out_dir}/compare.json, compare.md and plots", file=sys.stderr)
    # a restart kills the streams flowing from that replica: its failures are the table's
    return 0 if args.restart_at is not None or all(r["failed"] == 0 for r in rows) else 1
