"""The scheduler in-process, over the sim engine at high speed-up."""

import asyncio

import pytest

from kvcache import CacheConfig, FullAttention, KVCacheManager, Recurrent, ReuseScope
from replicas.engines.base import Engine, SamplingParams
from replicas.engines.sim import SimEngine, SimTiming
from replicas.scheduler import QueueFull, Scheduler, SchedulerConfig
from replicas.sequence import FinishEvent, Sequence, TokenEvent

TPB = 4


class RecordingEngine(SimEngine):
    """Sim engine that records every batch it was given."""

    def __init__(self):
        super().__init__(SimTiming(speedup=1e6))
        self.batches = []

    async def step(self, items):
        self.batches.append([(it.seq_id, it.start, len(it.tokens), it.sample is not None)
                             for it in items])
        return await super().step(items)


def make(pages=16, **cfg):
    mgr = KVCacheManager(CacheConfig(tokens_per_block=TPB, num_pages=pages,
                                     life_cycles=(FullAttention(),)))
    engine = RecordingEngine()
    return mgr, engine, Scheduler(mgr, engine, SchedulerConfig(**cfg))


def seq(name, prompt, max_tokens=3):
    return Sequence(id=name, prompt=list(prompt), max_tokens=max_tokens,
                    sampling=SamplingParams(seed=1), scope=ReuseScope(),
                    stop_token_ids=frozenset({257}))


async def drain(s: Sequence):
    events = []
    while True:
        e = await s.events.get()
        events.append(e)
        if isinstance(e, FinishEvent):
            return events


def run_all(sched, seqs, timeout=5.0):
    async def go():
        task = asyncio.create_task(sched.run())
        for s in seqs:
            sched.submit(s)
        try:
            return await asyncio.wait_for(asyncio.gather(*(drain(s) for s in seqs)), timeout)
        finally:
            task.cancel()
    return asyncio.run(go())


def test_chunked_prefill_ends_on_block_boundaries_then_decodes():
    mgr, engine, sched = make(max_batched_tokens=6)
    a = seq("a", range(1, 15), max_tokens=2)          # 14 prompt tokens
    events = run_all(sched, [a])[0]
    assert [type(e) for e in events] == [TokenEvent, TokenEvent, FinishEvent]
    assert events[-1].reason == "length"
    # Chunks of at most 6: 0-4 and 4-8 (cut back to block boundaries), 8-14 (the rest fits,
    # and samples the first token), then one decode step for the second token.
    assert engine.batches == [[("a", 0, 4, False)], [("a", 4, 4, False)], [("a", 8, 6, True)],
                              [("a", 14, 1, True)]]
    assert mgr.stats().used_pages == 0


def test_reuse_skips_the_cached_prefix():
    mgr, engine, sched = make()
    run_all(sched, [seq("a", range(1, 11))])
    engine.batches.clear()
    b = seq("b", range(1, 11))
    run_all(sched, [b])
    assert b.cached_tokens == 9                       # all 9 probed tokens (partial reuse)
    assert engine.batches[0] == [("b", 9, 1, True)]


def test_pool_pressure_preempts_the_newest_and_everything_finishes():
    mgr, engine, sched = make(pages=6)                # 24 tokens of KV
    seqs = [seq(f"s{i}", [10 + i] * 9, max_tokens=8) for i in range(3)]  # 17 tokens each
    results = run_all(sched, seqs)
    assert [r[-1].reason for r in results] == ["length"] * 3
    assert [len(s.output) for s in seqs] == [8, 8, 8]
    assert sched.preemptions >= 1
    stats = mgr.stats()
    assert stats.used_pages == 0 and stats.open_caches == 0


def test_abort_of_a_waiting_and_a_running_sequence_frees_everything():
    mgr, engine, sched = make(max_num_seqs=1)

    async def go():
        task = asyncio.create_task(sched.run())
        a, b = seq("a", range(1, 9), max_tokens=1000), seq("b", range(1, 9))
        sched.submit(a)
        sched.submit(b)
        await a.events.get()                          # a is running
        sched.abort(b)
        sched.abort(a)
        ev_a, ev_b = await drain(a), await drain(b)
        task.cancel()
        return ev_a[-1], ev_b[-1]
    fa, fb = asyncio.run(go())
    assert (fa.reason, fb.reason) == ("abort", "abort")
    assert mgr.stats().used_pages == 0 and sched.idle


def test_queue_limit():
    mgr, engine, sched = make(max_waiting=1)
    sched.submit(seq("a", [1, 2]))
    with pytest.raises(QueueFull):
        sched.submit(seq("b", [1, 2]))


def test_stop_token_finishes_with_stop():
    class EosEngine(RecordingEngine):
        async def step(self, items):
            await super().step(items)
            return [257 if it.sample else None for it in items]
    mgr = KVCacheManager(CacheConfig(tokens_per_block=TPB, num_pages=8))
    sched = Scheduler(mgr, EosEngine(), SchedulerConfig())
    s = seq("a", [1, 2, 3], max_tokens=10)
    events = run_all(sched, [s])[0]
    assert [e.reason for e in events if isinstance(e, FinishEvent)] == ["stop"]
    assert s.output == [257]


def test_engine_failure_fails_the_batch_and_keeps_serving():
    class Flaky(RecordingEngine):
        calls = 0

        async def step(self, items):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("boom")
            return await super().step(items)
    mgr = KVCacheManager(CacheConfig(tokens_per_block=TPB, num_pages=8))
    sched = Scheduler(mgr, Flaky(), SchedulerConfig())
    first = run_all(sched, [seq("a", [1, 2, 3])])[0]
    assert first[-1].reason == "abort" and "boom" in first[-1].error
    second = run_all(sched, [seq("b", [1, 2, 3])])[0]
    assert second[-1].reason == "length"
    assert mgr.stats().used_pages == 0


def test_engine_interface_is_abstract():
    with pytest.raises(TypeError):
        Engine()


def test_a_failed_step_leaves_no_recurrent_snapshot_of_its_half_written_state():
    """A hybrid sequence whose second step fails: its cache closes inside a block, where a
    clean close would keep the live state as a snapshot; after the failure it keeps none,
    and the next identical request reuses only the snapshot taken at a clean commit."""
    class FailsSecondStep(RecordingEngine):
        async def step(self, items):
            if len(self.batches) == 1:
                self.batches.append("failed")
                raise RuntimeError("boom")
            return await super().step(items)

    mgr = KVCacheManager(CacheConfig(tokens_per_block=TPB, num_pages=16,
                                     life_cycles=(FullAttention(), Recurrent())))
    engine = FailsSecondStep()
    sched = Scheduler(mgr, engine, SchedulerConfig(max_batched_tokens=8))
    prompt = list(range(1, 11))  # 10 tokens: chunks of 8 (snapshot at 8), then 2
    events = run_all(sched, [seq("a", prompt)])[0]
    assert events[-1].reason == "abort" and "boom" in events[-1].error
    assert mgr.stats().pools[1].cached_pages == 1  # the block-end snapshot at 8 only
    assert mgr.probe_reuse(prompt[:-1]).num_tokens == 8
    mgr.check_invariants()


def test_a_hybrid_prefill_chunk_ends_where_the_attention_layers_could_reuse():
    """The second request shares 40 tokens the attention layers could reuse but no snapshot
    lies there: its prefill ends a chunk at 40, so the third request reuses 40. Every
    prefill also ends a chunk at its prompt's last block boundary before the last token
    (44 of 46 tokens), where a snapshot is kept too."""
    mgr = KVCacheManager(CacheConfig(tokens_per_block=TPB, num_pages=64,
                                     life_cycles=(FullAttention(), Recurrent())))
    engine = RecordingEngine()
    sched = Scheduler(mgr, engine, SchedulerConfig())
    system = list(range(1, 41))
    reused = []
    for i, name in enumerate("abc"):
        s = seq(name, system + [100 + i] * 6)
        run_all(sched, [s])
        reused.append((s.cached_tokens, s.cached_tokens_before_hybrid_pruning))
    assert reused == [(0, 0), (0, 40), (40, 40)]
    prefill_chunks = [[(start, n) for _, start, n, _ in batch if n > 1]
                      for batch in engine.batches]
    assert [c for c in prefill_chunks if c] == [[(0, 44)], [(44, 2)], [(0, 40)], [(40, 4)],
                                                [(44, 2)], [(40, 4)], [(44, 2)]]


def hybrid(**cfg):
    mgr = KVCacheManager(CacheConfig(tokens_per_block=TPB, num_pages=64,
                                     life_cycles=(FullAttention(), Recurrent())))
    engine = RecordingEngine()
    return mgr, engine, Scheduler(mgr, engine, SchedulerConfig(**cfg))


def test_the_same_prompt_again_resumes_at_its_last_block_boundary():
    """A 30-token prompt's prefill stops at 28 (its last block boundary before token 29), so
    a snapshot is kept there: sent again, it reuses 28 (the probe covers prompt[:-1])."""
    mgr, engine, sched = hybrid()
    runs = [seq(name, range(1, 31)) for name in "ab"]
    for s in runs:
        run_all(sched, [s])
    assert [s.cached_tokens for s in runs] == [0, 28]
    assert [b for b in engine.batches if b[0][2] > 1] == [[("a", 0, 28, False)],
                                                          [("a", 28, 2, True)],
                                                          [("b", 28, 2, True)]]


def test_a_snapshot_every_n_blocks_lets_forks_resume_inside_a_long_prompt():
    """With snapshot_interval_blocks=2 (8 tokens) a 30-token prompt's prefill ends chunks at
    8, 16, 24 and 28; a fork at 21 resumes from the snapshot at 16, one at 27 from 24.
    Without it the first fork finds none (and leaves one at its branch point, 20, which the
    second then resumes from)."""
    def forks(**cfg):
        _, _, sched = hybrid(**cfg)
        run_all(sched, [seq("h", range(1, 31))])
        out = []
        for cut in (21, 27):
            s = seq(f"f{cut}", list(range(1, cut + 1)) + [200, 201, 202])
            run_all(sched, [s])
            out.append((s.cached_tokens, s.cached_tokens_before_hybrid_pruning))
        return out

    assert forks(snapshot_interval_blocks=2) == [(16, 21), (24, 27)]
    assert forks() == [(0, 21), (20, 27)]


def test_attention_only_models_split_no_chunk_for_snapshots():
    mgr, engine, sched = make()
    run_all(sched, [seq("a", range(1, 31))])
    assert engine.batches[0] == [("a", 0, 30, True)]
