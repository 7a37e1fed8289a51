"""A model's KV pools, from its layer specs: which life cycle each pool serves, which
layers it holds, what one page of it stores.

Shared by the torch engine (which allocates the pages and computes on them) and the sim
engine (which keeps the same pools and reuse rules without storage), so a sim replica of a
checkpoint reuses exactly what a torch replica of it would.

Pools, in the order the manager gets them: full attention, one sliding-window pool per
distinct window (smallest first), recurrent. A layer with no cache (spec None) has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcache import CacheConfig, FullAttention, PageLayout, Recurrent, SlidingWindow
from replicas.models.base import (LAYER_KINDS, AttentionSpec, LayerSpec, ModelSpec,
                                  RecurrentSpec)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class PoolPlan:
    kinds: tuple[str, ...]  # per pool: "full", "sliding" or "recurrent"
    windows: tuple[int | None, ...]  # per pool: the window of a sliding pool, else None
    layers: tuple[tuple[int, ...], ...]  # per pool: the model layers it holds, bottom first
    specs: tuple[AttentionSpec | RecurrentSpec, ...]  # per pool: what a layer caches there

    @classmethod
    def of(cls, spec: ModelSpec) -> PoolPlan:
        keys = sorted({_pool_key(layer) for layer in spec.layers} - {None},
                      key=lambda key: (LAYER_KINDS.index(key[0]), key[1] or 0))
        layers = tuple(tuple(i for i, layer in enumerate(spec.layers)
                             if _pool_key(layer) == key) for key in keys)
        return cls(kinds=tuple(kind for kind, _ in keys),
                   windows=tuple(window for _, window in keys), layers=layers,
                   specs=tuple(_pool_spec(spec, pool) for pool in layers))

    @property
    def slots(self) -> dict[int, tuple[int, int]]:
        """Model layer -> (its pool, its index among the pool's layers)."""
        return {layer: (pool, slot) for pool, layers in enumerate(self.layers)
                for slot, layer in enumerate(layers)}

    def names(self) -> list[str]:
        """``full``, ``sliding(W)``, ``recurrent`` per pool, for messages and statistics."""
        return [kind if window is None else f"{kind}({window})"
                for kind, window in zip(self.kinds, self.windows)]

    def cache_config(self, num_pages: int | tuple[int, ...], tokens_per_block: int,
                     enable_partial_reuse: bool) -> CacheConfig:
        if isinstance(num_pages, (tuple, list)) and len(num_pages) != len(self.kinds):
            raise ValueError(f"{len(num_pages)} page counts for this model's {len(self.kinds)} "
                             f"pools ({', '.join(self.names())}); give one per pool")
        life = {"full": lambda w: FullAttention(), "sliding": lambda w: SlidingWindow(window=w),
                "recurrent": lambda w: Recurrent()}
        return CacheConfig(tokens_per_block=tokens_per_block, num_pages=num_pages,
                           life_cycles=tuple(life[k](w) for k, w in zip(self.kinds,
                                                                         self.windows)),
                           enable_partial_reuse=enable_partial_reuse)

    def page_layouts(self, tokens_per_block: int, dtype: str, device: str) -> list[PageLayout]:
        """One layout per pool: an attention page holds one block of its layers' K and V in
        ``dtype`` (``[layers, 2, tpb, KV, hd]``, or ``[layers, tpb, KV, hd + vd]`` where
        keys and values differ in width), a recurrent page every recurrent layer's states
        in float32."""
        layouts = []
        for spec, layers in zip(self.specs, self.layers):
            if isinstance(spec, RecurrentSpec):
                layouts.append(PageLayout((len(layers), spec.numel), "float32", device))
            elif spec.split_kv:
                shape = (len(layers), 2, tokens_per_block, spec.n_kv_heads, spec.head_dim)
                layouts.append(PageLayout(shape, dtype, device))
            else:  # keys and values of different widths (MLA's latents), side by side
                shape = (len(layers), tokens_per_block, spec.n_kv_heads,
                         spec.head_dim + spec.value_dim)
                layouts.append(PageLayout(shape, dtype, device))
        return layouts

    def page_bytes(self, tokens_per_block: int, dtype: str) -> tuple[int, ...]:
        """The bytes of one page of each pool (what ``page_layouts`` would allocate)."""
        return tuple(math.prod(layout.shape) * _DTYPE_BYTES[layout.dtype]
                     for layout in self.page_layouts(tokens_per_block, dtype, "meta"))


def _pool_key(spec: LayerSpec) -> tuple[str, int | None] | None:
    """The pool a layer's cache lives in: (kind, window), None for a layer without one."""
    return None if spec is None else (spec.kind, getattr(spec, "window", None))


def _pool_spec(spec: ModelSpec, layers: tuple[int, ...]) -> AttentionSpec | RecurrentSpec:
    """What a page of the pool of ``layers`` holds; they must agree on it (one page holds
    them all). Attention layers may differ in scale and sinks, not in their K/V shape."""
    specs = [spec.layers[i] for i in layers]
    shapes = {(s.n_kv_heads, s.head_dim, s.value_dim) if isinstance(s, AttentionSpec)
              else s.states for s in specs}
    if len(shapes) != 1:
        raise ValueError(f"layers {list(layers)} share a pool but differ in what they cache "
                         f"({sorted(map(str, shapes))}): one page holds all of them")
    return specs[0]
