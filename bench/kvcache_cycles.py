"""Request cycles per second: create_kv_cache + resize + commit + close.

Requests are ``--request-tokens`` (2048) tokens: one of ``--prefixes`` shared prefixes of
``--prefix-tokens`` (1843, so 90% reuse) followed by fresh random tokens. A cycle is what a
replica does for one request:

    cache = mgr.create_kv_cache(prompt)          # holds the reused prefix
    cache.resize(len(prompt)); cache.commit(prompt[cache.num_reused_tokens:])
    [decode: 32 x (cache.resize(n + 1); cache.commit([token]))]   # variant
    cache.close()

Variants: prefill only / prefill + 32 output tokens committed one at a time, each with a
roomy pool (nothing is evicted) and a tight one (``--tight-extra-pages`` pages beyond the
prefixes' blocks, so closed requests' tails, and some cold prefixes, are evicted all along);
plus the roomy prefill run again with prefixes rounded up to whole blocks (1856 tokens).
A 1843-token prefix ends 19 tokens into block 57, so every earlier request on that prefix
left a block-57 child starting with the same 19 tokens, and partial matching of the next
request compares against all of them: "drift" (p50 of the last quarter of cycles over the
first quarter) shows that cost growing as requests accumulate.
Token generation happens outside the timed section. The cyclic GC stays on (the cycles
allocate long-lived tree nodes, and collecting them is part of the cost) unless --pause-gc.

    python -m bench.kvcache_cycles            # ~1 minute
    python -m bench.kvcache_cycles --quick
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from bench._common import (VOCAB, add_common_args, cache_sequence, percentiles_ms,
                           print_table, random_tokens, write_result)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kvcache_cycles", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--request-tokens", type=int, default=2048)
    p.add_argument("--prefix-tokens", type=int, default=1843)
    p.add_argument("--prefixes", type=int, default=64, help="distinct shared prefixes")
    p.add_argument("--output-tokens", type=int, default=32,
                   help="tokens committed one at a time in the decode variants")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--cycles", type=int, default=20_000, help="timed cycles per variant")
    p.add_argument("--warmup", type=int, default=1000, help="untimed cycles per variant")
    p.add_argument("--max-seconds", type=float, default=15.0,
                   help="stop a variant's timed loop after this long")
    p.add_argument("--tight-extra-pages", type=int, default=1024,
                   help="tight pool: pages beyond those the prefixes need")
    add_common_args(p, gc_paused_by_default=False)
    args = p.parse_args(argv)
    if args.quick:
        args.cycles = min(args.cycles, 500)
        args.warmup = min(args.warmup, 100)
        args.max_seconds = min(args.max_seconds, 3.0)
    if not 0 < args.prefix_tokens < args.request_tokens:
        p.error("need 0 < --prefix-tokens < --request-tokens")
    return args


def run_variant(args, name: str, num_pages: int, decode: bool, seed: int,
                prefix_tokens: int) -> dict:
    from kvcache import CacheConfig, FullAttention, KVCacheManager

    tpb = args.tokens_per_block
    mgr = KVCacheManager(CacheConfig(tokens_per_block=tpb, num_pages=num_pages,
                                     life_cycles=(FullAttention(),),
                                     enable_partial_reuse=True))
    rng = np.random.default_rng(seed)
    prefixes = [random_tokens(rng, prefix_tokens) for _ in range(args.prefixes)]
    for pre in prefixes:                       # every prefix cached once before warm-up
        cache_sequence(mgr, pre)
    n_fresh = args.request_tokens - prefix_tokens
    n_out = args.output_tokens if decode else 0
    total = args.warmup + args.cycles
    samples: list[int] = []
    reused = prompt_tokens = failed = 0
    evicted0 = None
    clock = time.perf_counter_ns
    deadline = None
    chunk = 256
    gc.collect()
    was_enabled = gc.isenabled()
    if not args.keep_gc:
        gc.disable()
    try:
        i = 0
        while i < total:
            which = rng.integers(0, args.prefixes, size=chunk)
            fresh = rng.integers(0, VOCAB, size=(chunk, n_fresh + n_out), dtype=np.int64)
            for k in range(chunk):
                if i == args.warmup:           # start of the timed part
                    evicted0 = getattr(mgr.stats(), "evicted_blocks", None)
                    deadline = clock() + int(args.max_seconds * 1e9)
                extra = fresh[k].tolist()
                prompt = prefixes[which[k]] + extra[:n_fresh]
                out = extra[n_fresh:]
                n = len(prompt)
                t0 = clock()
                cache = mgr.create_kv_cache(prompt)
                r = cache.num_reused_tokens
                ok = cache.resize(n)
                if ok:
                    cache.commit(prompt[r:])
                    for j, tok in enumerate(out):
                        if not cache.resize(n + j + 1):
                            ok = False
                            break
                        cache.commit([tok])
                cache.close()
                t1 = clock()
                if i >= args.warmup:
                    samples.append(t1 - t0)
                    reused += r
                    prompt_tokens += n
                    failed += not ok
                i += 1
                if i >= total or (deadline is not None and t1 > deadline):
                    total = i
                    break
    finally:
        if was_enabled:
            gc.enable()
    st = mgr.stats()
    evicted = getattr(st, "evicted_blocks", None)
    res = percentiles_ms(samples)
    q = max(1, len(samples) // 4)
    res.update(
        variant=name, num_pages=num_pages, decode_tokens=n_out, prefix_tokens=prefix_tokens,
        cycles=len(samples),
        cycles_per_s=len(samples) / (sum(samples) / 1e9),
        token_reuse=reused / prompt_tokens if prompt_tokens else float("nan"),
        failed_resizes=failed,
        evicted_blocks=(evicted - evicted0) if evicted is not None and evicted0 is not None
        else None,
        drift_p50_last_over_first_quarter=float(np.median(samples[-q:]) / np.median(samples[:q])),
        stats_at_end={k: getattr(st, k) for k in
                      ("num_pages", "free_pages", "used_pages", "cached_pages")},
    )
    return res


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tpb = args.tokens_per_block
    req_blocks = -(-(args.request_tokens + args.output_tokens) // tpb)
    prefix_blocks = args.prefixes * (-(-args.prefix_tokens // tpb))
    roomy = prefix_blocks + (args.warmup + args.cycles + 8) * req_blocks + 1024
    tight = prefix_blocks + args.tight_extra_pages
    print(f"requests: {args.request_tokens} tokens = one of {args.prefixes} prefixes of "
          f"{args.prefix_tokens} tokens + {args.request_tokens - args.prefix_tokens} fresh; "
          f"tokens_per_block {tpb}; pages roomy {roomy:,}, tight {tight:,}; "
          f"GC {'on' if args.keep_gc else 'paused'}", flush=True)
    pre = args.prefix_tokens
    aligned = -(-pre // tpb) * tpb
    variants = [
        ("prefill, roomy", roomy, False, pre),
        (f"prefill + {args.output_tokens} decode, roomy", roomy, True, pre),
        ("prefill, tight (evicting)", tight, False, pre),
        (f"prefill + {args.output_tokens} decode, tight (evicting)", tight, True, pre),
    ]
    if aligned != pre and aligned < args.request_tokens:
        # Same workload with block-aligned prefixes: the new requests' first own block then
        # starts with fresh tokens instead of the prefix's last pre % tpb tokens, so partial
        # matching no longer compares against every earlier request on that prefix.
        variants.append((f"prefill, roomy, aligned {aligned}-token prefixes", roomy, False,
                         aligned))
    results = []
    for k, (name, pages, decode, prefix_tokens) in enumerate(variants):
        print(f"  running: {name}", flush=True)
        results.append(run_variant(args, name, pages, decode, args.seed + k, prefix_tokens))
    rows = [[r["variant"], r["cycles"], r["cycles_per_s"], r["p50_ms"], r["p99_ms"],
             f"{r['token_reuse']:.1%}",
             "-" if r["evicted_blocks"] is None else r["evicted_blocks"],
             r["failed_resizes"], r["drift_p50_last_over_first_quarter"]] for r in results]
    print()
    print_table(["variant", "cycles", "cycles/s", "p50 ms", "p99 ms", "reuse", "evicted",
                 "failed", "drift"], rows)
    print("\ncycles/s = timed cycles / their summed time; drift = p50 of the last quarter "
          "of cycles / p50 of the first quarter")
    payload = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "no_write")},
               "results": results}
    if not args.no_write:
        write_result("kvcache_cycles", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
