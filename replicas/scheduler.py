"""Continuous batching over one KVCacheManager.

Each step the scheduler
1. grows every running sequence by its next piece of work: one token to decode, or the
   next prefill chunk (chunks end on block boundaries; with recurrent layers also where
   snapshots should land, since a snapshot is kept where a commit ends on a block
   boundary: where the attention layers could have reused more than the snapshots allowed
   (a branch point), at the prompt's last block boundary (the next turn, or the same
   prompt again, resumes there at least), and every ``snapshot_interval_blocks`` blocks);
2. admits waiting sequences, first come first served, while the step's prefill token
   budget, ``max_num_seqs`` and the KV pages allow (a sequence that does not fit waits:
   backpressure, not failure);
3. runs the engine on the batch, then commits the computed tokens and hands sampled tokens
   to each sequence's event queue.

When a running sequence cannot grow, the newest running sequence is preempted: its cache
is closed (its committed blocks stay cached, so recomputing it later is mostly reuse) and
it goes back to the front of the queue. Every KVCacheManager call happens here, on the
event loop's thread; the engine only reads block tables and writes pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from kvcache import KVCacheManager

from .engines.base import Engine, StepItem
from .sequence import FinishEvent, Sequence, SeqState, TokenEvent

log = logging.getLogger("replicas.scheduler")


class QueueFull(Exception):
    """The admission queue is at ``max_waiting``."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    max_waiting: int = 512
    # with recurrent layers, a prefill chunk also ends every this many blocks (a snapshot
    # there: more reuse for forks, a page of the recurrent pool each); None: off
    snapshot_interval_blocks: int | None = None


class SchedulerObserver:
    """Hooks for metrics; the default does nothing."""

    def first_token(self, seq: Sequence, now: float) -> None: ...
    def next_token(self, seq: Sequence, now: float) -> None: ...
    def finished(self, seq: Sequence, now: float) -> None: ...


class Scheduler:
    def __init__(self, manager: KVCacheManager, engine: Engine, config: SchedulerConfig,
                 observer: SchedulerObserver | None = None) -> None:
        self.manager = manager
        self.engine = engine
        self.config = config
        self.observer = observer or SchedulerObserver()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._in_flight: set[Sequence] = set()
        self._abort_reason: dict[Sequence, str] = {}
        self._wakeup = asyncio.Event()
        self._tpb = manager.config.tokens_per_block
        self._recurrent = manager.layout.recurrent is not None
        self.steps = 0
        self.preemptions = 0

    # -- requests ----------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting")
        seq.expected_reuse = self.manager.probe_reuse(seq.prompt[:-1], scope=seq.scope).num_tokens
        self.waiting.append(seq)
        self._wakeup.set()

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Stop a sequence (client gone, stop string seen). Its pages are released now, or
        right after the engine step it is part of."""
        if seq.state is SeqState.FINISHED:
            return
        if seq in self._in_flight:
            self._abort_reason.setdefault(seq, reason)
        else:
            if seq.state is SeqState.WAITING:
                self.waiting.remove(seq)
            self._finish(seq, reason)
        self._wakeup.set()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def queued_prefill_tokens(self) -> int:
        queued = sum(max(0, s.num_tokens - max(s.expected_reuse, s.num_computed))
                     for s in self.waiting)
        return queued + sum(s.remaining_prefill for s in self.running if s.remaining_prefill > 1)

    # -- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            self._wakeup.clear()
            batch = self._schedule()
            if not batch:
                await self._wakeup.wait()
                continue
            items = [item for _, item in batch]
            self._in_flight = {seq for seq, _ in batch}
            try:
                tokens = await self.engine.step(items)
            except Exception as exc:  # the engine failed: fail this batch, keep serving
                log.exception("engine step failed")
                self._in_flight.clear()
                for seq, _ in batch:
                    # The step may have written part of its recurrent state: keep no
                    # snapshot of it when the cache closes.
                    seq.cache.invalidate_live_state()
                    self._finish(seq, "abort", error=f"engine error: {exc}")
                continue
            self._in_flight.clear()
            self._apply(batch, tokens)
            self.steps += 1
            await asyncio.sleep(0)

    def _schedule(self) -> list[tuple[Sequence, StepItem]]:
        batch: list[tuple[Sequence, StepItem]] = []
        budget = self.config.max_batched_tokens
        for seq in list(self.running):
            if seq.state is not SeqState.RUNNING:
                continue  # preempted earlier in this pass
            if seq.remaining_prefill > 1 and budget <= 0:
                continue  # prefill continues next step
            end = self._next_end(seq, budget)
            if not self._grow(seq, end):
                continue
            if end - seq.num_computed > 1:
                budget -= end - seq.num_computed
            batch.append((seq, self._item(seq, end)))
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break
            self.waiting.popleft()
            end = self._next_end(seq, budget)
            budget -= end - seq.num_computed
            batch.append((seq, self._item(seq, end)))
        return batch

    def _next_end(self, seq: Sequence, budget: int) -> int:
        """End of the next piece of work: a prefill chunk (block-aligned) or one token.

        With recurrent layers a chunk also ends where a snapshot should be kept
        (``_snapshot_stop``)."""
        start, total = seq.num_computed, seq.num_tokens
        end = min(total, start + max(1, budget))
        if self._recurrent and end - start > 1:
            stop = self._snapshot_stop(seq, start, end)
            if stop is not None:
                return stop
        if end < total and end - end % self._tpb > start:
            end -= end % self._tpb
        return end

    def _snapshot_stop(self, seq: Sequence, start: int, end: int) -> int | None:
        """The first block boundary in ``(start, end)`` where a snapshot should land:
        ``seq.snapshot_at`` (where the attention layers could have reused more than the
        snapshots allowed: the next request sharing that prefix resumes there), every
        ``snapshot_interval_blocks`` blocks, and the prompt's last block boundary before
        its last token (a later turn, or the same prompt again, probes at least that
        far). None when there is none."""
        tpb, stops = self._tpb, [seq.snapshot_at]
        interval = self.config.snapshot_interval_blocks
        if interval:
            step = interval * tpb
            stops.append((start // step + 1) * step)
        if start < len(seq.prompt):
            stops.append((len(seq.prompt) - 1) // tpb * tpb)
        inside = [stop for stop in stops if start < stop < end]
        return min(inside) if inside else None

    def _grow(self, seq: Sequence, end: int) -> bool:
        """Make room for ``end`` tokens, preempting the newest sequences if needed."""
        cache = seq.cache
        while not cache.resize(max(cache.capacity, end)):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, seq: Sequence, budget: int) -> bool:
        cache = self.manager.create_kv_cache(seq.all_tokens()[:-1], scope=seq.scope)
        seq.num_computed = cache.num_reused_tokens
        attention = cache.num_tokens_before_hybrid_pruning
        seq.snapshot_at = attention - attention % self._tpb  # 0 or <= reuse: no effect
        if not cache.resize(self._next_end(seq, budget)):
            cache.close()
            seq.num_computed = 0
            return False
        if seq.cached_tokens is None:  # first admission (not a preempted one's return)
            seq.scheduled_at = time.monotonic()
            seq.cached_tokens = cache.num_reused_tokens
            seq.cached_tokens_before_hybrid_pruning = cache.num_tokens_before_hybrid_pruning
        seq.cache = cache
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        return True

    def _item(self, seq: Sequence, end: int) -> StepItem:
        tokens = seq.all_tokens()[seq.num_computed:end]
        sample = seq.sampling if end == seq.num_tokens else None
        return StepItem(seq.id, seq.cache, tokens, seq.num_computed, sample, seq.engine_state)

    def _apply(self, batch: list[tuple[Sequence, StepItem]], tokens: list[int | None]) -> None:
        now = time.monotonic()
        for (seq, item), token in zip(batch, tokens):
            seq.cache.commit(item.tokens)
            seq.num_computed += len(item.tokens)
            reason = self._abort_reason.pop(seq, None)
            if reason is not None:
                self._finish(seq, reason)
            elif token is not None:
                self._emit(seq, token, now)

    def _emit(self, seq: Sequence, token: int, now: float) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.observer.first_token(seq, now)
        else:
            self.observer.next_token(seq, now)
        seq.last_token_at = now
        seq.output.append(token)
        seq.events.put_nowait(TokenEvent(token))
        if token in seq.stop_token_ids:
            self._finish(seq, "stop")
        elif len(seq.output) >= seq.max_tokens:
            self._finish(seq, "length")

    def _preempt(self, seq: Sequence) -> None:
        log.info("preempting %s (%d tokens) to free KV pages", seq.id, seq.num_tokens)
        self.preemptions += 1
        seq.cache.close()
        seq.cache = None
        seq.num_computed = 0
        seq.state = SeqState.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.cache is not None:
            seq.cache.close()
            seq.cache = None
        if seq in self.running:
            self.running.remove(seq)
        self._abort_reason.pop(seq, None)
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        seq.finished_at = now = time.monotonic()
        seq.events.put_nowait(FinishEvent(reason, error))
        self.observer.finished(seq, now)
