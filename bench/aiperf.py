"""NVIDIA AIPerf, a load generator for OpenAI-compatible endpoints
(``pip install aiperf==0.13.0``), against our
router, unchanged: does every request of every mode succeed, and do its figures agree with
our answers?

AIPerf (``aiperf==0.13.0``, installed into ``.peers/aiperf`` on first use) profiles a local
cluster: 2 sim replicas serving a tiny Llama-3-style Hugging Face tokenizer (generated, as
in the tests; ``--tokenizer DIR`` on the replicas, so they count tokens as AIPerf does) behind
our router on loopback. Four runs, chat and completions, streamed and whole: synthetic
prompts of ``--isl`` tokens, ``--osl`` output tokens, ``--requests`` each at concurrency
``--concurrency``, each run with its own random seed (fresh prompts, nothing cached from the
run before). AIPerf is given ``--use-server-token-count``: output tokens are our ``usage``
(its own count would re-tokenize the sim engine's random letters, which BPE merges).

Reported per run from AIPerf's own export (``profile_export_aiperf.json``): requests,
errors, TTFT p50/p99, inter-token latency, request latency, requests/s, output tokens/s,
and the usage it read (prompt, completion and cached tokens per request); the run fails
(exit 1) on any error or on completion tokens other than ``--osl``.

    .venv/bin/python -m bench.aiperf [--requests 30] [--concurrency 2] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtest.cluster import LocalCluster
from loadtest.peers import PEERS_DIR, ensure_peer

from ._common import print_table, write_result

AIPERF_VERSION = "0.13.0"
MODES = [("chat", False), ("chat", True), ("completions", False), ("completions", True)]


def ensure_aiperf(version: str = AIPERF_VERSION) -> Path:
    return ensure_peer("aiperf", version, "aiperf", PEERS_DIR / "aiperf")


def profile(exe: Path, url: str, model: str, tokenizer: Path, endpoint: str, streaming: bool,
            args: argparse.Namespace, seed: int, out: Path) -> dict:
    """One ``aiperf profile`` run; its summary export."""
    cmd = [str(exe), "profile", "--url", url, "--model", model, "--endpoint-type", endpoint,
           "--tokenizer", str(tokenizer), "--request-count", str(args.requests),
           "--concurrency", str(args.concurrency), "--isl", str(args.isl), "--isl-stddev", "0",
           "--osl", str(args.osl), "--random-seed", str(seed), "--use-server-token-count",
           "--ui-type", "none", "--artifact-dir", str(out), "--request-timeout-seconds", "60"]
    if streaming:
        cmd.append("--streaming")
    # AIPerf 0.13.0 sends a local tokenizer path to the Hub's snapshot_download when the
    # Hub is marked offline (HFValidationError): leave the Hub settings out of its world.
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                            timeout=args.timeout).returncode
    export = out / "profile_export_aiperf.json"
    if rc != 0 or not export.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf {endpoint} streaming={streaming} exited {rc}:\n{tail}")
    return json.loads(export.read_text())


def summary(doc: dict) -> dict:
    def stat(name: str, key: str = "avg"):
        return (doc.get(name) or {}).get(key)

    return {
        "requests": stat("request_count"),
        "errors": sum(e.get("count", 0) for e in doc.get("error_summary") or []),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "inter_token_latency_ms": stat("inter_token_latency"),
        "request_latency_p50_ms": stat("request_latency", "p50"),
        "request_throughput": stat("request_throughput"),
        "output_token_throughput": stat("output_token_throughput"),
        "usage_prompt_tokens": stat("usage_prompt_tokens"),
        "usage_completion_tokens_min": stat("usage_completion_tokens", "min"),
        "usage_completion_tokens_max": stat("usage_completion_tokens", "max"),
        "usage_cached_tokens": stat("usage_prompt_cache_read_tokens"),
        "aiperf_input_sequence_length": stat("input_sequence_length"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=30, help="requests per run (30)")
    p.add_argument("--concurrency", type=int, default=2, help="concurrent requests (2)")
    p.add_argument("--isl", type=int, default=100, help="prompt tokens (100)")
    p.add_argument("--osl", type=int, default=32, help="output tokens (32)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run (300)")
    p.add_argument("--no-write", action="store_true", help="do not write bench/results")
    p.add_argument("--out", default=None, help="results file (default bench/results/aiperf.json)")
    args = p.parse_args(argv)

    from tests.replicas import hf_checkpoints  # the tiny tokenizers the tests generate

    print(f"installing aiperf=={AIPERF_VERSION} into {PEERS_DIR / 'aiperf'} (once) ...",
          flush=True)
    exe = ensure_aiperf()
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="aiperf-") as tmp:
        tokenizer = hf_checkpoints.llama3(Path(tmp) / "tiny-llama3")
        model = "sim-tiny-llama3"
        with LocalCluster(2, replica_args=("--engine", "sim", "--tokenizer", str(tokenizer),
                                           "--log-level", "warning"),
                          router_args=("--log-level", "warning")) as cluster:
            for i, (endpoint, streaming) in enumerate(MODES):
                name = f"{endpoint} {'streamed' if streaming else 'whole'}"
                print(f"aiperf profile: {name}, {args.requests} requests ...", flush=True)
                doc = profile(exe, cluster.router.url, model, tokenizer, endpoint, streaming,
                              args, seed=7 + i, out=Path(tmp) / f"run{i}")
                runs[name] = summary(doc)

    def ms(v):
        return "-" if v is None else f"{v:.1f} ms"

    print_table(["run", "requests", "errors", "TTFT p50", "TTFT p99", "ITL", "latency p50",
                 "req/s", "output tok/s", "prompt tokens", "completion tokens", "cached"],
                [[n, f"{s['requests']:.0f}", s["errors"], ms(s["ttft_p50_ms"]),
                  ms(s["ttft_p99_ms"]), ms(s["inter_token_latency_ms"]),
                  ms(s["request_latency_p50_ms"]), f"{s['request_throughput']:.1f}",
                  f"{s['output_token_throughput']:.0f}", f"{s['usage_prompt_tokens']:.1f}",
                  f"{s['usage_completion_tokens_min']:.0f}-"
                  f"{s['usage_completion_tokens_max']:.0f}", f"{s['usage_cached_tokens']:.1f}"]
                 for n, s in runs.items()])
    bad = [n for n, s in runs.items()
           if s["errors"] or s["requests"] != args.requests
           or (s["usage_completion_tokens_min"], s["usage_completion_tokens_max"])
           != (args.osl, args.osl)]
    if not args.no_write:
        write_result("aiperf", {"args": vars(args), "aiperf": AIPERF_VERSION,
                                "model": model, "runs": runs}, out=args.out)
    if bad:
        print(f"FAILED: {', '.join(bad)} (errors, missing requests or other output lengths)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
