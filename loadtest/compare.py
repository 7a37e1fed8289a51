"""``python -m loadtest compare``: policies side by side on live local clusters.

For each policy a fresh cluster (``--replicas`` sim replicas and our router) is started,
the identical request sequence (same workload, same arrival times) is replayed through it,
and the cluster is stopped. An external router (``--external sglang``: the SGLang model
gateway, cache-aware; ``--external vllm-router``: vLLM's router, cache-aware; or
``--external-cmd 'NAME=COMMAND'`` with ``{port}``,
``{workers}`` (space-separated) and ``{workers_comma}`` placeholders) becomes one more
column, in front of its own fresh replicas. Per-replica prefill work is read from each
replica's ``/stats`` (prompt tokens looked up minus tokens reused), so it is measured the
same way whatever router is in front. The pooled and infinite bounds come from replaying
the same requests through one large cache (``loadtest.simulate.bound_hit_rate``).

Outputs in ``--out-dir``: ``compare.json`` (every run's full report), ``compare.md`` (one
table), and PNG plots: ``hit_rate.png``, ``ttft_cdf.png``, ``replica_load.png``.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

from .cluster import LocalCluster, start_replicas
from .driver import DriverConfig, arrival_offsets, run
from .processes import ROOT, ServerProcess, free_port
from .report import build_report
from .simulate import bound_hit_rate, to_sim_requests
from .workloads import Request


def run_policy(policy: str, requests: list[Request], config: DriverConfig, replicas: int,
               replica_args: list[str], router_args: list[str], log_dir: Path,
               routers: int = 1, restart_at: float | None = None,
               window_s: float = 5.0) -> dict:
    """A fresh cluster (``routers`` independent routers before ``replicas`` replicas)
    for ``policy``; ``restart_at`` s into the run, replica 0 is killed and started again
    on its port, empty."""
    with LocalCluster(replicas, policy, replica_args, router_args, log_dir=log_dir,
                      routers=routers) as c:
        restarted = _restart_later(c.replicas, 0, restart_at, replica_args, log_dir)
        result = run(requests, replace(config, url=c.routers[0].url,
                                       more_urls=tuple(r.url for r in c.routers[1:])))
        doc = _finish(result, c.replicas, restarted, window_s)
        doc["expectations"] = _expectations([r.url for r in c.routers])
    return doc


def _expectations(routers: list[str]) -> dict:
    """What our routers' policy expected the chosen replicas to reuse, against what they
    reused, summed over replicas and routers (router ``/stats``)."""
    out = {"expected_tokens": 0, "over_predicted_tokens": 0, "cached_tokens": 0,
           "prompt_tokens": 0}
    for url in routers:
        for rep in httpx.get(url + "/stats", timeout=10).json()["replicas"]:
            for key in out:
                out[key] += rep[key]
    return out


def _restart_later(reps: list[ServerProcess], i: int, at: float | None,
                   replica_args: list[str], log_dir: Path) -> dict:
    """From a thread: ``at`` s from now, SIGKILL ``reps[i]`` and start it again on the
    same port (an empty cache); the dict gets ``at_s`` and ``ready_s`` (from now)."""
    info: dict = {}
    if at is None:
        return info
    t0 = time.monotonic()

    def restart() -> None:
        time.sleep(at)
        old = reps[i]
        info["at_s"] = time.monotonic() - t0
        old.proc.kill()
        old.proc.wait(10)
        old.stop()
        reps[i] = ServerProcess("replicas", *replica_args, port=old.port, log_dir=log_dir)
        info["ready_s"] = time.monotonic() - t0
    info["thread"] = threading.Thread(target=restart, daemon=True)
    info["thread"].start()
    return info


def _finish(result, reps: list[ServerProcess], restarted: dict,
            window_s: float = 5.0) -> dict:
    if "thread" in restarted:
        restarted.pop("thread").join(120)
    doc = build_report(result, include_records=True)
    doc["replica_stats"] = _replica_prefill([r.url for r in reps])
    doc["replicas_alive"] = sum(r.proc.poll() is None for r in reps)
    if restarted:
        doc["restart"] = {**restarted, "replica": reps[0].url, "window_s": window_s,
                          "windows": hit_rate_windows(doc["records"], window_s)}
    return doc


def hit_rate_windows(records: list[dict], width_s: float) -> list[dict]:
    """Token hit rate of the requests sent in each ``width_s`` window of the run."""
    windows: dict[int, list[int]] = {}
    for r in records:
        if r.get("prompt_tokens"):
            w = windows.setdefault(int(r["start_s"] // width_s), [0, 0])
            w[0] += r.get("cached_tokens") or 0
            w[1] += r["prompt_tokens"]
    return [{"from_s": k * width_s, "hit_rate": c / p if p else None, "prompt_tokens": p}
            for k, (c, p) in sorted(windows.items())]


def run_external(name: str, command: str | None, requests: list[Request],
                 config: DriverConfig, replicas: int, replica_args: list[str],
                 log_dir: Path, routers: int = 1, restart_at: float | None = None,
                 window_s: float = 5.0) -> dict:
    """Our replicas behind an external router (``sglang``, ``vllm-router``, or a command
    template);
    ``routers`` gateway processes side by side, as ``run_policy``."""
    workers: list[ServerProcess] = []
    try:
        start_replicas(replicas, replica_args, log_dir, workers)
        urls = [w.url for w in workers]
        if command is None:
            from .peers import PEER_ROUTERS
            with contextlib.ExitStack() as stack:
                gws = [stack.enter_context(PEER_ROUTERS[name](urls, policy="cache_aware",
                                                              log_dir=log_dir))
                       for _ in range(routers)]
                before = _prefix_decisions(name, gws)  # the readiness pings'
                restarted = _restart_later(workers, 0, restart_at, replica_args, log_dir)
                result = run(requests, replace(config, url=gws[0].url, model=gws[0].model,
                                               more_urls=tuple(g.url for g in gws[1:]),
                                               discover_replicas=False))
                decisions = {k: d for k, n in _prefix_decisions(name, gws).items()
                             if (d := n - before.get(k, 0.0))}
        else:
            if routers != 1 or restart_at is not None:
                raise ValueError("--external-cmd runs one router, without restarts")
            restarted, decisions = {}, {}
            result = _run_command_router(command, urls, requests,
                                         replace(config, discover_replicas=False), log_dir)
        doc = _finish(result, workers, restarted, window_s)
        if decisions:
            doc["peer_prefix_decisions"] = decisions
            if decisions.get("missing_tokens"):
                print(f"warning: {name} routed {decisions['missing_tokens']:.0f} requests "
                      "without their token ids (outcome missing_tokens): by load alone, "
                      "its prefix matching skipped", file=sys.stderr)
        return doc
    finally:
        for w in workers:
            w.stop()


def _prefix_decisions(name: str, gateways) -> dict[str, float]:
    """The gateways' prefix-routing outcomes summed (empty where they count none); a
    gateway whose metrics cannot be read is left out with a note, not the run."""
    decisions: dict[str, float] = {}
    for gw in gateways:
        try:
            counted = gw.prefix_decisions()
        except (httpx.HTTPError, ValueError) as exc:
            print(f"note: {name}'s metrics at {gw.metrics_url} could not be read ({exc!r}); "
                  "its prefix-routing outcomes are not in the report", file=sys.stderr)
            continue
        for outcome, n in counted.items():
            decisions[outcome] = decisions.get(outcome, 0.0) + n
    return decisions


def _run_command_router(command: str, urls: list[str], requests, config, log_dir: Path):
    port = free_port()
    argv = shlex.split(command.format(port=port, workers=" ".join(urls),
                                      workers_comma=",".join(urls)))
    log = open(log_dir / f"external-{port}.log", "wb")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_models(url, proc)
        return run(requests, replace(config, url=url))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _wait_models(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"external router exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"external router at {url} did not answer /v1/models")


def _replica_prefill(urls: list[str]) -> dict[str, dict]:
    out = {}
    for url in urls:
        stats = httpx.get(url + "/stats", timeout=5).json()
        reuse = stats["reuse"]
        out[url] = {"query_tokens": reuse["query_tokens"], "hit_tokens": reuse["hit_tokens"],
                    "prefill_tokens": reuse["query_tokens"] - reuse["hit_tokens"],
                    "lost_to_hybrid_pruning": reuse.get("tokens_lost_to_hybrid_pruning"),
                    "pools": stats["kv_cache"]["pools"]}
    return out


def working_set_blocks(requests: list[Request], tokens_per_block: int) -> int:
    """Distinct full blocks (prefix keys) over every prompt of ``requests``: the pages a
    cache holding all of them at once would need."""
    sim = to_sim_requests(requests, [None] * len(requests), tokens_per_block)
    return len({k for r in sim for k in r.keys})


def arrival_order(requests: list[Request], config: DriverConfig) -> list[Request]:
    """The requests in the order the driver will send them (the bounds' order): by
    arrival time, a session's turns in their order."""
    offsets = (arrival_offsets(len(requests), config.rate, config.burstiness,
                               config.constant_rate, config.seed)
               if config.rate else [r.arrival_s for r in requests])
    by_id = {r.request_id: r for r in requests}
    return [by_id[s.request_id] for s in to_sim_requests(requests, offsets)]


def bounds(requests: list[Request], config: DriverConfig, replicas: int, kv_pages: int,
           tokens_per_block: int) -> dict:
    """Pooled and infinite bounds of the same requests in the same arrival order."""
    offsets = (arrival_offsets(len(requests), config.rate, config.burstiness,
                               config.constant_rate, config.seed)
               if config.rate else [r.arrival_s for r in requests])
    sim = to_sim_requests(requests, offsets)
    return {"pooled": bound_hit_rate(sim, replicas * kv_pages, tokens_per_block),
            "infinite": bound_hit_rate(sim, None, tokens_per_block)}


def summary_row(name: str, doc: dict, rr: dict | None, prefix: dict | None = None) -> dict:
    """One column of the table; ``rr`` and ``prefix``: the round-robin and prefix columns'
    documents (ratios against them), when run."""
    s = doc["summary"]
    prefill = [v["prefill_tokens"] for v in doc["replica_stats"].values()]
    mean = sum(prefill) / len(prefill) if prefill else 0
    row = {"policy": name, "hit_rate": s["token_hit_rate"], "ttft_mean_ms": s["ttft_ms"]["mean"],
           "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
           "imbalance": max(prefill) / mean if mean else None,
           "request_throughput": s["request_throughput"], "failed": s["failed"],
           "replicas_alive": doc.get("replicas_alive")}
    expectations = doc.get("expectations")
    if expectations and expectations["prompt_tokens"]:
        # over-prediction (BENCHMARKS' definition): expected minus reused, over prompt tokens
        row["over_prediction"] = ((expectations["expected_tokens"]
                                   - expectations["cached_tokens"])
                                  / expectations["prompt_tokens"]
                                  if expectations["expected_tokens"] else None)
        row["over_predicted_share"] = (expectations["over_predicted_tokens"]
                                       / expectations["prompt_tokens"])
    if prefix is not None and prefix is not doc and s["token_hit_rate"] is not None:
        ps = prefix["summary"]["token_hit_rate"]
        row["hit_rate_x_prefix"] = s["token_hit_rate"] / ps if ps else None
    if "restart" in doc:
        row.update(recovery(doc["restart"]))
    if rr is not None:
        rs = rr["summary"]
        row["hit_rate_x_rr"] = _ratio(s["token_hit_rate"], rs["token_hit_rate"])
        row["ttft_mean_x_rr"] = _ratio(s["ttft_ms"]["mean"], rs["ttft_ms"]["mean"])
    if not s["completed"]:  # a column whose every request failed: say why, go on
        row["errors"] = s["errors"]
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def recovery(restart: dict) -> dict:
    """The hit rate in the last whole window before the restart, in the window the restart
    fell in, in the first window after the replica was back, and how long after it was back
    the hit rate first reached 95% of before (the end of that window: the resolution is
    the window)."""
    at, ready, width = restart["at_s"], restart["ready_s"], restart["window_s"]
    windows = [w for w in restart["windows"] if w["hit_rate"] is not None]
    before = [w for w in windows if w["from_s"] + width <= at]
    during = [w for w in windows if w["from_s"] <= at < w["from_s"] + width]
    after = [w for w in windows if w["from_s"] >= ready]
    pre = before[-1]["hit_rate"] if before else None
    back = next((w["from_s"] + width - ready for w in after
                 if pre is not None and w["hit_rate"] >= 0.95 * pre), None)
    return {"window_s": width, "hit_rate_before_restart": pre,
            "hit_rate_restart_window": during[0]["hit_rate"] if during else None,
            "hit_rate_first_window_after": after[0]["hit_rate"] if after else None,
            "recovered_after_s": back}


def markdown(rows: list[dict], bound: dict, setup: str) -> str:
    over = any("over_prediction" in r for r in rows)
    lines = [setup, "",
             "| policy | token hit rate | / pooled bound | x round robin | TTFT mean | TTFT p50 "
             "| TTFT p99 | mean TTFT / round robin | load imbalance | req/s | failed |"
             + (" over-prediction | x prefix |" if over else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if over else "")]
    for r in rows:
        pooled = (r["hit_rate"] / bound["pooled"]
                  if bound.get("pooled") and r["hit_rate"] is not None else None)
        line = (
            f"| {r['policy']} | {_f(r['hit_rate'], '.3f')} | {_f(pooled, '.2f')} | "
            f"{_f(r.get('hit_rate_x_rr'), '.1f')} | {_f(r['ttft_mean_ms'], '.1f')} ms | "
            f"{_f(r['ttft_p50_ms'], '.1f')} ms | {_f(r['ttft_p99_ms'], '.1f')} ms | "
            f"{_f(r.get('ttft_mean_x_rr'), '.2f')} | {_f(r['imbalance'], '.2f')} | "
            f"{_f(r['request_throughput'], '.1f')} | {r['failed']} |")
        if over:
            line += (f" {_f(r.get('over_prediction'), '.3f')} | "
                     f"{_f(r.get('hit_rate_x_prefix'), '.2f')} |")
        lines.append(line)
    lines.append("")
    lines.append(f"Bounds on the same request sequence: pooled {bound['pooled']:.3f}, "
                 f"infinite {bound['infinite']:.3f}.")
    for r in rows:
        if r.get("errors"):
            shown = "; ".join(f"{n} x {e}" for e, n in sorted(r["errors"].items(),
                                                              key=lambda x: -x[1])[:3])
            lines.append(f"Column {r['policy']} failed on every request: {shown}.")
    if any("hit_rate_before_restart" in r for r in rows):
        width = next(r["window_s"] for r in rows if "window_s" in r)
        lines += ["", f"A replica restarted empty during the run ({width:g} s windows):", "",
                  "| policy | hit rate, the window before | the window of the restart | the "
                  "first window after it was back | back to 95% of before |",
                  "|---|---|---|---|---|"]
        for r in rows:
            back = r.get("recovered_after_s")
            lines.append(f"| {r['policy']} | {_f(r.get('hit_rate_before_restart'), '.3f')} "
                         f"| {_f(r.get('hit_rate_restart_window'), '.3f')} "
                         f"| {_f(r.get('hit_rate_first_window_after'), '.3f')} | "
                         f"{'not within the run' if back is None else f'within {back:.0f} s'}"
                         " |")
    return "\n".join(lines) + "\n"


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plots(docs: dict[str, dict], bound: dict, out_dir: Path) -> list[Path]:
    """hit_rate.png, ttft_cdf.png, replica_load.png."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    names = list(docs)
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, [docs[n]["summary"]["token_hit_rate"] or 0.0 for n in names],
           color="#4C72B0")  # a column that failed throughout: a bar of 0
    for label, value, style in (("pooled bound", bound["pooled"], "--"),
                                ("infinite bound", bound["infinite"], ":")):
        ax.axhline(value, color="black", linestyle=style, linewidth=1, label=label)
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("Token hit rate per policy")
    ax.legend(loc="upper right")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    paths.append(_save(fig, out_dir / "hit_rate.png"))
    fig, ax = plt.subplots(figsize=(8, 4))
    for n in names:
        ttft = sorted(r["ttft_s"] * 1e3 for r in docs[n]["records"] if r["ttft_s"] is not None)
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=n)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT distribution")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "ttft_cdf.png"))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        prefill = [v["prefill_tokens"] for v in docs[n]["replica_stats"].values()]
        ax.bar([j + i * width for j in range(len(prefill))], prefill, width, label=n)
    ax.set_xlabel("replica")
    ax.set_ylabel("prefill tokens computed")
    ax.set_title("Per-replica prefill work")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "replica_load.png"))
    restarted = {n: d["restart"] for n, d in docs.items() if "restart" in d}
    if restarted:  # the hit rate over the run, window by window, and when the restart was
        fig, ax = plt.subplots(figsize=(8, 4))
        for n, r in restarted.items():
            ws = [w for w in r["windows"] if w["hit_rate"] is not None]
            ax.plot([w["from_s"] + r["window_s"] / 2 for w in ws], [w["hit_rate"] for w in ws],
                    marker="o", label=n)
        first = next(iter(restarted.values()))
        ax.axvline(first["at_s"], color="black", linestyle="--", linewidth=1, label="killed")
        ax.axvline(first["ready_s"], color="black", linestyle=":", linewidth=1, label="back")
        ax.set_xlabel("time into the run (s)")
        ax.set_ylabel(f"token hit rate ({first['window_s']:g} s windows)")
        ax.set_ylim(0, 1)
        ax.set_title("A replica restarted empty")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "restart_hit_rate.png"))
    counted = [n for n in names if " x" in n and n.rsplit(" x", 1)[1].isdigit()]
    if counted:  # hit rate against the number of independent routers, per policy
        fig, ax = plt.subplots(figsize=(8, 4))
        by: dict[str, list[tuple[int, float]]] = {}
        for n in counted:
            base, count = n.rsplit(" x", 1)
            by.setdefault(base, []).append((int(count), docs[n]["summary"]["token_hit_rate"]))
        for base, points in by.items():
            points.sort()
            ax.plot([c for c, _ in points], [h for _, h in points], marker="o", label=base)
        ax.axhline(bound["pooled"], color="black", linestyle="--", linewidth=1,
                   label="pooled bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("independent routers")
        ax.set_ylabel("token hit rate")
        ax.set_ylim(0, 1)
        ax.set_title("Several routers in front of the same replicas")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "routers_hit_rate.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def write(out_dir: Path, docs: dict[str, dict], rows: list[dict], bound: dict,
          setup: dict, setup_text: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(json.dumps(
        {"schema": "loadtest.compare/1", "setup": setup, "bounds": bound, "rows": rows,
         "runs": docs}, indent=1) + "\n")
    (out_dir / "compare.md").write_text(markdown(rows, bound, setup_text))
    plots(docs, bound, out_dir)
