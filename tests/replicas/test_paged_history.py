"""``ctx.history``: an attention layer writes its new entries and gets back, per sequence,
the cached entries its new tokens see (keys and values of their own widths), to attend
over itself (MLA's latents).

A toy model whose cached entries are a known function of (layer, token, position) runs on
real pages: several sequences per step, prefill chunks and decodes mixed, a prefix reused
from another sequence's pages, a sliding window. Every ``History`` must hold exactly the
entries of positions ``first .. end`` (``first`` the window's start), and the mask exactly
what each new token sees.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvcache import FullAttention, KVCacheManager, SlidingWindow
from replicas.engines.base import StepItem
from replicas.engines.torch_engine import TorchEngine
from replicas.models.base import AttentionSpec, ModelSpec, RecurrentSpec, StateSpec

TPB = 4
WINDOW = 5
VOCAB = 50
LAYERS = (
    AttentionSpec(2, 6, v_head_dim=3),  # keys and values of different widths: side by side
    AttentionSpec(2, 6, v_head_dim=3, window=WINDOW),
    AttentionSpec(2, 4, window=7),  # equal widths: the usual [2, tpb, KV, hd] pages
)


def entry(layer: int, width: int, tokens: torch.Tensor, positions: torch.Tensor,
          salt: int) -> torch.Tensor:
    """The cached entry ``[T, 2, width]`` a layer writes for ``tokens`` at ``positions``."""
    gen = torch.Generator().manual_seed(1000 * layer + 10 * width + salt)
    table = torch.randn(VOCAB, 2, width, generator=gen)
    return table[tokens] + positions[:, None, None].float() / 8


class Recorder(nn.Module):
    """Calls ``history`` in each layer (and ``attend`` too on the equal-width layer) and
    keeps what came back."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))
        self.spec = ModelSpec(LAYERS, max_model_len=64, vocab_size=VOCAB)
        self.calls: list[dict] = []

    def forward(self, tokens, positions, ctx):
        call = {"bounds": list(ctx.bounds), "positions": positions.tolist(), "layers": {}}
        for layer, spec in enumerate(LAYERS):
            k = entry(layer, spec.head_dim, tokens, positions, 0)
            v = entry(layer, spec.value_dim, tokens, positions, 1)
            seen = ctx.history(layer, k, v)
            call["layers"][layer] = seen
            if spec.split_kv:  # history then attend: the same pages, the same result
                q = entry(layer, spec.head_dim, tokens, positions, 2)
                call["attend"] = (q, seen, ctx.attend(layer, q, k, v))
        self.calls.append(call)
        return torch.zeros(tokens.shape[0], 1)

    def logits(self, hidden):
        return torch.zeros(hidden.shape[0], VOCAB)


def engine_and_manager(pages: int = 48):
    engine = TorchEngine(Recorder())
    manager = KVCacheManager(engine.cache_config(pages, TPB, True), engine.page_layouts())
    engine.bind(manager)
    return engine, manager


def test_pages_of_unequal_widths_hold_key_and_value_side_by_side():
    """One row per token and layer, the key's 6 values then the value's 3; the equal-width
    layer's pages as ever."""
    engine, manager = engine_and_manager()
    assert manager.config.life_cycles == (FullAttention(), SlidingWindow(window=WINDOW),
                                          SlidingWindow(window=7))
    assert [layout.shape for layout in engine.page_layouts()] == [
        (1, TPB, 2, 9), (1, TPB, 2, 9), (1, 2, TPB, 2, 4)]
    assert engine.page_rows == (TPB, TPB, 2 * TPB)


def test_a_pool_refuses_layers_of_different_value_widths():
    spec = ModelSpec((AttentionSpec(2, 6, v_head_dim=3), AttentionSpec(2, 6)),
                     max_model_len=64, vocab_size=VOCAB)
    recorder = Recorder()
    recorder.spec = spec
    with pytest.raises(ValueError, match="share a pool but differ"):
        TorchEngine(recorder)


def _expected(layer: int, spec: AttentionSpec, history: list[int], start: int, n: int):
    """Keys, values, first position and mask a sequence of tokens ``history`` (all of
    them, the n new ones last, from ``start``) should get."""
    end = start + n
    first = 0 if spec.window is None else max(0, start + 1 - spec.window)
    tokens, positions = torch.tensor(history[first:end]), torch.arange(first, end)
    keys = entry(layer, spec.head_dim, tokens, positions, 0)
    values = entry(layer, spec.value_dim, tokens, positions, 1)
    mask = None
    if n > 1:
        q_pos, k_pos = torch.arange(start, end)[:, None], positions[None, :]
        mask = k_pos <= q_pos
        if spec.window is not None:
            mask &= k_pos > q_pos - spec.window
    return keys, values, first, mask


def test_history_is_exactly_what_each_new_token_sees():
    """Three sequences: A prefills 9 then 6 tokens while B prefills 7; then both decode
    while C, sharing A's first 12 tokens (three blocks reused from A's pages), prefills
    its rest in two chunks. Every history, every layer, against the dense expectation."""
    engine, manager = engine_and_manager()
    rng = random.Random(3)
    seq = {"A": [rng.randrange(VOCAB) for _ in range(24)],
           "B": [rng.randrange(VOCAB) for _ in range(20)]}
    seq["C"] = seq["A"][:12] + [rng.randrange(VOCAB) for _ in range(10)]
    caches, pos = {}, {}
    for name in ("A", "B"):
        caches[name] = manager.create_kv_cache(seq[name][:-1])
        assert caches[name].resize(len(seq[name]))
        pos[name] = 0
    steps = [{"A": 9, "B": 7}, {"A": 6, "B": 1}, {"A": 1, "B": 1, "C": 5},
             {"A": 1, "C": 4}, {"A": 1, "B": 1, "C": 1}]
    recorder, checked = engine.model, 0
    for step in steps:
        if "C" in step and "C" not in caches:
            caches["C"] = manager.create_kv_cache(seq["C"][:-1])
            assert caches["C"].resize(len(seq["C"]))
            pos["C"] = caches["C"].num_reused_tokens
            assert pos["C"] == 12
        items = [StepItem(name, caches[name], seq[name][pos[name]:pos[name] + n], pos[name],
                          None) for name, n in step.items()]
        engine.forward_logits(items)
        call = recorder.calls[-1]
        for i, (name, n) in enumerate(step.items()):
            a, e = call["bounds"][i]
            assert e - a == n and call["positions"][a] == pos[name]
            for layer, spec in enumerate(LAYERS):
                seen = call["layers"][layer][i]
                keys, values, first, mask = _expected(layer, spec, seq[name], pos[name], n)
                assert seen.first == first
                assert seen.keys.shape == (len(keys), spec.n_kv_heads, spec.head_dim)
                assert seen.values.shape == (len(keys), spec.n_kv_heads, spec.value_dim)
                torch.testing.assert_close(seen.keys, keys, atol=0, rtol=0)
                torch.testing.assert_close(seen.values, values, atol=0, rtol=0)
                assert seen.positions.tolist() == list(range(first, pos[name] + n))
                if mask is None:
                    assert seen.mask is None
                else:
                    assert torch.equal(seen.mask, mask)
                checked += 1
        for name, n in step.items():
            caches[name].commit(seq[name][pos[name]:pos[name] + n])
            pos[name] += n
    assert checked == 3 * sum(len(step) for step in steps)
    for cache in caches.values():
        cache.close()
    manager.check_invariants()


def test_attending_over_history_equals_attend_on_equal_widths():
    """On the equal-width layer, SDPA over what ``history`` returned (with its mask) is
    what ``attend`` computes over the same pages."""
    engine, manager = engine_and_manager()
    prompt = [random.Random(5).randrange(VOCAB) for _ in range(14)]
    cache = manager.create_kv_cache(prompt[:-1])
    assert cache.resize(len(prompt))
    pos = 0
    for n in (6, 5, 1, 1, 1):
        engine.forward_logits([StepItem("s", cache, prompt[pos:pos + n], pos, None)])
        cache.commit(prompt[pos:pos + n])
        pos += n
        q, (seen,), attended = engine.model.calls[-1]["attend"]
        ours = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], seen.keys.transpose(0, 1)[None],
            seen.values.transpose(0, 1)[None], attn_mask=seen.mask,
            scale=LAYERS[2].softmax_scale, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(ours, attended, atol=1e-6, rtol=0)
    cache.close()


class Misuse(Recorder):
    def __init__(self, misuse) -> None:
        super().__init__()
        self.misuse = misuse
        self.spec = ModelSpec((*LAYERS, RecurrentSpec((StateSpec("s", (2,)),))),
                              max_model_len=64, vocab_size=VOCAB)

    def forward(self, tokens, positions, ctx):
        t = tokens.shape[0]
        self.misuse(ctx, t)
        return torch.zeros(t, 1)


@pytest.mark.parametrize("misuse, message", [
    (lambda ctx, t: ctx.attend(0, torch.zeros(t, 2, 6), torch.zeros(t, 2, 6),
                               torch.zeros(t, 2, 3)), "attend needs keys and values of one"),
    (lambda ctx, t: ctx.history(0, torch.zeros(t, 2, 6), torch.zeros(t, 2, 6)),
     r"history\(\) takes k \[T, 2, 6\] and v \[T, 2, 3\]"),
    (lambda ctx, t: ctx.history(3, torch.zeros(t, 2, 6), torch.zeros(t, 2, 3)),
     "history\\(\\) is for attention layers"),
])
def test_what_history_and_attend_do_not_serve_is_refused(misuse, message):
    engine = TorchEngine(Misuse(misuse))
    manager = KVCacheManager(engine.cache_config((16, 16, 16, 8), TPB, True), engine.page_layouts())
    engine.bind(manager)
    cache = manager.create_kv_cache([1, 2])
    assert cache.resize(3)
    with pytest.raises(ValueError, match=message):
        engine.forward_logits([StepItem("s", cache, [1, 2, 3], 0, None)])
    cache.close()
