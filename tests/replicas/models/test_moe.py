"""replicas.models.moe: routed experts in grouped matmuls, bit for bit transformers' default
``grouped_mm`` experts (fp32, CPU), through F.grouped_mm and through the per-expert
fallback; and the stacking of per-expert checkpoint tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf_q3n

from replicas.models import CheckpointError
from replicas.models import moe
from replicas.models.moe import grouped_linear, routed_experts, stacked_sources, swiglu
from tests.replicas.models.checkpoints import hf_config


def hf_experts(implementation: str, top_k: int):
    config = hf_config("qwen3-next", num_experts=6, num_experts_per_tok=top_k)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    experts = hf_q3n.Qwen3NextExperts(config).eval()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


def routing(t: int, k: int, e: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    return chosen, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 3, 5])
@pytest.mark.parametrize("tokens", [1, 16, 37])
def test_routed_experts_are_transformers_grouped_mm_bit_for_bit(monkeypatch, fallback,
                                                                 top_k, tokens):
    """Experts hit by no token, by one and by many; top-3 and top-5 sum a token's outputs
    in slot order as transformers does. The per-expert fallback gives the same bits."""
    if fallback:
        monkeypatch.setattr(moe, "_grouped_mm_usable", lambda x, w: False)
    hf = hf_experts("grouped_mm", top_k)
    x = torch.randn(tokens, hf.hidden_dim)
    chosen, weights = routing(tokens, top_k, hf.num_experts)
    with torch.no_grad():
        expected = hf(x, chosen, weights)
        eager = hf_experts("eager", top_k)(x, chosen, weights)
    got = routed_experts(x, chosen, weights, hf.gate_up_proj.detach(), hf.down_proj.detach(),
                         swiglu)
    assert torch.equal(got, expected)
    # transformers' own eager loop differs from it in the last bits (other matmul shapes)
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)


def test_grouped_linear_transposed_with_biases_is_per_expert_matmuls():
    """GPT-OSS's layout ([E, in, out], biases per expert) equals x @ w[e] + b[e]."""
    torch.manual_seed(2)
    w, b = torch.randn(4, 24, 10), torch.randn(4, 10)
    chosen, weights = routing(9, 2, 4)
    x = torch.randn(9, 24)
    down, down_b = torch.randn(4, 10, 24), torch.randn(4, 24)
    got = routed_experts(x, chosen, weights, w, down, torch.relu, b, down_b, transposed=True)
    expected = torch.zeros_like(x)
    for t in range(9):
        for slot in range(2):
            e = chosen[t, slot]
            y = torch.relu(x[t] @ w[e] + b[e]) @ down[e] + down_b[e]
            expected[t] += y * weights[t, slot]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    offsets = torch.tensor([2, 2, 5, 9], dtype=torch.int32)  # expert 1 gets no rows
    out = grouped_linear(x, w, offsets, transposed=True)  # 40-byte rows: the fallback
    for e, (a, z) in enumerate(((0, 2), (2, 2), (2, 5), (5, 9))):
        torch.testing.assert_close(out[a:z], x[a:z] @ w[e], atol=1e-5, rtol=0)


def test_float64_runs_the_fallback():
    """F.grouped_mm takes no float64: each expert's rows through torch.mm instead."""
    w = torch.randn(3, 8, 5, dtype=torch.float64)
    x = torch.randn(6, 5, dtype=torch.float64)
    out = grouped_linear(x, w, torch.tensor([1, 1, 6], dtype=torch.int32))
    assert torch.equal(out[:1], F.linear(x[:1], w[0]))
    assert torch.equal(out[1:], F.linear(x[1:], w[2]))


def test_stacked_sources_stack_and_concatenate_as_transformers_converts():
    names, combine = stacked_sources("m.experts", ("gate_proj", "up_proj"), 3)
    assert names == tuple(f"m.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj")
                          for e in range(3))
    parts = [torch.full((2, 4), float(i)) for i in range(6)]
    fused = combine(*parts)
    assert fused.shape == (3, 4, 4)
    for e in range(3):
        assert torch.equal(fused[e], torch.cat([parts[e], parts[3 + e]]))
    names, combine = stacked_sources("m.experts", ("down_proj",), 2)
    assert combine(*parts[:2]).shape == (2, 2, 4)
    with pytest.raises(CheckpointError, match="one shape"):
        combine(parts[0], torch.zeros(3, 4))
