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

from . import bounds as model_bounds
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
    c.add_argument("--model", default=None, metavar="DIR",
                   help="the replicas are sim replicas of this checkpoint's model (its config: "
                        "pools, windows, recurrent layers, reuse rules; no weights); the bounds "
                        "replay under its rules, and --cache-pressure sizes each of its pools")
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
    config = DriverConfig(url="", rate=args.rate, burstiness=args.burstiness,
                          concurrency=args.concurrency, max_seconds=args.max_seconds,
                          seed=args.seed)
    out_dir = Path(args.out_dir)
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model_bound = None
    if args.model is not None:
        model_bound = _model_pages(args, requests, config, log_dir)
    elif args.cache_pressure is not None:
        blocks = compare.working_set_blocks(requests, args.tokens_per_block)
        args.kv_pages = max(1, int(blocks / (args.cache_pressure * args.replicas)))
        print(f"cache pressure {args.cache_pressure:g}: working set {blocks} blocks, "
              f"{args.kv_pages} KV pages per replica", file=sys.stderr)
    pages = args.kv_pages if isinstance(args.kv_pages, int) else ",".join(map(str,
                                                                             args.kv_pages))
    replica_args = ["--engine", "sim", *(["--model", args.model] if args.model else []),
                    "--kv-pages", str(pages), "--tokens-per-block",
                    str(args.tokens_per_block), "--log-level", "warning",
                    *shlex.split(args.replica_args)]
    router_args = ["--tokens-per-block", str(args.tokens_per_block), "--seed", str(args.seed),
                   "--log-level", "warning", *shlex.split(args.router_args)]
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
    if model_bound is not None:
        bound = model_bound(args.kv_pages)
    else:
        bound = compare.bounds(requests, config, args.replicas, args.kv_pages,
                               args.tokens_per_block)
    rr = docs.get(label("round_robin", counts[0]))
    prefix = docs.get(label("prefix", counts[0]))
    rows = [compare.summary_row(name, doc, rr, prefix) for name, doc in docs.items()]
    setup = {"workload": desc, "replicas": args.replicas, "kv_pages": args.kv_pages,
             "tokens_per_block": args.tokens_per_block, "rate": args.rate,
             "burstiness": args.burstiness, "concurrency": args.concurrency,
             "routers": counts, "restart_at": args.restart_at,
             "cache_pressure": args.cache_pressure, "model": args.model,
             "replica_args": replica_args, "router_args": router_args}
    model = f" of {Path(args.model).name}" if args.model else ""
    text = (f"Workload {desc}; {args.replicas} sim replicas{model} x {pages} KV pages of "
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


def _model_pages(args: argparse.Namespace, requests, config: DriverConfig, log_dir: Path):
    """With ``--model``: the workload replayed once through a sim replica of the model that
    never evicts (the infinite bound, and the working set of each pool); ``--cache-pressure``
    then sizes each pool from its working set (``args.kv_pages`` becomes one count per
    pool). Returns the function that computes the bounds for the pages finally used."""
    ordered = compare.arrival_order(requests, config)
    n_pools = model_bounds.pool_count(args.model)
    tpb = args.tokens_per_block
    print(f"replaying {len(ordered)} requests through one sim replica of {args.model} "
          "(the infinite bound)", file=sys.stderr)
    same = shlex.split(args.replica_args)  # e.g. --snapshot-interval-blocks: same rules
    infinite = model_bounds.replay(ordered, args.model, model_bounds.never_evicting_pages(
        ordered, tpb, n_pools), tpb, log_dir, same)
    working_set = [p["block_pages"] for p in infinite.pools]
    if args.cache_pressure is not None:
        floors = [_floor(p["life_cycle"], ordered, tpb) for p in infinite.pools]
        args.kv_pages = tuple(model_bounds.pressure_pages(working_set, args.cache_pressure,
                                                          args.replicas, floors))
        print(f"cache pressure {args.cache_pressure:g}: working set per pool "
              f"{working_set}, {list(args.kv_pages)} KV pages per replica", file=sys.stderr)

    def bound(kv_pages) -> dict:
        per_pool = [kv_pages] * n_pools if isinstance(kv_pages, int) else list(kv_pages)
        print("replaying them through one sim replica with every replica's pages (the pooled "
              "bound)", file=sys.stderr)
        pooled = model_bounds.replay(ordered, args.model, [n * args.replicas
                                                           for n in per_pool], tpb, log_dir,
                                     same)
        return {"pooled": pooled.hit_rate, "infinite": infinite.hit_rate,
                "working_set_pages": dict(zip([p["life_cycle"] for p in infinite.pools],
                                              working_set))}
    return bound


def _floor(life_cycle: str, requests, tokens_per_block: int) -> int:
    """Pages a pool needs for one request to run at all: every block of the longest one
    (full attention), a window's worth and two (sliding), one live state and three (recurrent)."""
    if life_cycle == "recurrent":
        return 4
    if life_cycle.startswith("sliding_window("):
        window = int(life_cycle.removeprefix("sliding_window(").split(")")[0].split(",")[0])
        return window // tokens_per_block + 2
    return max(map(model_bounds.tokens_at_most, requests)) // tokens_per_block + 2
