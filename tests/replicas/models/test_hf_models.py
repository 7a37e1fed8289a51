"""Hugging Face architectures on the KV pages compute exactly what transformers computes.

For each variant (tests/replicas/models/checkpoints.py) a tiny random checkpoint is saved
with transformers' ``save_pretrained`` and served by ``TorchEngine.from_checkpoint``, driven
as the scheduler drives it (``create_kv_cache(prompt[:-1])``, ``resize``, prefill chunks,
one decode token a step, ``commit`` after each step). transformers is the oracle: prefill
logits within 1e-4 of its forward, greedy continuations identical to ``generate``.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from kvcache import FullAttention, KVCache, KVCacheManager, SlidingWindow
from replicas.engines.base import SamplingParams, StepItem
from replicas.engines.torch_engine import TorchEngine
from tests.replicas.models.checkpoints import POOLS, VARIANTS, VOCAB, WINDOW

TPB = 8
# bench/gpu_check.sh runs these on CUDA (our engine there; transformers stays the CPU oracle).
DEVICE = os.environ.get("REPLICAS_TEST_DEVICE", "cpu")
GREEDY = SamplingParams(temperature=0.0)
ATOL = 1e-4
N_NEW = 16


def make(directory, pages: int = 96) -> tuple[TorchEngine, KVCacheManager]:
    engine = TorchEngine.from_checkpoint(directory, device=DEVICE)
    mgr = KVCacheManager(engine.cache_config(pages, TPB, True), engine.page_layouts())
    engine.bind(mgr)
    return engine, mgr


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def hf_generate(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=N_NEW)
    return out[0, len(prompt):].tolist()


@dataclass
class Request:
    prompt: list[int]
    cache: KVCache
    pos: int = 0
    generated: list[int] = field(default_factory=list)
    state: dict = field(default_factory=dict)

    def next_item(self, chunk: int) -> StepItem:
        """A prefill chunk of at most ``chunk`` tokens, or the last token to decode."""
        if self.pos < len(self.prompt):
            new = self.prompt[self.pos:self.pos + chunk]
            done = self.pos + len(new) == len(self.prompt)
            return StepItem("s", self.cache, new, self.pos, GREEDY if done else None,
                            self.state)
        return StepItem("s", self.cache, self.generated[-1:], self.pos, GREEDY, self.state)


async def _serve(engine, mgr, arrivals: list[tuple[int, list[int]]], chunk: int):
    """A small scheduler: request i joins at step ``arrivals[i][0]``; every step is one
    ``engine.step`` over all running requests (prefill chunks and decodes together)."""
    waiting = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    running: dict[int, Request] = {}
    done: dict[int, Request] = {}
    step = 0
    while waiting or running:
        while waiting and waiting[0][1][0] <= step:
            i, (_, prompt) = waiting.pop(0)
            cache = mgr.create_kv_cache(prompt[:-1])
            assert cache.resize(len(prompt) + N_NEW)
            running[i] = Request(prompt, cache, pos=cache.num_reused_tokens)
        items = {i: r.next_item(chunk) for i, r in running.items()}
        if items:
            out = await engine.step(list(items.values()))
            for (i, item), token in zip(items.items(), out):
                r = running[i]
                r.cache.commit(item.tokens)
                r.pos += len(item.tokens)
                if token is not None:
                    r.generated.append(token)
                if len(r.generated) == N_NEW:
                    r.cache.close()
                    done[i] = running.pop(i)
        step += 1
    return [done[i] for i in range(len(arrivals))]


def serve(engine, mgr, arrivals, chunk: int = 16) -> list[Request]:
    return asyncio.run(_serve(engine, mgr, arrivals, chunk))


def serve_one(engine, mgr, prompt, chunk: int = 16) -> Request:
    return serve(engine, mgr, [(0, prompt)], chunk)[0]


# -- the model ---------------------------------------------------------------------------

# The reuse figures and page shapes below are those of attention-only models; variants
# with recurrent layers are served in test_families.py, which knows their reuse rules.
ATTENTION_ONLY = [v for v in VARIANTS if all(kind != "recurrent" for kind, _, _ in POOLS[v])]

@pytest.mark.parametrize("variant", ATTENTION_ONLY)
def test_pools_and_pages_follow_the_config(checkpoint, variant):
    directory, hf = checkpoint(variant)
    engine = TorchEngine.from_checkpoint(directory, device=DEVICE)
    life = {"full": FullAttention(), "sliding": SlidingWindow(window=WINDOW)}
    assert engine.cache_config(16, TPB, True).life_cycles == tuple(
        life[kind] for kind, _, _ in POOLS[variant])
    head_dim = 24 if variant == "qwen3" else 16  # Qwen3's own head_dim, else 64 / 4 heads
    expected = [(n, 2, TPB, 2, head_dim) for _, _, n in POOLS[variant]]
    assert [layout.shape for layout in engine.page_layouts()] == expected
    assert {layout.dtype for layout in engine.page_layouts()} == {"float32"}
    assert engine.max_model_len == 256
    assert engine.describe()["parameters"] == hf.num_parameters()


@pytest.mark.parametrize("variant", ATTENTION_ONLY)
def test_prefill_logits_match_transformers(checkpoint, variant):
    """Whole and in chunks crossing block and window boundaries: each chunk's last
    logits equal transformers' forward at that position."""
    directory, hf = checkpoint(variant)
    prompt = tokens(1, 40)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    for chunks in ([40], [5, 11, 9, 15]):
        engine, mgr = make(directory)
        cache = mgr.create_kv_cache(prompt[:-1])
        assert cache.resize(len(prompt))
        pos = 0
        for size in chunks:
            got = engine.forward_logits([StepItem("s", cache, prompt[pos:pos + size], pos,
                                                  None)])[0]
            cache.commit(prompt[pos:pos + size])
            pos += size
            torch.testing.assert_close(got, expected[pos - 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ATTENTION_ONLY)
def test_greedy_matches_generate_cold_and_with_a_reused_prefix(checkpoint, variant):
    """A 37-token shared prefix (longer than the window of 12, ending inside a block):
    the second request reuses all of it, the third (the first again) all but its last
    token; every continuation is transformers' ``generate``."""
    directory, hf = checkpoint(variant)
    system = tokens(2, 37)
    first, second = system + tokens(3, 6), system + tokens(4, 9)
    engine, mgr = make(directory)
    runs = [serve_one(engine, mgr, prompt) for prompt in (first, second, first)]
    assert [r.cache.num_reused_tokens for r in runs] == [0, 37, len(first) - 1]
    assert runs[0].generated == runs[2].generated == hf_generate(hf, first)
    assert runs[1].generated == hf_generate(hf, second)


@pytest.mark.parametrize("variant", ATTENTION_ONLY)
def test_a_batch_arriving_at_different_steps_matches_each_solo_run(checkpoint, variant):
    """Four requests of different lengths join at steps 0, 1, 3 and 4, so steps mix
    prefill chunks and decodes; the last shares the first's 20-token prefix."""
    directory, hf = checkpoint(variant)
    arrivals = [(0, tokens(5, 30)), (1, tokens(6, 45)), (3, tokens(7, 3)),
                (4, tokens(5, 20) + tokens(8, 10))]
    batched = serve(*make(directory), arrivals, chunk=16)
    assert batched[3].cache.num_reused_tokens == 20
    for request, (_, prompt) in zip(batched, arrivals):
        solo = serve_one(*make(directory), prompt)
        assert request.generated == solo.generated == hf_generate(hf, prompt)
