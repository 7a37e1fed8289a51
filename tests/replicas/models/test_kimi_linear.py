"""Kimi Linear specifics: its pools and pages (MLA's latents side by side, KDA's states),
the states and latents against transformers' cache, chunking, MoE routing and the
config variants against transformers, the two names of a dense MLP, float32 router and
gate tensors, and the config fields it refuses."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvcache import FullAttention, Recurrent
from replicas.checkpoint import load_checkpoint, read_config
from replicas.engines.base import StepItem
from replicas.models import CheckpointError
from replicas.models.kimi_linear import (KimiMoEGate, chunked_delta_rule, parse_config,
                                         recurrent_delta_rule)
from tests.replicas.models.checkpoints import VOCAB, hf_config
from tests.replicas.models.serving import Served, hf_generate, hf_logits

TPB = 8
ATOL = 1e-4
KDA_LAYERS, MLA_LAYER = (0, 1, 2), 3
CHANNELS, KEEP = 4 * 16, 3  # q/k/v width of a KDA layer, conv_kernel - 1


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def run(served: Served, ids: list[int], pieces: list[int]) -> tuple[object, list[torch.Tensor]]:
    """Compute ``ids`` in steps of ``pieces`` tokens; the cache (open) and each step's
    last logits."""
    cache = served.manager.create_kv_cache(ids[:1])
    assert cache.resize(len(ids))
    pos, logits = 0, []
    for n in pieces:
        logits.append(served.engine.forward_logits(
            [StepItem("s", cache, ids[pos:pos + n], pos, None)])[0])
        cache.commit(ids[pos:pos + n])
        pos += n
    assert pos == len(ids)
    return cache, logits


def hf_cache(hf, ids: list[int], prefill: int):
    """transformers' cache after a ``prefill``-token forward and one-token steps."""
    with torch.inference_mode():
        past = hf(torch.tensor([ids[:prefill]]), use_cache=True).cache
        for t in ids[prefill:]:
            past = hf(torch.tensor([[t]]), cache=past, use_cache=True).cache
    return past


def test_pools_and_pages_follow_the_layer_types(checkpoint):
    """Three KDA layers in the recurrent pool (three conv states of 64 channels x 3
    earlier inputs and a 4 x 16 x 16 state each, float32), the MLA layer in the full pool:
    one row per token of its latent (32) then its shared key part (8), one "KV head"."""
    directory, hf = checkpoint("kimi-linear")
    served = Served(directory, TPB, pages=16)
    assert served.manager.config.life_cycles == (FullAttention(), Recurrent())
    layouts = served.engine.page_layouts()
    assert [layout.shape for layout in layouts] == [
        (1, TPB, 1, 32 + 8), (3, 3 * CHANNELS * KEEP + 4 * 16 * 16)]
    assert [layout.dtype for layout in layouts] == ["float32", "float32"]
    assert served.engine.describe()["layers"] == ["recurrent"] * 3 + ["full"]
    spec = served.engine.spec.layers[MLA_LAYER]
    assert (spec.n_kv_heads, spec.head_dim, spec.value_dim) == (1, 32, 8)
    assert spec.softmax_scale == (16 + 8) ** -0.5
    args = read_config(directory)
    assert args.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert args.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    # e_score_correction_bias is a parameter here, a buffer in transformers
    n_bias = sum(b.numel() for name, b in hf.named_buffers() if "e_score" in name)
    assert served.engine.describe()["parameters"] == hf.num_parameters() + n_bias


def test_mla_pages_hold_exactly_the_latent_and_the_shared_key_part(checkpoint):
    """After 21 tokens (a chunk of 13, then one at a time), each token's row in the MLA
    pool is transformers' cached ``kv_nope`` (after kv_a_layernorm) then its ``k_rot``,
    no RoPE applied; rows past the last token are untouched."""
    directory, hf = checkpoint("kimi-linear")
    ids = tokens(6, 21)
    served = Served(directory, TPB, pages=16)
    cache, _ = run(served, ids, [13] + [1] * 8)
    past = hf_cache(hf, ids, 13)
    layer = past.layers[MLA_LAYER]
    store, table = served.manager.page_storage(0), cache.block_table(0)
    rows = torch.stack([store[table[p // TPB], 0, p % TPB, 0] for p in range(len(ids))])
    torch.testing.assert_close(rows[:, :32], layer.keys[0, 0].float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(rows[:, 32:], layer.values[0, 0].float(), atol=1e-5, rtol=0)
    # the same from transformers' own modules: kv_a_proj_with_mqa, then the latent's norm
    attn, hidden = hf.model.layers[MLA_LAYER].self_attn, {}

    def keep_input(module, args, kwargs) -> None:
        hidden["x"] = kwargs["hidden_states"]

    hook = attn.register_forward_pre_hook(keep_input, with_kwargs=True)
    with torch.inference_mode():
        hf(torch.tensor([ids]))
        hook.remove()
        latent, k_rot = attn.kv_a_proj_with_mqa(hidden["x"][0]).split([32, 8], dim=-1)
        expected = torch.cat([attn.kv_a_layernorm(latent), k_rot], dim=-1)
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=0)
    cache.close()


def test_conv_and_recurrent_states_equal_transformers_cache_after_decoding(checkpoint):
    """After a 13-token prefill and 7 one-token steps, each KDA layer's three conv states
    (its last 3 q, k and v inputs) and its delta-rule state equal transformers' cache."""
    directory, hf = checkpoint("kimi-linear")
    ids = tokens(4, 20)
    served = Served(directory, TPB, pages=16)
    cache, _ = run(served, ids, [13] + [1] * 7)
    past = hf_cache(hf, ids, 13)
    live, store = cache.live_state_page(1), served.manager.page_storage(1)
    for slot, layer in enumerate(KDA_LAYERS):
        row = store[live, slot]
        conv = past.layers[layer].conv_states[0][0]  # [3 * 64, kernel]: q, k, v channels
        for i, name in enumerate(("q", "k", "v")):
            ours = row[i * CHANNELS * KEEP:(i + 1) * CHANNELS * KEEP].view(CHANNELS, KEEP)
            theirs = conv[i * CHANNELS:(i + 1) * CHANNELS, -KEEP:].float()
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0, msg=name)
        ours = row[3 * CHANNELS * KEEP:].view(4, 16, 16)
        theirs = past.layers[layer].recurrent_states[0][0].float()
        assert theirs.abs().max() > 0.1
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    cache.close()


def test_one_token_at_a_time_equals_chunked_prefill(checkpoint):
    """Every position's logits: token by token (the recurrent form from the first token
    on), in chunks of 5/11/9/15 and of 64+ (two chunks of the chunked form in one step)
    agree within 1e-4, and with transformers."""
    directory, hf = checkpoint("kimi-linear")
    ids = tokens(8, 80)
    expected = hf_logits(hf, ids)
    _, single = run(Served(directory, TPB), ids, [1] * 80)
    single = torch.stack(single)
    torch.testing.assert_close(single, expected, atol=ATOL, rtol=0)
    for pieces in ([5, 11, 9, 15, 40], [70, 10]):
        _, chunked = run(Served(directory, TPB), ids, pieces)
        ends = [sum(pieces[:i + 1]) - 1 for i in range(len(pieces))]
        for end, got in zip(ends, chunked):
            torch.testing.assert_close(got, single[end], atol=ATOL, rtol=0)


def test_chunked_and_recurrent_delta_rules_agree_from_any_state():
    """The chunked form (any chunk length, a nonzero initial state) equals the rule
    applied token by token."""
    gen = torch.Generator().manual_seed(0)
    n, h, dk, dv = 37, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(n, h, dk, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(n, h, dv, generator=gen)
    g = -torch.rand(n, h, dk, generator=gen)
    beta = torch.rand(n, h, generator=gen)
    state = torch.randn(h, dk, dv, generator=gen)
    outs, s = [], state
    for i in range(n):
        o, s = recurrent_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1],
                                    beta[i:i + 1], s[None])
        outs.append(o[0])
        s = s[0]
    for chunk in (64, 16, 5, 1):
        out, final = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
        torch.testing.assert_close(out, torch.stack(outs), atol=1e-5, rtol=0)
        torch.testing.assert_close(final, s, atol=1e-5, rtol=0)


@pytest.mark.parametrize("changes", [
    dict(n_group=2, topk_group=1),  # 2 groups of 2 experts: both picks from the best group
    dict(n_group=2, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5),
])
def test_moe_routing_equals_transformers_router(changes):
    """Experts chosen (as sets) and their weights, with a score-correction bias that moves
    the choice but not the weights."""
    config = hf_config("kimi-linear", **changes)
    torch.manual_seed(1)
    theirs = transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearTopkRouter(config)
    torch.nn.init.normal_(theirs.weight, std=0.3)
    theirs.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.25]))
    ours = KimiMoEGate(parse_config({**config.to_dict(),
                                     "architectures": ["KimiLinearForCausalLM"]}))
    ours.weight.data.copy_(theirs.weight)
    ours.e_score_correction_bias.data.copy_(theirs.e_score_correction_bias)
    x = torch.randn(200, 64)
    _, their_weights, their_idx = theirs(x)
    chosen, weights = ours(x)
    order, their_order = chosen.argsort(-1), their_idx.argsort(-1)
    assert torch.equal(chosen.gather(1, order), their_idx.gather(1, their_order))
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_order),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("changes", [
    dict(q_lora_rank=16, attention_bias=True),  # q through a low-rank projection and norm
    dict(n_group=2, topk_group=1, norm_topk_prob=False),
    dict(tie_word_embeddings=True, first_k_dense_replace=0, mlp_layer_types=None),
    dict(layer_types=["full_attention", "linear_attention", "full_attention",
                      "linear_attention"], mlp_layer_types=["sparse", "dense", "sparse",
                                                            "dense"]),
], ids=["q-lora-bias", "groups", "tied-all-moe", "layer-types"])
def test_config_variants_match_transformers(tmp_path, changes):
    """Logits within 1e-4 and greedy continuations equal to transformers', with a
    nonzero score-correction bias (the router's choice, not its weights). With
    tie_word_embeddings transformers still reads lm_head apart (it ties nothing): so here."""
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config("kimi-linear",
                                                                 **changes)).eval()
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompt = tokens(9, 30)
    expected = hf_logits(hf, prompt)
    _, logits = run(Served(tmp_path, TPB), prompt, [17, 13])
    torch.testing.assert_close(logits[-1], expected[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[0], expected[16], atol=ATOL, rtol=0)
    assert Served(tmp_path, TPB).one(prompt).tokens == hf_generate(hf, prompt)


def test_a_dense_mlp_is_read_under_moonshots_name_or_transformers(tmp_path, checkpoint):
    """transformers saves layer 0's dense MLP as ``block_sparse_moe.*_proj``; Moonshot's
    checkpoints name it ``mlp.*_proj``: both load, to the same logits."""
    directory, hf = checkpoint("kimi-linear")
    tensors = load_file(directory / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in tensors
    renamed = {name.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): t
               for name, t in tensors.items()}
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    prompt = tokens(12, 20)
    expected = hf_logits(hf, prompt)[-1]
    for source in (directory, tmp_path):
        _, logits = run(Served(source, TPB), prompt, [20])
        torch.testing.assert_close(logits[0], expected, atol=ATOL, rtol=0)


def test_router_and_gate_tensors_stay_float32_in_a_bfloat16_model(checkpoint):
    """As transformers keeps them (_keep_in_fp32_modules_strict): dt_bias, the router's
    weight and its bias; everything else in bfloat16."""
    directory, _ = checkpoint("kimi-linear")
    model = load_checkpoint(directory, "bfloat16")
    float32 = sorted(n for n, p in model.named_parameters() if p.dtype == torch.float32)
    assert float32 == sorted(
        [f"model.layers.{i}.self_attn.dt_bias" for i in KDA_LAYERS]
        + [f"model.layers.{i}.block_sparse_moe.gate.{name}" for i in (1, 2, 3)
           for name in ("weight", "e_score_correction_bias")])
    assert {p.dtype for p in model.parameters()} == {torch.float32, torch.bfloat16}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    their_float32 = {n.replace("forget_gate.", "").replace(".mlp.", ".block_sparse_moe.")
                     for n, p in [*theirs.named_parameters(), *theirs.named_buffers()]
                     if p.dtype == torch.float32}
    assert set(float32) == their_float32


def _config(tmp_path, **changes):
    config = hf_config("kimi-linear")
    raw = {**config.to_dict(), "architectures": ["KimiLinearForCausalLM"], **changes}
    for key in [k for k, v in changes.items() if v is None]:
        raw.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


LINEAR = dict(head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
              full_attn_layers=[4])


@pytest.mark.parametrize("changes, named", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"mla_use_output_gate": True}, "mla_use_output_gate"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"attn_res_block_size": 2}, "attn_res_block_size"),
    ({"routed_expert_hidden_size": 48}, "routed_expert_hidden_size"),
    ({"latent_moe_use_norm": True}, "latent_moe_use_norm"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"use_grouped_topk": False, "num_expert_group": 2}, "use_grouped_topk"),
    ({"linear_attn_config": {**LINEAR, "gate_lower_bound": -5.0}},
     "linear_attn_config.gate_lower_bound"),
    ({"linear_attn_config": {**LINEAR, "use_full_rank_gate": True}},
     "linear_attn_config.use_full_rank_gate"),
    ({"linear_attn_config": {**LINEAR, "short_conv_kernel_size": 1}}, "short_conv_kernel_size"),
    ({"linear_attn_config": {**LINEAR, "kda_layers": [1, 2]}, "layer_types": None},
     "full_attn_layers and kda_layers"),
    ({"layer_types": ["linear_attention"] * 3 + ["mamba"]}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"num_expert_group": 3}, "num_expert_group"),
    ({"num_expert_group": 4}, "num_expert_group"),  # groups of 1: no best two
    ({"num_expert_group": 2, "topk_group": 3}, "topk_group"),
    ({"num_experts_per_token": 5}, "num_experts_per_token"),
    ({"num_shared_experts": 0}, "num_shared_experts"),
    ({"max_position_embeddings": 128}, "model_max_length=256 and max_position_embeddings=128"),
])
def test_config_fields_it_cannot_serve_are_refused_by_name(tmp_path, changes, named):
    with pytest.raises(CheckpointError, match=named):
        read_config(_config(tmp_path, **changes))


def test_layer_kinds_from_the_checkpoints_lists_or_kimis_default(tmp_path):
    """Without ``layer_types``: ``linear_attn_config``'s 1-based lists, else MLA on every
    4th layer after the first (KimiLinearConfig's default); without ``mlp_layer_types``:
    dense up to ``first_k_dense_replace``; the linear attention sizes from
    ``linear_attn_config`` before the top-level fields; transformers' other field names."""
    raw = json.loads((_config(tmp_path) / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "num_experts_per_token"):
        raw.pop(key)
    raw.update(num_hidden_layers=6, first_k_dense_replace=2, linear_num_heads=2,
               num_experts_per_tok=3, linear_attn_config={
                   "kda_layers": [1, 3, 4, 6], "full_attn_layers": [2, 5], "head_dim": 8,
                   "num_heads": 4, "short_conv_kernel_size": 3})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    args = read_config(tmp_path)
    kinds = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
             "full_attention", "linear_attention"]
    assert list(args.layer_types) == kinds
    assert list(args.mlp_layer_types) == ["dense"] * 2 + ["sparse"] * 4
    assert (args.linear_num_heads, args.linear_head_dim, args.conv_kernel) == (4, 8, 3)
    assert (args.num_experts_per_token, args.max_position_embeddings) == (3, 256)
    raw.pop("linear_attn_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    args = read_config(tmp_path)
    assert [i for i, t in enumerate(args.layer_types) if t == "full_attention"] == [4]
    assert (args.linear_num_heads, args.linear_head_dim, args.conv_kernel) == (2, 128, 4)
    config = transformers.KimiLinearConfig(**{k: v for k, v in raw.items()
                                              if k not in ("architectures",)})
    assert list(args.layer_types) == config.layer_types
    assert list(args.mlp_layer_types) == config.mlp_layer_types
