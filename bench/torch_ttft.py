"""Time to first token of the torch engine: a 2k-token prompt, 90% cached vs uncached.

TTFT here is what a replica pays once a request is scheduled: ``create_kv_cache`` on the
prompt minus its last token, ``resize``, one engine step over the uncached tokens that
samples the first token (greedy). Both cases run in the same process, interleaved, on the
same prompt: before each cached measurement the tree is cleared and a donor request
(the prompt's first 90% plus one different token) is computed and closed, so the prompt
reuses exactly that prefix (partial reuse of the last block included); before each
uncached one the tree is cleared.

    .venv/bin/python -m bench.torch_ttft            # ~30 s on 2 cores
    .venv/bin/python -m bench.torch_ttft --quick    # smoke run

Target: p50(90% cached) / p50(uncached) <= 0.25 on CPU with the default preset.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

import torch

from bench._common import percentiles_ms, print_table, write_result
from kvcache import KVCacheManager
from replicas.engines.base import SamplingParams, StepItem
from replicas.engines.torch_engine import TorchEngine

TARGET_RATIO = 0.25
GREEDY = SamplingParams(temperature=0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.torch_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default")
    p.add_argument("--device", default="cpu", help="cpu, cuda, or auto (CUDA when present)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--cached-fraction", type=float, default=0.9)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--reps", type=int, default=9, help="timed requests per case")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: the CPUs this process may use)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small, fast smoke run")
    p.add_argument("--no-write", action="store_true", help="do not write the JSON result")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/torch_ttft.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.reps = min(args.reps, 3)
    return args


async def run_request(engine: TorchEngine, mgr: KVCacheManager, prompt: list[int],
                      sample: bool = True) -> tuple[int, float]:
    """Serve ``prompt`` up to its first token; returns (reused tokens, seconds)."""
    started = time.perf_counter()
    cache = mgr.create_kv_cache(prompt[:-1])
    try:
        if not cache.resize(len(prompt) + 1):
            raise RuntimeError("resize failed: the pool is too small for the prompt")
        reused = cache.num_reused_tokens
        item = StepItem("bench", cache, prompt[reused:], reused, GREEDY if sample else None)
        await engine.step([item])
        elapsed = time.perf_counter() - started
        cache.commit(item.tokens)
    finally:
        cache.close()
    return reused, elapsed


async def measure(engine: TorchEngine, mgr: KVCacheManager, prompt: list[int],
                  n_cached: int, args: argparse.Namespace) -> dict[str, list]:
    """Interleaved rounds: uncached, then (after computing the donor) cached."""
    donor = prompt[:n_cached] + [(prompt[n_cached] + 1) % 256]
    samples: dict[str, list] = {"uncached": [], "cached": [], "reused": []}
    for rnd in range(args.warmup + args.reps):
        mgr.clear_reusable_blocks()
        _, uncached = await run_request(engine, mgr, prompt)
        mgr.clear_reusable_blocks()
        await run_request(engine, mgr, donor, sample=False)
        reused, cached = await run_request(engine, mgr, prompt)
        if rnd >= args.warmup:
            samples["uncached"].append(int(uncached * 1e9))
            samples["cached"].append(int(cached * 1e9))
            samples["reused"].append(reused)
        print(f"  round {rnd + 1}/{args.warmup + args.reps}: uncached {uncached * 1e3:.0f} ms, "
              f"cached {cached * 1e3:.0f} ms (reused {reused})", flush=True)
    return samples


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)  # one per core: more only contends on a 2-core machine
    device = None if args.device == "auto" else args.device
    engine = TorchEngine.from_preset(args.preset, device=device, seed=args.seed)
    pages = 2 * (args.prompt_tokens // args.tokens_per_block + 2)
    mgr = KVCacheManager(engine.cache_config(pages, args.tokens_per_block, True),
                         engine.page_layouts())
    engine.bind(mgr)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(256) for _ in range(args.prompt_tokens)]
    n_cached = int(args.cached_fraction * args.prompt_tokens)
    info = engine.describe()
    print(f"preset {args.preset}: {info['parameters']:,} parameters, {info['layers']}, "
          f"d_model {info['d_model']}, device {info['device']}, {threads} threads")
    samples = asyncio.run(measure(engine, mgr, prompt, n_cached, args))
    return report(args, info, threads, n_cached, samples, engine.prefill_tokens_per_s)


def report(args: argparse.Namespace, info: dict, threads: int, n_cached: int,
           samples: dict[str, list], prefill_rate: float) -> dict:
    uncached, cached = percentiles_ms(samples["uncached"]), percentiles_ms(samples["cached"])
    ratio = cached["p50_ms"] / uncached["p50_ms"]
    print()
    print_table(["case", "uncached tokens", "p50 ms", "p90 ms", "min ms"], [
        ["uncached", args.prompt_tokens, uncached["p50_ms"], uncached["p90_ms"],
         uncached["min_ms"]],
        [f"{args.cached_fraction:.0%} cached", args.prompt_tokens - min(samples["reused"]),
         cached["p50_ms"], cached["p90_ms"], cached["min_ms"]],
    ])
    verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
    print(f"\nratio p50 cached / uncached = {ratio:.3f} ({verdict} target <= {TARGET_RATIO})")
    payload = {
        "model": info, "threads": threads, "prompt_tokens": args.prompt_tokens,
        "cached_target_tokens": n_cached, "reused_tokens": sorted(set(samples["reused"])),
        "tokens_per_block": args.tokens_per_block, "quick": args.quick,
        "uncached": uncached, "cached": cached, "ratio_p50": ratio,
        "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO,
        "engine_prefill_tokens_per_s_ema": prefill_rate,
    }
    if not args.no_write:
        write_result("torch_ttft", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
