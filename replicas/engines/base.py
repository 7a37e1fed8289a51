"""What the scheduler asks of an engine: compute KV for some tokens, sample the next one.

The scheduler owns every KVCacheManager call (create, resize, commit, close) and runs them
on the event loop's thread; an engine only reads block tables it is handed and writes the
pages of its manager's pools. That keeps the manager single-threaded even when an engine
computes in a worker thread.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from kvcache import CacheConfig, KVCache, PageLayout


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class StepItem:
    """Compute KV for ``tokens`` at positions ``start .. start+len(tokens)-1`` of a sequence.

    ``sample`` is set when the last of these tokens is the sequence's current last token,
    so the engine returns the next token; otherwise (a prefill chunk that does not reach
    the end of the prompt) it returns None for this item.
    """

    seq_id: str
    cache: KVCache
    tokens: list[int]
    start: int
    sample: SamplingParams | None
    # Per-sequence sampling state kept by the engine between steps (e.g. a generator).
    state: dict = field(default_factory=dict)

    @property
    def is_prefill(self) -> bool:
        return len(self.tokens) > 1 or self.start == 0


class Engine(abc.ABC):
    """An inference engine over one KVCacheManager's pages."""

    name: str

    @abc.abstractmethod
    def cache_config(self, num_pages: int, tokens_per_block: int,
                     enable_partial_reuse: bool) -> CacheConfig:
        """The manager configuration this engine's model needs (its life cycles)."""

    def page_layouts(self) -> list[PageLayout] | None:
        """Real page storage per life cycle, or None for bookkeeping only."""
        return None

    def bind(self, manager) -> None:
        """Called once with the manager built from ``cache_config``/``page_layouts``."""
        self.manager = manager

    @abc.abstractmethod
    async def step(self, items: list[StepItem]) -> list[int | None]:
        """Run one batch; return the next token for each item that asked to sample."""

    @property
    @abc.abstractmethod
    def prefill_tokens_per_s(self) -> float:
        """Prefill throughput the router should assume (measured or modelled)."""

    @property
    def max_model_len(self) -> int:
        return 1 << 20

    @property
    def vocab_size(self) -> int | None:
        """Token ids the model embeds (None: any the tokenizer makes, as the sim engine)."""
        return None

    def close(self) -> None:
        """Release what the engine holds beyond its pages (threads); the service calls it
        once when it stops."""

    def describe(self) -> dict:
        return {"engine": self.name}
