"""Paged KV-cache manager: page pools, a block radix tree, reuse matching and eviction.

See docs/kvcache.md for the exact semantics.
"""

from .cache import KVCache
from .config import (
    CacheConfig,
    FullAttention,
    LifeCycle,
    PageLayout,
    Recurrent,
    ReuseScope,
    SlidingWindow,
)
from .manager import KVCacheManager, ManagerStats, PoolStats
from .match import ReuseProbe

__all__ = [
    "CacheConfig",
    "FullAttention",
    "KVCache",
    "KVCacheManager",
    "LifeCycle",
    "ManagerStats",
    "PageLayout",
    "PoolStats",
    "Recurrent",
    "ReuseProbe",
    "ReuseScope",
    "SlidingWindow",
]
