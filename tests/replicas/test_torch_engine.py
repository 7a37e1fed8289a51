"""TorchEngine on real pages: reuse is exact, windows are honoured, sampling is seeded.

Each test drives the engine as a scheduler would: ``create_kv_cache(prompt[:-1])``,
``resize``, compute ``prompt[reused:]`` (in chunks, committing after each), then decode
one token a step, committing it. Reused runs are compared with the same prompt computed
from scratch in a fresh manager, and with the model's dense reference forward.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
from dataclasses import dataclass

import pytest
import torch

from kvcache import FullAttention, KVCacheManager, Recurrent, SlidingWindow
from replicas.engines.base import SamplingParams, StepItem
from replicas.engines.torch_engine import TorchEngine, sample_token
from replicas.model import reference_logits

TPB = 8
# bench/gpu_check.sh runs these on CUDA.
DEVICE = os.environ.get("REPLICAS_TEST_DEVICE", "cpu")
GREEDY = SamplingParams(temperature=0.0)
ATOL = 1e-4


def make(preset: str, pages: int = 64, **overrides) -> tuple[TorchEngine, KVCacheManager]:
    engine = TorchEngine.from_preset(preset, seed=3, device=DEVICE, **overrides)
    mgr = KVCacheManager(engine.cache_config(pages, TPB, True), engine.page_layouts())
    engine.bind(mgr)
    return engine, mgr


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(260) for _ in range(n)]


@dataclass
class Run:
    reused: int
    logits: torch.Tensor  # last prompt position
    generated: list[int]


async def _serve(engine, mgr, prompt, n_new, chunks, params, after_commit):
    cache = mgr.create_kv_cache(prompt[:-1])
    assert cache.resize(len(prompt) + n_new)
    pos, state = cache.num_reused_tokens, {}
    for size in chunks:  # prefill chunks that do not reach the end: no sampling
        item = StepItem("s", cache, prompt[pos:pos + size], pos, None, state)
        assert await engine.step([item]) == [None]
        cache.commit(item.tokens)
        pos += size
        after_commit(cache)
    logits = engine.forward_logits([StepItem("s", cache, prompt[pos:], pos, params, state)])[0]
    cache.commit(prompt[pos:])
    after_commit(cache)
    generated = [sample_token(logits, params, state)]
    while len(generated) < n_new:
        item = StepItem("s", cache, generated[-1:], cache.num_committed_tokens, params, state)
        generated += await engine.step([item])
        cache.commit(item.tokens)
        after_commit(cache)
    cache.close()
    return Run(cache.num_reused_tokens, logits, generated)


def serve(engine, mgr, prompt, n_new=8, chunks=(), params=GREEDY, after_commit=lambda c: None):
    """Serve one request; ``chunks``: sizes of the prefill chunks before the last one."""
    return asyncio.run(_serve(engine, mgr, prompt, n_new, chunks, params, after_commit))


# -- configuration ---------------------------------------------------------------------

@pytest.mark.parametrize("preset, life_cycles, shapes", [
    ("tiny", (FullAttention(),), [(2, 2, TPB, 2, 16)]),
    ("tiny-hybrid", (FullAttention(), SlidingWindow(window=24), Recurrent()),
     [(1, 2, TPB, 2, 16), (1, 2, TPB, 2, 16), (1, 64)]),
])
def test_cache_config_and_layouts_follow_the_model(preset, life_cycles, shapes):
    engine = TorchEngine.from_preset(preset)
    with pytest.raises(RuntimeError):
        engine.page_layouts()
    config = engine.cache_config(16, TPB, False)
    assert config.life_cycles == life_cycles and not config.enable_partial_reuse
    layouts = engine.page_layouts()
    assert [layout.shape for layout in layouts] == shapes
    assert {layout.device for layout in layouts} == {str(engine.device)}
    with pytest.raises(ValueError):
        engine.bind(KVCacheManager(config))  # no page storage


def test_same_seed_same_weights_and_describe():
    a, b, c = (TorchEngine.from_preset("tiny", seed=seed) for seed in (5, 5, 6))
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    assert not torch.equal(a.model.head.weight, c.model.head.weight)
    info = TorchEngine.from_preset("default").describe()
    assert (info["engine"], info["preset"], info["parameters"]) == ("torch", "default", 4329728)
    assert TorchEngine.from_preset("tiny", max_model_len=100).max_model_len == 100


# -- reuse is exact ----------------------------------------------------------------------

HYBRID = {"preset": "tiny-hybrid", "window": 48}
REUSE_CASES = {
    # name: (first prompt, second prompt, its first prefill chunks, reuse: tiny, hybrid)
    "whole blocks": (tokens(1, 64) + tokens(2, 4), tokens(1, 64) + tokens(3, 20), [64],
                     (64, 64)),
    "diverges inside a block": (tokens(1, 67) + [1], tokens(1, 67) + [2] + tokens(4, 12), [64],
                                (67, 64)),
    # The closed first request left a snapshot where it ended (60), inside block 7.
    "extends a stored partial block": (tokens(5, 60), tokens(5, 60) + tokens(6, 20), [56],
                                       (60, 60)),
}


@pytest.mark.parametrize("kind", ["tiny", "hybrid"])
@pytest.mark.parametrize("case", list(REUSE_CASES))
def test_reused_prefix_gives_the_same_output_as_scratch(case, kind):
    first, second, chunks, expected = REUSE_CASES[case]
    settings = {"preset": "tiny"} if kind == "tiny" else HYBRID
    engine, mgr = make(**settings)
    assert serve(engine, mgr, first, n_new=1, chunks=chunks).reused == 0
    reused = serve(engine, mgr, second)
    assert reused.reused == expected[kind == "hybrid"]
    scratch = serve(*make(**settings), second)
    assert scratch.reused == 0
    assert reused.generated == scratch.generated
    torch.testing.assert_close(reused.logits, scratch.logits, atol=ATOL, rtol=0)
    dense = reference_logits(engine.model, second)[-1].cpu()
    torch.testing.assert_close(reused.logits, dense, atol=ATOL, rtol=0)


def _assert_exact(engine, settings, prompt, run):
    """``run`` (served with reuse) equals the same prompt served from scratch, and its
    prompt logits equal the dense reference forward."""
    scratch = serve(*make(**settings), prompt, n_new=len(run.generated))
    assert scratch.reused == 0
    assert run.generated == scratch.generated
    torch.testing.assert_close(run.logits, scratch.logits, atol=ATOL, rtol=0)
    dense = reference_logits(engine.model, prompt)[-1].cpu()
    torch.testing.assert_close(run.logits, dense, atol=ATOL, rtol=0)


SHARED_PROMPT_MODELS = {
    # name: (settings, reuse of the shared 100-token prompt by the second request)
    # Window 48 < 100. With a recurrent layer the reuse ends at the last snapshot <= 100,
    # where the first request's prefill chunk ended (96).
    "full+sliding+recurrent": (HYBRID, 96),
    "full+sliding": ({**HYBRID, "layers": ("full", "sliding")}, 100),
}


@pytest.mark.parametrize("model", list(SHARED_PROMPT_MODELS))
def test_a_shared_prompt_longer_than_the_window_is_reused_exactly(model):
    settings, expected = SHARED_PROMPT_MODELS[model]
    engine, mgr = make(**settings)
    system = tokens(9, 100)
    assert serve(engine, mgr, system + tokens(10, 20), chunks=[96]).reused == 0
    second = system + tokens(11, 20)
    run = serve(engine, mgr, second)
    assert run.reused == expected
    _assert_exact(engine, settings, second, run)


def test_a_multi_turn_hybrid_chat_resumes_each_turn_exactly_where_the_last_ended():
    """Five turns on the hybrid model (prompt, then one commit per decoded token, close):
    each turn reuses exactly what the previous one committed (its end lies inside a block:
    the snapshot taken at close), and computes what a scratch run computes."""
    engine, mgr = make(**HYBRID)
    history, ends, reused = tokens(12, 21), [], []
    for turn in range(5):
        run = serve(engine, mgr, history, n_new=6)
        reused.append(run.reused)
        _assert_exact(engine, HYBRID, history, run)
        ends.append(len(history) + 5)  # the last sampled token is never committed
        history = history + run.generated + tokens(100 + turn, 11)
    assert reused == [0] + ends[:-1]
    assert [end % TPB for end in ends[:-1]] == [2, 3, 4, 5]  # all inside a block


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_chunked_prefill_matches_one_chunk(preset):
    prompt = tokens(7, 90)
    whole = serve(*make(preset), prompt)
    chunked = serve(*make(preset), prompt, chunks=[30, 26])
    assert chunked.generated == whole.generated
    torch.testing.assert_close(chunked.logits, whole.logits, atol=ATOL, rtol=0)


# -- only the pages a step needs are read --------------------------------------------------

def _poison_unread(engine: TorchEngine, mgr: KVCacheManager):
    """After each commit, fill with NaN every page slot the next step must not read: pages
    the cache does not hold, window pages it gave back, slots past the committed tokens,
    and recurrent pages other than the live one."""
    seen_released = []

    def poison(cache) -> None:
        committed = cache.num_committed_tokens
        for pool, kind in enumerate(engine.kinds):
            store = mgr.page_storage(pool)
            if kind == "recurrent":
                keep = {cache.live_state_page(pool)}
            else:
                table = cache.block_table(pool)
                seen_released.append(None in table)
                keep = {p for p in table if p is not None}
                for block, page in enumerate(table):
                    if page is not None and (block + 1) * TPB > committed:
                        store[page, :, :, max(0, committed - block * TPB):] = float("nan")
            for page in set(range(store.shape[0])) - keep:
                store[page] = float("nan")

    return poison, seen_released


def test_pages_outside_the_window_are_never_read():
    prompt = tokens(8, 100)
    clean = serve(*make("tiny-hybrid"), prompt, chunks=[20, 30])
    engine, mgr = make("tiny-hybrid")
    poison, seen_released = _poison_unread(engine, mgr)
    poisoned = serve(engine, mgr, prompt, chunks=[20, 30], after_commit=poison)
    assert any(seen_released)  # sliding-window pages really were given back
    assert torch.isfinite(poisoned.logits).all()
    assert poisoned.generated == clean.generated
    torch.testing.assert_close(poisoned.logits, clean.logits, atol=ATOL, rtol=0)


# -- sampling ------------------------------------------------------------------------------

def _step_prompt(preset: str, prompt: list[int], params: SamplingParams) -> int:
    engine, mgr = make(preset)
    cache = mgr.create_kv_cache(prompt[:-1])
    assert cache.resize(len(prompt))
    return asyncio.run(engine.step([StepItem("s", cache, prompt, 0, params)]))[0]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, top_p=1e-6)])
def test_greedy_and_tiny_top_p_pick_the_argmax(params):
    prompt = tokens(9, 40)
    engine, mgr = make("tiny")
    cache = mgr.create_kv_cache(prompt[:-1])
    assert cache.resize(len(prompt))
    logits = engine.forward_logits([StepItem("s", cache, prompt, 0, None)])[0]
    assert _step_prompt("tiny", prompt, params) == int(logits.argmax())


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    prompt = tokens(10, 40)

    def sample(seed):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        return serve(*make("tiny-hybrid"), prompt, n_new=8, params=params).generated

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_a_step_mixing_greedy_and_seeded_items_picks_as_each_would_alone():
    """Greedy and drawn picks of one step come back together: each equals the item's own
    pick from its last logits (argmax; a draw from a generator of the same seed)."""
    prompts = [tokens(20 + i, 30 + 7 * i) for i in range(3)]
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(temperature=1.3, seed=6)]
    engine, mgr = make("tiny")
    caches = [mgr.create_kv_cache(p[:-1]) for p in prompts]
    for cache, prompt in zip(caches, prompts):
        assert cache.resize(len(prompt))
    items = [StepItem(f"s{i}", c, p, 0, sp, {}) for i, (c, p, sp) in
             enumerate(zip(caches, prompts, params))]
    picks = asyncio.run(engine.step(items))
    logits = []
    for prompt in prompts:
        e, m = make("tiny")
        cache = m.create_kv_cache(prompt[:-1])
        assert cache.resize(len(prompt))
        logits.append(e.forward_logits([StepItem("s", cache, prompt, 0, None)])[0])
    expected = [sample_token(row, sp, {}) for row, sp in zip(logits, params)]
    assert picks == expected


def test_steps_compute_on_one_thread_off_the_event_loop_and_measure_the_prefill_rate():
    """Every step on the engine's one compute thread, whichever event loop awaits it (a
    pool's next free worker would start another OpenMP team); close() ends that thread."""
    engine, mgr = make("tiny")
    threads = []
    compute = engine._compute
    engine._compute = lambda batch: threads.append(threading.current_thread()) or compute(batch)
    initial = engine.prefill_tokens_per_s

    def step(seed: int) -> None:
        prompt = tokens(seed, 100)
        cache = mgr.create_kv_cache(prompt[:-1])
        assert cache.resize(len(prompt))
        asyncio.run(engine.step([StepItem("s", cache, prompt, 0, GREEDY)]))
        cache.close()

    for seed in (12, 13, 14):  # the first measured step is a warm-up, not counted
        step(seed)
    assert len(threads) == 3 and len(set(threads)) == 1
    assert threads[0] is not threading.current_thread()
    assert threads[0].name.startswith("torch-engine")
    assert engine.prefill_tokens_per_s != initial
    engine.close()
    threads[0].join(timeout=10)
    assert not threads[0].is_alive()
    step(15)
    assert len(threads) == 4 and threads[3] is not threads[0] and threads[3].is_alive()
    engine.close()


def test_bad_items_are_refused():
    engine, mgr = make("tiny")
    cache = mgr.create_kv_cache([])
    assert cache.resize(8)
    with pytest.raises(ValueError, match="start"):
        engine.forward_logits([StepItem("s", cache, [1, 2], 1, None)])
    with pytest.raises(ValueError, match="capacity"):
        engine.forward_logits([StepItem("s", cache, list(range(9)), 0, None)])
    with pytest.raises(ValueError, match="top_p"):
        engine.forward_logits([StepItem("s", cache, [1], 0, SamplingParams(top_p=0.0))])
