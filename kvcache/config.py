"""Configuration of a KV-cache manager: life cycles, scopes and page layouts.

All of these are frozen dataclasses: they are values, hashable, and validated on
construction so that a bad configuration fails where it is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class FullAttention:
    """Layers that attend to every earlier token: one page per block, all kept."""


@dataclass(frozen=True)
class SlidingWindow:
    """Layers that attend to the last ``window`` tokens (plus ``sink_tokens`` at the start).

    Blocks that leave the window give their page back; the first
    ``ceil(sink_tokens / tokens_per_block)`` blocks never leave it.
    """

    window: int
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"SlidingWindow.window must be an int >= 1, got {self.window!r}")
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(
                f"SlidingWindow.sink_tokens must be an int >= 0, got {self.sink_tokens!r}"
            )


@dataclass(frozen=True)
class Recurrent:
    """Recurrent (state-space) layers: one live state page per sequence, plus snapshots
    kept at the end of each commit that ends on a block boundary."""


LifeCycle = Union[FullAttention, SlidingWindow, Recurrent]
_LIFE_CYCLE_TYPES = (FullAttention, SlidingWindow, Recurrent)


@dataclass(frozen=True)
class CacheConfig:
    """What a KVCacheManager manages.

    Args:
        tokens_per_block: tokens per block (and per attention page).
        num_pages: pages in each life cycle's pool: one count for every pool, or one per
            life cycle (same order), e.g. ``(4096, 512, 64)``; ``pool_pages`` gives the
            count of each.
        life_cycles: one entry per kind of layer; each gets its own pool. The order is
            the pool index used by ``KVCache.block_table`` and ``PageLayout`` lists.
        enable_partial_reuse: reuse the common prefix of a block a lookup diverges from
            or ends inside, and store the last partial block of a closed cache.
    """

    tokens_per_block: int = 32
    num_pages: int | tuple[int, ...] = 256
    life_cycles: tuple[LifeCycle, ...] = (FullAttention(),)
    enable_partial_reuse: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.tokens_per_block, int) or self.tokens_per_block < 1:
            raise ValueError(
                f"tokens_per_block must be an int >= 1, got {self.tokens_per_block!r}"
            )
        life_cycles = tuple(self.life_cycles)
        object.__setattr__(self, "life_cycles", life_cycles)
        if not life_cycles:
            raise ValueError("life_cycles must name at least one life cycle")
        counts = self.num_pages if isinstance(self.num_pages, (tuple, list)) else None
        if counts is None:
            if not _positive_int(self.num_pages):
                raise ValueError(f"num_pages must be an int >= 1 (or one per life cycle), "
                                 f"got {self.num_pages!r}")
        else:
            counts = tuple(counts)
            object.__setattr__(self, "num_pages", counts)
            if len(counts) != len(life_cycles) or not all(map(_positive_int, counts)):
                raise ValueError(f"num_pages {counts!r} must give one int >= 1 per life cycle "
                                 f"({len(life_cycles)}: {life_cycles!r})")
        for lc in life_cycles:
            if not isinstance(lc, _LIFE_CYCLE_TYPES):
                raise ValueError(
                    f"life_cycles entries must be FullAttention(), SlidingWindow(...) or "
                    f"Recurrent(), got {lc!r}"
                )
        if len(set(life_cycles)) != len(life_cycles):
            raise ValueError(f"life_cycles lists the same life cycle twice: {life_cycles!r}")
        if sum(isinstance(lc, Recurrent) for lc in life_cycles) > 1:
            raise ValueError("at most one Recurrent() life cycle is supported")

    @property
    def pool_pages(self) -> tuple[int, ...]:
        """Pages of each life cycle's pool, in ``life_cycles``' order."""
        if isinstance(self.num_pages, tuple):
            return self.num_pages
        return (self.num_pages,) * len(self.life_cycles)

    def sink_blocks(self, lc: SlidingWindow) -> int:
        """Blocks at the start that never leave ``lc``'s window."""
        return math.ceil(lc.sink_tokens / self.tokens_per_block)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ReuseScope:
    """Who may share blocks. Different scopes never share a block; ``ReuseScope()`` (no
    salt, no LoRA) is a scope of its own."""

    salt: str | None = None
    lora_id: int | str | None = None


@dataclass(frozen=True)
class PageLayout:
    """Real storage for one pool: a tensor ``[num_pages, *shape]`` of ``dtype`` on
    ``device`` (torch names, e.g. ``"float32"``, ``"cuda:0"``)."""

    shape: tuple[int, ...]
    dtype: Any = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        object.__setattr__(self, "shape", shape)
        if any(not isinstance(d, int) or d < 1 for d in shape):
            raise ValueError(f"PageLayout.shape must be positive ints, got {shape!r}")
