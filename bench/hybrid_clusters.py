"""Routing on clusters of hybrid and interleaved-window models (BENCHMARKS.md, "Hybrid-model
clusters").

For each model shape (``bench/shapes``: Qwen3-Next, 3 recurrent : 1 attention; Gemma 3,
5 window-1024 : 1 full; GPT-OSS, window 128 and full alternating), each workload where the
reuse rules matter (``loadtest/workloads.py``: a shared system prompt longer than the
windows, long multi-turn chats, forks), with and without cache pressure (every pool sized
so that the workload's working set in it is 3x the cluster's pages), one ``loadtest
compare --model`` run: 8 sim replicas of the shape, the columns ``prefix``,
``approx_prefix``, ``round_robin`` and the peers (``--peers``: the SGLang gateway and vLLM's
router). Then, on the forks workload of the Qwen3-Next shape, ``prefix`` with a snapshot
every N blocks of a prefill (``--snapshot-interval-blocks``) against hit rate and the
snapshot memory it keeps.

    .venv/bin/python -m bench.hybrid_clusters               # the whole matrix (~1 hour)
    .venv/bin/python -m bench.hybrid_clusters --models qwen3-next --workloads forks --quick

Writes ``bench/results/hybrid_clusters.json`` and ``.md`` (each run's compare.json stays in
``artifacts/hybrid/NAME``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "bench" / "shapes"
RESULTS = ROOT / "bench" / "results"

# workload -> loadtest flags (text of n characters: n byte-level tokens)
WORKLOADS = {
    "long-system": ["--workload", "shared-prefix", "--groups", "16", "--prompts-per-group",
                    "8", "--system-len", "3000", "--question-len", "128", "--output-len", "16"],
    "multi-turn": ["--workload", "multi-turn", "--sessions", "12", "--turns", "6",
                   "--system-len", "1024", "--user-len", "200", "--output-len", "32"],
    "forks": ["--workload", "forks", "--trees", "8", "--branches", "8", "--history-len",
              "2000", "--branch-len", "64", "--output-len", "16"],
}
QUICK = {"long-system": ["--groups", "4", "--prompts-per-group", "4"],
         "multi-turn": ["--sessions", "4", "--turns", "3"],
         "forks": ["--trees", "3", "--branches", "4"]}
POLICIES = "prefix,approx_prefix,round_robin"
INTERVALS = [None, 16, 8, 4]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hybrid_clusters", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-next,gemma3,gpt-oss")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--pressure", default="none,3", help="none and/or a factor (none,3)")
    p.add_argument("--peers", default="sglang,vllm-router",
                   help="external routers as columns ('' for none)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--kv-pages", type=int, default=1024,
                   help="per pool and replica without pressure (1024)")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--no-intervals", action="store_true")
    p.add_argument("--quick", action="store_true", help="small workloads, 2 replicas")
    p.add_argument("--out", default=str(RESULTS / "hybrid_clusters.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.replicas = 2
    return args


def compare(name: str, model: str, workload: str, pressure: str, args,
            policies: str = POLICIES, peers: str | None = None,
            replica_args: str = "") -> dict:
    out = ROOT / "artifacts" / "hybrid" / name
    cmd = [sys.executable, "-m", "loadtest", "compare", "--model", str(SHAPES / model),
           *WORKLOADS[workload], *(QUICK[workload] if args.quick else []),
           "--replicas", str(args.replicas), "--policies", policies, "--rate", str(args.rate),
           "--out-dir", str(out)]
    if pressure != "none":
        cmd += ["--cache-pressure", pressure]
    else:
        cmd += ["--kv-pages", str(args.kv_pages)]
    for peer in (args.peers if peers is None else peers).split(","):
        if peer:
            cmd += ["--external", peer]
    if replica_args:
        cmd += ["--replica-args", replica_args]
    started = time.perf_counter()
    print(f"== {name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1) or not (out / "compare.json").is_file():
        # 1 with a table: some request failed (the table says which)
        raise SystemExit(f"{name}: loadtest compare failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    doc = json.loads((out / "compare.json").read_text())
    print(f"   {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return doc


def _row(run: dict, bound: dict) -> dict:
    pooled = bound.get("pooled")
    keep = ("policy", "hit_rate", "ttft_mean_ms", "ttft_p99_ms", "imbalance", "failed",
            "over_prediction", "over_predicted_share", "hit_rate_x_prefix")
    row = {k: run.get(k) for k in keep}
    row["x_pooled"] = run["hit_rate"] / pooled if pooled and run["hit_rate"] is not None else None
    return row


def snapshot_memory(doc: dict, policy: str) -> dict:
    """Snapshots kept at the end of the run, over the replicas, and their bytes."""
    kept = bytes_ = 0
    for rep in doc["runs"][policy]["replica_stats"].values():
        for pool in rep["pools"]:
            if pool["life_cycle"] == "recurrent":
                kept += pool["block_pages"]
                bytes_ += pool["block_pages"] * (pool["page_bytes"] or 0)
    return {"snapshots": kept, "snapshot_bytes": bytes_}


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    tables = []
    for model in args.models.split(","):
        for workload in args.workloads.split(","):
            for pressure in args.pressure.split(","):
                name = f"{model}-{workload}" + ("" if pressure == "none" else f"-p{pressure}")
                doc = compare(name, model, workload, pressure, args)
                tables.append({"model": model, "workload": workload, "pressure": pressure,
                               "bounds": doc["bounds"], "kv_pages": doc["setup"]["kv_pages"],
                               "rows": [_row(r, doc["bounds"]) for r in doc["rows"]]})
                _write(args, tables, [], started)  # what is done so far survives a stop
    intervals = []
    if not args.no_intervals and "qwen3-next" in args.models.split(","):
        for n in INTERVALS:
            flag = f"--snapshot-interval-blocks {n}" if n else ""
            doc = compare(f"qwen3-next-forks-interval-{n or 'off'}", "qwen3-next", "forks",
                          "none", args, policies="prefix", peers="", replica_args=flag)
            intervals.append({"interval_blocks": n, **_row(doc["rows"][0], doc["bounds"]),
                              **snapshot_memory(doc, "prefix")})
    result = _write(args, tables, intervals, started, complete=True)
    print(markdown(result))
    print(f"wrote {args.out} and its .md", file=sys.stderr)
    return 0


def _write(args, tables, intervals, started, complete: bool = False) -> dict:
    result = {"benchmark": "hybrid_clusters", "args": vars(args), "tables": tables,
              "snapshot_interval": intervals, "complete": complete,
              "seconds": time.perf_counter() - started}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    return result


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    lines = []
    for t in result["tables"]:
        pressure = "no eviction" if t["pressure"] == "none" else \
            f"cache pressure {t['pressure']}x (pages per pool {t['kv_pages']})"
        lines += [f"### {t['model']}, {t['workload']}, {pressure}", "",
                  f"Bounds: pooled {t['bounds']['pooled']:.3f}, infinite "
                  f"{t['bounds']['infinite']:.3f}.", "",
                  "| column | hit rate | / pooled | TTFT mean | TTFT p99 | imbalance | "
                  "over-prediction | x prefix | failed |", "|---|---|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            lines.append(f"| {r['policy']} | {_f(r['hit_rate'], '.3f')} | "
                         f"{_f(r['x_pooled'], '.2f')} | {_f(r['ttft_mean_ms'], '.1f')} ms | "
                         f"{_f(r['ttft_p99_ms'], '.1f')} ms | {_f(r['imbalance'], '.2f')} | "
                         f"{_f(r['over_prediction'], '.3f')} | "
                         f"{_f(r['hit_rate_x_prefix'], '.2f')} | {r['failed']} |")
        lines.append("")
    if result["snapshot_interval"]:
        lines += ["### Snapshot interval (qwen3-next, forks, prefix)", "",
                  "| snapshot every | hit rate | / pooled | snapshots kept | snapshot memory |",
                  "|---|---|---|---|---|"]
        for r in result["snapshot_interval"]:
            every = f"{r['interval_blocks']} blocks" if r["interval_blocks"] else "off"
            lines.append(f"| {every} | {_f(r['hit_rate'], '.3f')} | {_f(r['x_pooled'], '.2f')}"
                         f" | {r['snapshots']} | {r['snapshot_bytes'] / 2**30:.1f} GiB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
