"""Issue 13 before and after: reuse on a hybrid model, today's KV-cache rules against the new.

A real replica scheduler (``replicas.scheduler.Scheduler``) drives a ``KVCacheManager``
in-process, with the ``sim`` engine's timing model (20k prefill tokens/s, 2 ms per step at
speed-up 1: it sleeps for the modelled time, so TTFT is real scheduler time). Cache
configurations: ``hybrid`` = the torch ``hybrid`` preset's life cycles (full attention,
sliding window of 512, recurrent), ``full`` = full attention only (the yardstick); both
32 tokens per block, partial reuse on, and ``pages_without_pressure`` pages per pool (every
request's blocks as if nothing were ever reused or freed, so no page is ever evicted: the
issue is about the rules, not capacity). The scheduler is that of config/replica-hybrid.yaml
(``max_num_seqs`` 8, ``max_batched_tokens`` 256: prefill chunks of 8 blocks).

Workloads (seeded, token level):
- ``shared_prompt``: 48 requests = one 1,024-token system prompt (twice the window) + a
  distinct 64-token question, 16 output tokens, from 3 closed-loop clients (exponential think
  time, mean 50 ms).
- ``multi_turn``: 4 conversations of 6 turns; a 256-token opening message, then 32-96-token
  messages; answers of 16-48 tokens; a turn's prompt is the previous prompt + the tokens the
  scheduler generated + the new message, sent when the previous turn finished plus a think
  time (mean 100 ms).
Plus ``shared_prompt`` on ``hybrid`` with ``--variant-max-batched-tokens`` (2048, the
replica default): a recurrent prefix can only end at a kept snapshot, and a prefill chunk
leaves one only where it ends on a block boundary, so with one chunk per prompt the system
prompt's end may carry none.

"Before" is ``--before`` (488841c, today's rules) checked out as a git worktree under /tmp;
"after" is this working tree. Each round runs ``bench/_kvcache_hybrid_worker.py`` once per
revision (before, after, in turn) as a subprocess with that revision's tree first on
PYTHONPATH; the worker checks and records which files it loaded. Per row: token hit rate
(sum cached / sum prompt tokens, ``cached_tokens`` as usage reports it), TTFT mean/p50/p99
(arrival to first token); the table shows medians over rounds.

    .venv/bin/python -m bench.kvcache_hybrid            # ~70 s on 2 cores
    .venv/bin/python -m bench.kvcache_hybrid --quick    # one small round

Expected after issue 13: the hybrid shared-prompt hit rate within 5% of full attention's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench._common import write_result

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_kvcache_hybrid_worker.py"
TARGET_GAP = 0.05  # hybrid shared-prompt hit rate at most 5% below full attention's
CODES = ("before", "after")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kvcache_hybrid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="488841c", help="revision with today's rules")
    p.add_argument("--worktree", default=None,
                   help="where to check out --before (default /tmp/prefix-router-SHA12)")
    p.add_argument("--rounds", type=int, default=3, help="before+after pairs, interleaved")
    p.add_argument("--requests", type=int, default=48, help="shared-prompt requests")
    p.add_argument("--clients", type=int, default=3, help="shared-prompt closed-loop clients")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16, help="shared-prompt output tokens")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--window", type=int, default=512, help="the hybrid preset's window")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-batched-tokens", type=int, default=256,
                   help="prefill chunk budget per step (config/replica-hybrid.yaml)")
    p.add_argument("--variant-max-batched-tokens", type=int, default=2048,
                   help="chunk budget of the extra hybrid shared-prompt row (0: no such row)")
    p.add_argument("--sim-speedup", type=float, default=1.0,
                   help="divides every modelled time (TTFT figures shrink with it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small, fast smoke run")
    p.add_argument("--no-write", action="store_true", help="do not write the JSON result")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/results/kvcache_hybrid.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.conversations, args.turns = 1, 12, 2, 4
    return args


def spec_for(args: argparse.Namespace) -> dict:
    """What every worker runs (the same for both revisions)."""
    chunk = args.max_batched_tokens
    rows = [{"workload": "shared_prompt", "config": c, "max_batched_tokens": chunk}
            for c in ("hybrid", "full")]
    if args.variant_max_batched_tokens:
        rows.append({"workload": "shared_prompt", "config": "hybrid",
                     "max_batched_tokens": args.variant_max_batched_tokens})
    rows += [{"workload": "multi_turn", "config": c, "max_batched_tokens": chunk}
             for c in ("hybrid", "full")]
    return {
        "tokens_per_block": args.tokens_per_block, "window": args.window, "seed": args.seed,
        "sim_speedup": args.sim_speedup, "max_num_seqs": args.max_num_seqs,
        "workloads": {
            "shared_prompt": {"requests": args.requests, "clients": args.clients,
                              "system_tokens": args.system_tokens,
                              "question_tokens": args.question_tokens,
                              "max_tokens": args.max_tokens, "think_mean_s": 0.05},
            "multi_turn": {"conversations": args.conversations, "turns": args.turns,
                           "first_tokens": 256, "message_tokens": [32, 96],
                           "answer_tokens": [16, 48], "think_mean_s": 0.1},
        },
        "rows": rows,
    }


# --------------------------------------------------------------------------- revisions

def git(*cmd: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *cmd], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout.strip()


def before_tree(rev: str, where: str | None) -> tuple[str, Path]:
    """A clean worktree of ``rev`` (created, or reused when it is already there)."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = Path(where or f"/tmp/prefix-router-{sha[:12]}")
    if not path.exists():
        for attempt in range(5):  # another git command may hold a lock for a moment
            try:
                git("worktree", "add", "--detach", str(path), sha)
                break
            except subprocess.CalledProcessError as exc:
                if "lock" not in exc.stderr or attempt == 4:
                    raise SystemExit(f"git worktree add {path} {sha} failed: {exc.stderr}")
                time.sleep(2)
    head = git("rev-parse", "HEAD", cwd=path)
    if head != sha:
        raise SystemExit(f"{path} is at {head}, not {rev} ({sha}); remove it "
                         f"(git worktree remove {path}) or pass --worktree")
    if git("status", "--porcelain", "--", "kvcache", "replicas", cwd=path):
        raise SystemExit(f"{path} has local changes in kvcache/ or replicas/; "
                         f"git -C {path} checkout -- . or pass --worktree")
    return sha, path


def run_worker(tree: Path, spec: dict) -> dict:
    """One worker subprocess over ``tree``'s code; its progress goes to our stderr."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, str(WORKER)], cwd=tree, env=env, text=True,
                          input=json.dumps({**spec, "expect_code_root": str(tree)}),
                          stdout=subprocess.PIPE, stderr=None, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker over {tree} failed (exit {proc.returncode})")
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------- figures

def row_key(row: dict) -> str:
    return f"{row['workload']}/{row['config']}/chunk{row['max_batched_tokens']}"


def summarise(row: dict) -> dict:
    """One run of one row: hit rate, TTFT figures (ms), and its per-request reuse."""
    recs = sorted(row["records"], key=lambda r: r["id"])
    prompt = sum(r["prompt_tokens"] for r in recs)
    cached = sum(r["cached_tokens"] for r in recs)
    ttft = np.asarray([r["ttft_s"] for r in recs]) * 1e3
    return {
        "requests": len(recs), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt,
        "hit_rate_before_hybrid_pruning": sum(r["cached_before_pruning"] for r in recs) / prompt,
        "ttft_mean_ms": float(ttft.mean()), "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)), "seconds": row["seconds"],
        "evicted_blocks": row["evicted_blocks"], "preemptions": row["preemptions"],
        "num_pages": row["num_pages"],
        "cached_per_request": [r["cached_tokens"] for r in recs],
    }


def combine(runs: list[dict]) -> dict:
    """Rounds of one row and revision: medians, and the spread of the hit rate."""
    med = {k: statistics.median(r[k] for r in runs)
           for k in ("hit_rate", "hit_rate_before_hybrid_pruning", "ttft_mean_ms",
                     "ttft_p50_ms", "ttft_p99_ms")}
    return {**med, "hit_rate_min": min(r["hit_rate"] for r in runs),
            "hit_rate_max": max(r["hit_rate"] for r in runs), "rounds": len(runs),
            "requests": runs[0]["requests"], "prompt_tokens": runs[0]["prompt_tokens"]}


def check_runs(results: dict[str, list[dict]]) -> list[str]:
    """What would make the comparison unfair, in words (empty when nothing is wrong)."""
    problems = []
    for code, runs in results.items():
        if len({r["code"]["sources_sha256"] for r in runs}) > 1:
            problems.append(f"the {code} code changed between rounds")
    prompts = {}
    for code, runs in results.items():
        for run in runs:
            for row in run["rows"]:
                key = row_key(row)
                if row["evicted_blocks"] or row["preemptions"]:
                    problems.append(f"{code} {key}: {row['evicted_blocks']} blocks evicted, "
                                    f"{row['preemptions']} preemptions (cache pressure)")
                got = sorted((r["id"], r["prompt_tokens"]) for r in row["records"])
                if prompts.setdefault(row["workload"], got) != got:
                    problems.append(f"{code} {key}: prompts differ from the first run's")
    return problems


def print_markdown(headers: list[str], rows: list[list]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" if i < 4 else "---:" for i in range(len(headers))) + "|")
    for r in rows:
        print("| " + " | ".join(str(v) for v in r) + " |")


def report(args: argparse.Namespace, spec: dict, revs: dict, results: dict[str, list[dict]],
           elapsed: float) -> dict:
    per_code = {code: [{row_key(r): summarise(r) for r in run["rows"]} for run in runs]
                for code, runs in results.items()}
    rows = []
    for row in spec["rows"]:
        key = row_key(row)
        for code in CODES:
            rows.append({"row": key, **row, "code": code,
                         **combine([run[key] for run in per_code[code]])})
    print()
    print_markdown(["workload", "cache", "chunk", "rules", "hit rate", "TTFT mean ms",
                    "TTFT p50 ms", "TTFT p99 ms", "requests"],
                   [[r["workload"], r["config"], r["max_batched_tokens"], r["code"],
                     f"{r['hit_rate']:.4f}", f"{r['ttft_mean_ms']:.1f}",
                     f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p99_ms']:.1f}", r["requests"]]
                    for r in rows])
    find = {(r["row"], r["code"]): r for r in rows}
    chunk = args.max_batched_tokens
    hybrid = find[(f"shared_prompt/hybrid/chunk{chunk}", "after")]["hit_rate"]
    full = find[(f"shared_prompt/full/chunk{chunk}", "after")]["hit_rate"]
    gap = 1 - hybrid / full if full else float("nan")
    verdict = "meets" if gap <= TARGET_GAP else "MISSES"
    print(f"\nshared prompt, after: hybrid hit rate {hybrid:.4f} vs full attention {full:.4f} "
          f"({gap:+.1%} below; {verdict} the issue's <= {TARGET_GAP:.0%})")
    problems = check_runs(results)
    for p in problems:
        print(f"WARNING: {p}")
    print(f"(chunk = max_batched_tokens; medians over {args.rounds} rounds; "
          f"run took {elapsed:.0f} s)")
    return {
        "command": " ".join([Path(sys.executable).name, "-m", "bench.kvcache_hybrid",
                             *sys.argv[1:]]),
        "args": vars(args), "revisions": revs, "spec": spec,
        "rows": rows,
        "shared_prompt_gap_after": {"hybrid_hit_rate": hybrid, "full_hit_rate": full,
                                    "gap": gap, "target": TARGET_GAP,
                                    "meets_target": gap <= TARGET_GAP},
        "problems": problems,
        "runs": per_code,
        "run_seconds": elapsed,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sha, wt = before_tree(args.before, args.worktree)
    trees = {"before": wt, "after": REPO}
    spec = spec_for(args)
    print(f"before: {args.before} ({sha[:12]}) at {wt}; after: this tree ({REPO}); "
          f"{args.rounds} rounds", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    results: dict[str, list[dict]] = {code: [] for code in CODES}
    for rnd in range(args.rounds):
        for code in CODES:
            print(f"  round {rnd + 1}/{args.rounds}, {code}:", file=sys.stderr, flush=True)
            results[code].append(run_worker(trees[code], spec))
    elapsed = time.monotonic() - t0
    revs = {code: runs[0]["code"] for code, runs in results.items()}
    revs["before"]["requested"] = args.before
    payload = report(args, spec, revs, results, elapsed)
    if not args.no_write:
        write_result("kvcache_hybrid", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
