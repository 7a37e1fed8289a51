"""A short walk through prefix reuse: ``python -m kvcache.demo``."""

from __future__ import annotations

import random

from . import CacheConfig, FullAttention, KVCacheManager, Recurrent, ReuseScope, SlidingWindow


def _serve(mgr: KVCacheManager, prompt: list[int], scope: ReuseScope, output: int) -> int:
    with mgr.create_kv_cache(prompt[:-1], scope=scope) as cache:
        if not cache.resize(len(prompt) + output):
            raise SystemExit("out of pages: raise --num-pages")
        # Chunked prefill, 256 tokens a step: each block-aligned chunk end keeps a
        # recurrent snapshot, so a hybrid model can reuse up to the last one.
        for start in range(cache.num_reused_tokens, len(prompt), 256):
            cache.commit(prompt[start:start + 256])
        for _ in range(output):
            cache.commit([random.randrange(32000)])
        return cache.num_reused_tokens


def main() -> None:
    rng = random.Random(0)
    system = [rng.randrange(32000) for _ in range(1000)]
    configs = {
        "full attention": (FullAttention(),),
        "full + sliding window 256": (FullAttention(), SlidingWindow(window=256)),
        "hybrid (full + recurrent)": (FullAttention(), Recurrent()),
    }
    for name, life_cycles in configs.items():
        mgr = KVCacheManager(CacheConfig(tokens_per_block=32, num_pages=512,
                                         life_cycles=life_cycles))
        print(f"\n{name}")
        for i, scope in enumerate([ReuseScope("a"), ReuseScope("a"), ReuseScope("b")]):
            prompt = system + [rng.randrange(32000) for _ in range(100)]
            probe = mgr.probe_reuse(prompt[:-1], scope=scope)
            reused = _serve(mgr, prompt, scope, output=16)
            print(f"  request {i} scope={scope.salt}: {len(prompt)} prompt tokens, probe said "
                  f"{probe.num_tokens} (attention alone {probe.num_tokens_before_hybrid_pruning}),"
                  f" reused {reused}")
        s = mgr.stats()
        if name.startswith("full + sliding"):
            print("  (window pages of blocks that left the window are freed, so a prompt that "
                  "ends where others continued cannot be reused)")
        print(f"  pages: {s.free_pages} free, {s.used_pages} used, {s.cached_pages} cached; "
              f"hit rate {s.hit_rate:.2f}")


if __name__ == "__main__":
    main()
