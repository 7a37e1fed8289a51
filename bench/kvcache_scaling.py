"""probe_reuse latency against prompt length and against tree size.

Part 1, prompt length: a tree of ``--length-tree-blocks`` cached blocks holds a 128k-token
prompt; ``probe_reuse`` is timed on its first 1k, 4k, ... 128k tokens (all cached), and on
prompts of the same lengths whose first half only is cached.

Part 2, tree size: one manager is grown from 1k to 1M cached blocks (distinct random
sequences of ``--seq-blocks`` blocks from a 32k vocabulary; a fraction ``--shared-frac`` of
them start with one of two shared "system prompts", of 512 and 500 tokens); at each size
the same prompts are probed:

- ``32k all cached`` / ``32k tokens[:-1]`` / ``4k all cached``: walks along one cached path.
- ``32k 50% cached``: the walk stops halfway, then partial matching looks at that node's
  children.
- ``32k nothing cached``: partial matching looks at the root's children, which grow with
  the tree (every filler sequence is a child of the root).
- ``sys 512 + fresh`` / ``sys 500 + fresh``: the node where a shared system prompt ends
  has a child per filler sequence that shares it. With the block-aligned 512-token prompt
  those children start with random tokens; with the 500-token one they all start with the
  prompt's last 20 tokens (as real conversations after a shared system prompt and chat
  template do), so partial matching has to tell them apart.

The headline is p50(largest tree) / p50(smallest tree) for the same prompt; target <= 1.5.

    python -m bench.kvcache_scaling           # fills to 1M blocks: a few minutes
    python -m bench.kvcache_scaling --quick   # stops at 100k blocks
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._common import (VOCAB, Filler, add_common_args, cache_sequence, print_table,
                           random_tokens, time_calls, write_result)

TARGET_RATIO = 1.5
HEADLINE_CASE = "32k all cached"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kvcache_scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,16384,32768,65536,131072",
                   help="prompt lengths for part 1 (comma-separated tokens)")
    p.add_argument("--length-tree-blocks", type=int, default=100_000,
                   help="cached blocks in the tree for part 1 (default 100k)")
    p.add_argument("--tree-sizes", default="1000,10000,100000,1000000",
                   help="cached blocks at which part 2 measures (comma-separated)")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--seq-blocks", type=int, default=64, help="blocks per filler sequence")
    p.add_argument("--shared-frac", type=float, default=0.25,
                   help="share of filler sequences that start with a shared system prompt")
    p.add_argument("--reps", type=int, default=1000, help="timed calls per case")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--max-seconds", type=float, default=2.0,
                   help="stop a case's timed loop after this long (keeps >= 20 samples)")
    p.add_argument("--skip-lengths", action="store_true", help="run part 2 only")
    p.add_argument("--skip-sizes", action="store_true", help="run part 1 only")
    add_common_args(p)
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.tree_sizes = sorted(int(x) for x in args.tree_sizes.split(","))
    if args.quick:
        args.tree_sizes = [s for s in args.tree_sizes if s <= 100_000] or [1000, 10_000]
        args.length_tree_blocks = min(args.length_tree_blocks, 10_000)
        args.reps = min(args.reps, 200)
        args.warmup = min(args.warmup, 10)
        args.max_seconds = min(args.max_seconds, 0.5)
    return args


def new_manager(tpb: int, num_pages: int):
    from kvcache import CacheConfig, FullAttention, KVCacheManager
    return KVCacheManager(CacheConfig(tokens_per_block=tpb, num_pages=num_pages,
                                      life_cycles=(FullAttention(),),
                                      enable_partial_reuse=True))


def measure(mgr, toks: list[int], args) -> dict:
    got = mgr.probe_reuse(toks)
    r = time_calls(lambda: mgr.probe_reuse(toks), args.reps, args.warmup,
                   keep_gc=args.keep_gc, max_seconds=args.max_seconds)
    r.update(tokens=len(toks), num_tokens=got.num_tokens,
             tokens_per_s_at_p50=len(toks) / (r["p50_ms"] / 1e3))
    return r


# --------------------------------------------------------------------------- part 1

def length_scan(args, rng: np.random.Generator) -> dict:
    tpb = args.tokens_per_block
    longest = max(args.lengths)
    big = random_tokens(rng, longest)
    fresh = random_tokens(rng, longest)
    num_pages = args.length_tree_blocks + 2 * longest // tpb + 4 * args.seq_blocks + 1024
    mgr = new_manager(tpb, num_pages)
    print(f"part 1: tree of {args.length_tree_blocks:,} blocks holding a {longest:,}-token "
          f"prompt", flush=True)
    cache_sequence(mgr, big)
    fill = Filler(mgr, tpb, args.seq_blocks, seed=args.seed + 11).fill_to(
        args.length_tree_blocks, " (part 1)")
    print(f"  filled in {fill['fill_seconds']:.1f}s ({fill['blocks_per_s']:,.0f} blocks/s)",
          flush=True)
    rows, results = [], []
    for n in args.lengths:
        for label, toks, expect in (("all cached", big[:n], n),
                                    ("50% cached", big[:n // 2] + fresh[:n - n // 2], n // 2)):
            r = measure(mgr, toks, args)
            r.update(case=label, expected_num_tokens=expect,
                     us_per_block_at_p50=r["p50_ms"] * 1e3 / (n / tpb))
            results.append(r)
            flag = "" if r["num_tokens"] == expect else f" !! expected {expect}"
            rows.append([n, label, f"{r['num_tokens']}{flag}", r["p50_ms"], r["p99_ms"],
                         r["us_per_block_at_p50"], r["tokens_per_s_at_p50"]])
    print()
    print_table(["tokens", "case", "num_tokens", "p50 ms", "p99 ms", "us/block", "tokens/s"],
                rows)
    st = mgr.stats()
    return {"tree_blocks": st.cached_pages, "num_pages": num_pages, "fill": fill,
            "results": results}


# --------------------------------------------------------------------------- part 2

def size_scan(args, rng: np.random.Generator) -> dict:
    tpb = args.tokens_per_block
    p32 = random_tokens(rng, 32_768)
    sys512 = random_tokens(rng, 512)
    sys500 = random_tokens(rng, 500)
    cases = {
        "32k all cached": (p32, 32_768),
        "32k tokens[:-1]": (p32[:-1], 32_767),
        "4k all cached": (p32[:4096], 4096),
        "32k 50% cached": (p32[:16_384] + random_tokens(rng, 16_384), 16_384),
        # Token id VOCAB never occurs in the tree: a sure miss.
        "32k nothing cached": ([VOCAB] + random_tokens(rng, 32_767), 0),
        "sys 512 + fresh": (sys512 + random_tokens(rng, 4096 - 512), 512),
        "sys 500 + fresh": (sys500 + random_tokens(rng, 4096 - 500), 500),
    }
    largest = max(args.tree_sizes)
    num_pages = largest + 4 * 1024 + 8 * args.seq_blocks + 4096
    mgr = new_manager(tpb, num_pages)
    print(f"\npart 2: one tree grown to {largest:,} blocks (num_pages {num_pages:,}); "
          f"{args.shared_frac:.0%} of filler sequences start with a shared 512- or 500-token "
          f"system prompt",
          flush=True)
    cache_sequence(mgr, p32)
    cache_sequence(mgr, sys512)
    cache_sequence(mgr, sys500)
    filler = Filler(mgr, tpb, args.seq_blocks, seed=args.seed + 22,
                    shared_prefixes=[sys512, sys500], shared_frac=args.shared_frac)
    points = []
    for size in args.tree_sizes:
        fill = filler.fill_to(size, f" (part 2, -> {size:,})")
        st = mgr.stats()
        print(f"  tree at {st.cached_pages:,} blocks (filled in {filler.seconds:.1f}s total); "
              f"measuring", flush=True)
        point = {"target_blocks": size, "cached_blocks": st.cached_pages,
                 "fill_sequences_total": filler.sequences, "fill": fill, "cases": {}}
        for name, (toks, expect) in cases.items():
            r = measure(mgr, toks, args)
            r["expected_num_tokens"] = expect
            point["cases"][name] = r
        points.append(point)

    sizes = [p["cached_blocks"] for p in points]
    headers = ["case"] + [f"p50 ms @{s:,}" for s in sizes] + ["p99 @largest", "ratio"]
    rows, ratios = [], {}
    for name, (_, expect) in cases.items():
        p50s = [p["cases"][name]["p50_ms"] for p in points]
        ratios[name] = p50s[-1] / p50s[0]
        got = points[-1]["cases"][name]["num_tokens"]
        label = name if got == expect else f"{name} (!! num_tokens {got}, expected {expect})"
        rows.append([label, *p50s, points[-1]["cases"][name]["p99_ms"], ratios[name]])
    print()
    print_table(headers, rows)
    return {"num_pages": num_pages, "points": points,
            "ratio_p50_largest_over_smallest": ratios,
            "smallest_blocks": sizes[0], "largest_blocks": sizes[-1]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    payload: dict = {"config": {k: v for k, v in vars(args).items()
                                if k not in ("out", "no_write")}}
    if not args.skip_lengths:
        payload["length_scan"] = length_scan(args, rng)
    if not args.skip_sizes:
        scan = size_scan(args, rng)
        payload["size_scan"] = scan
        ratio = scan["ratio_p50_largest_over_smallest"][HEADLINE_CASE]
        ok = ratio <= TARGET_RATIO
        payload["target"] = {"case": HEADLINE_CASE, "ratio_max": TARGET_RATIO,
                             "ratio": ratio, "pass": ok,
                             "from_blocks": scan["smallest_blocks"],
                             "to_blocks": scan["largest_blocks"]}
        print(f"\ntarget: p50({scan['largest_blocks']:,} blocks) / "
              f"p50({scan['smallest_blocks']:,} blocks) <= {TARGET_RATIO} for "
              f"'{HEADLINE_CASE}': {ratio:.2f} -> {'PASS' if ok else 'FAIL'}")
    payload["seconds"] = time.perf_counter() - t0
    print(f"total {payload['seconds']:.0f}s")
    if not args.no_write:
        write_result("kvcache_scaling", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
