"""One request's life inside a replica, and the events it streams to its HTTP handler."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from kvcache import KVCache, ReuseScope

from .engines.base import SamplingParams


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenEvent:
    token: int


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop", "length", "abort"
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    """Prompt, generated tokens and KV state of one request.

    ``num_computed`` tokens of ``prompt + output`` have their KV in ``cache``. The scheduler
    computes up to the last token and samples the next one; the last generated token's KV is
    never needed.
    """

    id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    scope: ReuseScope
    stop_token_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    state: SeqState = SeqState.WAITING
    cache: KVCache | None = None
    num_computed: int = 0
    cached_tokens: int | None = None  # reuse at first admission: what usage reports
    cached_tokens_before_hybrid_pruning: int = 0
    expected_reuse: int = 0  # probe at arrival, for the load snapshot
    snapshot_at: int = 0  # a prefill chunk ends here (see Scheduler._next_end)
    # time.monotonic() of each stage (the replica's trace spans are made from them)
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first admitted to the running batch
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    engine_state: dict = field(default_factory=dict)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed
