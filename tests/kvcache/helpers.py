"""Small drivers shared by the kvcache tests."""

from __future__ import annotations

from collections.abc import Sequence

from kvcache import KVCacheManager, ReuseScope


def serve(mgr: KVCacheManager, tokens: Sequence[int], scope: ReuseScope | None = None,
          chunks: Sequence[int] | None = None) -> int:
    """Create a cache for ``tokens``, compute and commit the rest (in ``chunks`` sizes if
    given, else in one commit), close it; return the reused token count."""
    cache = mgr.create_kv_cache(tokens, scope=scope)
    assert cache.resize(len(tokens)), "test pool too small"
    pos = cache.num_reused_tokens
    for size in chunks or [len(tokens) - pos]:
        cache.commit(tokens[pos:pos + size])
        pos += size
    assert cache.num_committed_tokens == len(tokens)
    cache.close()
    return cache.num_reused_tokens


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))
