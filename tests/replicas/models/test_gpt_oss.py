"""GPT-OSS specifics against transformers: the pools its alternating layers give, YaRN RoPE,
attention with learned sinks, the routed clamped-SwiGLU experts, every bias loaded name for
name, MXFP4 experts dequantized at load, and the config fields it refuses.

The family-wide serving tests (test_families.py) run the "gpt-oss" variant too; its
transformers init leaves every bias at zero, so ``test_biases_sinks_and_clamps`` below
draws them all.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss
from transformers.quantizers.quantizers_utils import should_convert_module

from kvcache import FullAttention, SlidingWindow
from replicas.checkpoint import load_checkpoint
from replicas.engines.base import StepItem
from replicas.engines.paged import _CAUSAL, attention
from replicas.models import ARCHITECTURES, AttentionSpec, CheckpointError
from replicas.models.gpt_oss import (GptOssForCausalLM, GptOssMLP, GptOssRotaryEmbedding,
                                     apply_rotary, dequantize_mxfp4, mxfp4_converts,
                                     parse_config, rope_parameters)
from tests.replicas.models.checkpoints import VOCAB, WINDOW, hf_config, save_checkpoint
from tests.replicas.models.serving import Served, hf_generate, hf_logits

TPB = 8
ATOL = 1e-4
ARCH = "GptOssForCausalLM"
VARIANT = "gpt-oss"


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def raw_config(**changes) -> dict:
    """The tiny variant's config.json, as save_pretrained writes it, with ``changes``."""
    raw = hf_config(VARIANT).to_dict()
    raw["architectures"] = [ARCH]
    raw.update(changes)
    return raw


def chunked_logits(directory, prompt, chunks) -> list[torch.Tensor]:
    """Our last logits of each chunk of ``prompt``."""
    served = Served(directory, TPB)
    cache = served.manager.create_kv_cache(prompt[:-1])
    assert cache.resize(len(prompt))
    out, pos = [], 0
    for size in chunks:
        out.append(served.engine.forward_logits(
            [StepItem("s", cache, prompt[pos:pos + size], pos, None)])[0])
        cache.commit(prompt[pos:pos + size])
        pos += size
    cache.close()
    return out


def assert_matches_transformers(directory, hf, prompt) -> None:
    expected = hf_logits(hf, prompt)
    for chunks in ([len(prompt)], [5, 11, 9, len(prompt) - 25]):
        ends = [sum(chunks[:i + 1]) for i in range(len(chunks))]
        for got, end in zip(chunked_logits(directory, prompt, chunks), ends):
            torch.testing.assert_close(got, expected[end - 1], atol=ATOL, rtol=0)


# -- pools and config --------------------------------------------------------------------

def test_registered():
    assert ARCHITECTURES[ARCH] is GptOssForCausalLM


def test_alternating_layers_give_a_full_and_a_sliding_pool_with_sinks(checkpoint):
    directory, hf = checkpoint(VARIANT)
    served = Served(directory, TPB)
    engine = served.engine
    assert engine.spec.layers == (
        AttentionSpec(2, 16, window=WINDOW, sinks=True), AttentionSpec(2, 16, sinks=True),
        AttentionSpec(2, 16, window=WINDOW, sinks=True), AttentionSpec(2, 16, sinks=True))
    assert engine.kinds == ("full", "sliding") and engine.windows == (None, WINDOW)
    assert engine.pool_layers == ((1, 3), (0, 2))
    assert engine.cache_config(16, TPB, True).life_cycles == (FullAttention(),
                                                              SlidingWindow(window=WINDOW))
    assert [layout.shape for layout in engine.page_layouts()] == [(2, 2, TPB, 2, 16)] * 2
    assert engine.describe()["parameters"] == hf.num_parameters()
    assert hf.config._attn_implementation == "eager"  # the oracle runs sink attention


def test_defaults_are_gpt_oss_config_s():
    """A config.json naming only the architecture reads as transformers' defaults (the
    released 120b's shape): 36 layers alternating sliding 128 / full, 64 heads of 64, 8 KV
    heads, 128 experts, top-4, YaRN x32 from 4096, theta 150000, untruncated."""
    bare = parse_config({"architectures": [ARCH]})
    full = parse_config({**transformers.GptOssConfig().to_dict(), "architectures": [ARCH]})
    assert bare == full
    assert bare.layer_types == ("sliding", "full") * 18 and bare.sliding_window == 128
    assert (bare.num_attention_heads, bare.num_key_value_heads, bare.head_dim) == (64, 8, 64)
    assert (bare.num_local_experts, bare.num_experts_per_tok) == (128, 4)
    assert (bare.swiglu_alpha, bare.swiglu_limit, bare.attention_bias) == (1.702, 7.0, True)
    rope = bare.rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings,
            rope.beta_fast, rope.beta_slow, rope.truncate) == ("yarn", 150000.0, 32.0, 4096,
                                                               32.0, 1.0, False)
    assert not bare.mxfp4


# -- RoPE --------------------------------------------------------------------------------

YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=8.0,
            original_max_position_embeddings=32)
ROPES = {
    "variant": None,
    "released": "released",
    "truncated": dict(YARN, beta_fast=32.0, beta_slow=1.0, truncate=True),
    "default-truncate": dict(YARN),  # truncate absent: transformers truncates
    "betas": dict(YARN, beta_fast=8.0, beta_slow=2.0, truncate=False),
    "attention-factor": dict(YARN, attention_factor=1.5, truncate=False),
    "mscale": dict(YARN, mscale=1.0, mscale_all_dim=0.5, truncate=False),
    "no-scaling": dict(YARN, factor=1.0),
    "implicit-factor": dict(YARN, factor=None),  # max_position_embeddings / original: 8
    "theta-1e4": dict(YARN, rope_theta=10000.0, original_max_position_embeddings=64),
    "default": dict(rope_type="default", rope_theta=10000.0),
}


@pytest.mark.parametrize("case", list(ROPES))
def test_rope_frequencies_and_attention_factor_are_transformers(case):
    """inv_freq bit for bit and the cos/sin factor as ``_compute_yarn_parameters`` (or the
    default RoPE) gives them; cos, sin and the rotated q equal GptOss's own."""
    params = ROPES[case]
    if params == "released":
        config = transformers.GptOssConfig()
    else:
        config = hf_config(VARIANT, **({} if params is None else {"rope_parameters": params}))
    raw = {**config.to_dict(), "architectures": [ARCH]}
    args = parse_config(raw)
    inv_freq, factor = rope_parameters(args.rope, args.head_dim)
    init = ROPE_INIT_FUNCTIONS.get(config.rope_parameters["rope_type"])
    if init is None:  # "default"
        init = hf_gpt_oss.GptOssRotaryEmbedding.compute_default_rope_parameters
    expected, expected_factor = init(config)
    assert torch.equal(inv_freq, expected)
    assert factor == expected_factor

    positions = torch.arange(300)
    rotary = hf_gpt_oss.GptOssRotaryEmbedding(config)
    hf_cos, hf_sin = rotary(torch.zeros(1), positions[None])
    cos, sin = GptOssRotaryEmbedding(args)(positions, torch.float32)
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])
    q = torch.randn(1, 3, 300, args.head_dim)
    hf_q, _ = hf_gpt_oss.apply_rotary_pos_emb(q, q, hf_cos, hf_sin)
    assert torch.equal(apply_rotary(q[0].transpose(0, 1), cos, sin), hf_q[0].transpose(0, 1))


# openai/gpt-oss-20b's config.json (older format: rope_scaling, rope_theta at the top level,
# fields of its own that transformers keeps as plain attributes).
RELEASED_20B = {
    "architectures": [ARCH], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
    "vocab_size": 201088}


def test_the_released_20b_config_reads_as_transformers_reads_it():
    args = parse_config(json.loads(json.dumps(RELEASED_20B)))
    config = transformers.GptOssConfig.from_dict(json.loads(json.dumps(RELEASED_20B)))
    inv_freq, factor = rope_parameters(args.rope, args.head_dim)
    rotary = hf_gpt_oss.GptOssRotaryEmbedding(config)
    assert torch.equal(inv_freq, rotary.inv_freq) and factor == rotary.attention_scaling
    assert args.layer_types == ("sliding", "full") * 12 and args.sliding_window == 128
    assert (args.num_local_experts, args.num_experts_per_tok) == (32, 4)
    assert args.mxfp4 and mxfp4_converts("model.layers.0.mlp.experts", args.mxfp4_skip)
    assert not mxfp4_converts("model.layers.0.self_attn", args.mxfp4_skip)
    with torch.device("meta"):
        model = GptOssForCausalLM(args, torch.bfloat16)
    assert set(model.spec.layers) == {AttentionSpec(8, 64, window=128, sinks=True),
                                      AttentionSpec(8, 64, sinks=True)}
    assert model.checkpoint_tensor("model.layers.3.mlp.experts.down_proj")[0] == (
        "model.layers.3.mlp.experts.down_proj_blocks",
        "model.layers.3.mlp.experts.down_proj_scales")
    for name in ("model.layers.3.mlp.experts.down_proj_bias", "model.layers.3.self_attn.sinks",
                 "model.layers.3.mlp.router.weight"):
        assert model.checkpoint_tensor(name) == ((name,), None)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert expected["model.layers.0.mlp.experts.gate_up_proj"] == (32, 2880, 5760)
    assert expected["model.layers.0.mlp.experts.down_proj"] == (32, 2880, 2880)


def test_yarn_changes_the_variant_s_frequencies():
    """The variant's YaRN (x8 from 32 positions) is not the default RoPE: most frequencies
    are interpolated (divided by 8) and cos/sin scale by 1 + 0.1 ln 8."""
    args = parse_config(raw_config())
    inv_freq, factor = rope_parameters(args.rope, args.head_dim)
    plain, _ = rope_parameters(parse_config(raw_config(rope_parameters=dict(
        rope_type="default", rope_theta=150000.0))).rope, args.head_dim)
    assert factor == pytest.approx(1.2079441541679836)
    assert inv_freq[0] == plain[0]
    torch.testing.assert_close(inv_freq[2:], plain[2:] / 8, atol=0, rtol=1e-6)


# -- attention with sinks ----------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("history", [0, 9])
def test_sink_attention_is_transformers_eager(window, history):
    """``paged.attention`` with sinks equals transformers' ``eager_attention_forward``
    (GQA, causal / sliding masks, queries after earlier keys, sinks large enough to take
    most of the mass)."""
    torch.manual_seed(window or 0)
    heads, kv, n, hd = 4, 2, 7, 16
    m = history + n
    q, k, v = torch.randn(1, heads, n, hd), torch.randn(1, kv, m, hd), torch.randn(1, kv, m, hd)
    sinks = torch.randn(heads) * 3
    q_pos, k_pos = torch.arange(history, m)[:, None], torch.arange(m)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    spec = AttentionSpec(kv, hd, window=window, sinks=True)
    mask = _CAUSAL if history == 0 and window is None else visible
    got = attention(q, k, v, mask, spec, sinks)
    module = SimpleNamespace(num_key_value_groups=heads // kv, sinks=sinks, training=False)
    additive = torch.zeros(n, m).masked_fill(~visible, torch.finfo(torch.float32).min)
    expected, _ = hf_gpt_oss.eager_attention_forward(module, q, k, v, additive[None, None],
                                                     scaling=hd ** -0.5)
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-6, rtol=0)


# -- experts -----------------------------------------------------------------------------

@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_routed_experts_are_transformers(implementation):
    """Router (top-2 of 4, softmax over the two logits), clamped SwiGLU with biases on
    interleaved gate/up columns: our MLP equals transformers' GptOssMLP on the same
    weights, with values large enough that both clamps bite."""
    config = hf_config(VARIANT)
    config._experts_implementation = implementation
    torch.manual_seed(3)
    hf = hf_gpt_oss.GptOssMLP(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 1.0)
    ours = GptOssMLP(parse_config(raw_config()))
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(33, config.hidden_size)
    gate_up = torch.einsum("td,edf->tef", x, hf.experts.gate_up_proj)
    assert (gate_up[..., 0::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()
    with torch.no_grad():
        expected, _ = hf(x[None])
        _, hf_scores, hf_experts = hf.router(x)
        experts, weights = ours.router(x)
        got = ours(x)
    assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_scores)
    assert len(set(experts.flatten().tolist())) == 4  # every expert gets tokens
    scale = expected.abs().max().item()  # outputs in the hundreds: fp32 rounding scales
    torch.testing.assert_close(got, expected[0], atol=1e-6 * scale, rtol=0)
    if implementation == "grouped_mm":  # transformers' default: the same computation
        assert torch.equal(got, expected[0])


def test_biases_sinks_and_clamps(tmp_path):
    """Every parameter drawn (attention and expert biases, router bias, sinks, large
    gate_up weights so the clamps bite): logits whole and in chunks, and a greedy run,
    are transformers'. Parameters load name for name."""
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(VARIANT)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif name.endswith("sinks"):
                p.normal_(0, 1.5)
            elif name.endswith("gate_up_proj"):
                p.mul_(4)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(
        n for n, _ in hf.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, hf.get_parameter(name)), name
    prompt = tokens(1, 45)
    assert_matches_transformers(tmp_path, hf, prompt)
    assert Served(tmp_path, TPB).one(prompt).tokens == hf_generate(hf, prompt)


def test_without_attention_bias(tmp_path):
    hf = save_checkpoint(VARIANT, tmp_path, changes={"attention_bias": False})
    ours = load_checkpoint(tmp_path)
    assert ours.model.layers[0].self_attn.q_proj.bias is None
    assert_matches_transformers(tmp_path, hf, tokens(2, 40))


def test_tied_embeddings(tmp_path):
    hf = save_checkpoint(VARIANT, tmp_path, changes={"tie_word_embeddings": True})
    ours = load_checkpoint(tmp_path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert_matches_transformers(tmp_path, hf, tokens(3, 40))


# -- MXFP4 -------------------------------------------------------------------------------

LUT = torch.tensor(FP4_VALUES)
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                          "model.embed_tokens", "lm_head"]  # the released checkpoints'


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [E, in, out]`` -> transformers' stored layout: blocks ``[E, out, in/32, 16]``
    (two E2M1 codes a byte, the even element in the low nibble) and E8M0 scales
    ``[E, out, in/32]``: each block of 32 inputs scaled so its largest magnitude is at most
    6, then each value rounded to the nearest FP4 value."""
    e, n_in, n_out = weight.shape
    rows = weight.transpose(1, 2).reshape(e, n_out, n_in // 32, 32)
    amax = rows.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    normalised = rows / torch.exp2(exponent)
    codes = (normalised[..., None] - LUT).abs().argmin(-1).to(torch.uint8)  # first: +0.0
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def save_mxfp4(source, directory, quantization_config: dict) -> dict[str, torch.Tensor]:
    """``source``'s checkpoint with its experts' projections MXFP4-packed (those of layers
    that ``modules_to_not_convert`` skips stay dense); returns what was stored."""
    directory.mkdir(exist_ok=True)
    skip = quantization_config.get("modules_to_not_convert") or []
    stored = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        module = name.rsplit(".", 1)[0]
        if (name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                and should_convert_module(module, skip)):
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = quantize_mxfp4(tensor)
        else:
            stored[name] = tensor
    save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    return stored


def test_quantizer_round_trips_within_fp4_precision():
    weight = torch.randn(2, 64, 48)
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (2, 48, 2, 16) and scales.shape == (2, 48, 2)
    dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert dense.shape == weight.shape
    # rounded to the nearest E2M1 value (gaps of at most 2, between 4 and 6) times the
    # block's scale 2^e, the smallest with 6 * 2^e >= the block's largest magnitude
    scale = torch.exp2(scales.float() - 127)[..., None].expand(-1, -1, -1, 32).reshape(2, 48, 64)
    assert ((dense - weight).abs() <= scale.transpose(1, 2)).all()
    assert (dense - weight).abs().mean() < 0.15


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_dequantize_as_transformers(checkpoint, tmp_path, dtype):
    """Blocks and scales we packed load as exactly the dense weights transformers'
    ``convert_moe_packed_tensors`` makes of them (in the load dtype); the rest loads as
    stored."""
    source, _ = checkpoint(VARIANT)
    stored = save_mxfp4(source, tmp_path / "mxfp4", {"quant_method": "mxfp4",
                                                     "modules_to_not_convert":
                                                         MODULES_TO_NOT_CONVERT})
    model = load_checkpoint(tmp_path / "mxfp4", dtype=dtype)
    assert model.args.mxfp4
    for i, layer in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            expected = convert_moe_packed_tensors(stored[f"{name}_blocks"],
                                                  stored[f"{name}_scales"], dtype=dtype)
            got = getattr(layer.mlp.experts, proj)
            assert got.dtype == dtype and torch.equal(got, expected), name
    for name, p in model.named_parameters():
        if name in stored:
            assert torch.equal(p, stored[name].to(dtype)), name


def test_mxfp4_dequantization_covers_every_code_and_scale():
    """All 256 byte values and the whole E8M0 range but 255 (NaN), against transformers."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(255).view(1, 255, 16, 16)
    scales = torch.arange(255, dtype=torch.uint8).view(1, 255, 1).repeat(1, 1, 16)
    got = dequantize_mxfp4(blocks, scales)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(got, expected)
    assert torch.equal(got.to(torch.bfloat16),
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))


def test_an_mxfp4_checkpoint_serves_as_transformers_loads_it(checkpoint, tmp_path):
    """The MXFP4 checkpoint end to end: transformers (dequantizing on the CPU, float32)
    and our engine give the same logits and greedy tokens; layer 1's experts are kept
    dense by ``modules_to_not_convert`` and load from their dense tensors."""
    source, _ = checkpoint(VARIANT)
    directory = tmp_path / "mxfp4"
    stored = save_mxfp4(source, directory, {
        "quant_method": "mxfp4",
        "modules_to_not_convert": MODULES_TO_NOT_CONVERT + ["model.layers.1.mlp.experts"]})
    assert "model.layers.1.mlp.experts.gate_up_proj" in stored
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in stored
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    ours = load_checkpoint(directory)
    for name, p in ours.named_parameters():
        assert torch.equal(p, hf.get_parameter(name)), name
    prompt = tokens(4, 40)
    assert_matches_transformers(directory, hf, prompt)
    assert Served(directory, TPB).one(prompt).tokens == hf_generate(hf, prompt)


@pytest.mark.parametrize("patterns", [
    [], MODULES_TO_NOT_CONVERT, ["model.layers.1"], ["model.layers.1.mlp"],
    ["model.layers.*.mlp.experts"], ["experts"], ["model.layers.1.mlp.exp"],
    ["model.layers.(1|3)"], ["model.layers.11"]])
def test_modules_to_not_convert_reads_as_transformers(patterns):
    for i in (1, 2, 11):
        module = f"model.layers.{i}.mlp.experts"
        assert mxfp4_converts(module, tuple(patterns)) == should_convert_module(module, patterns)


def test_another_quant_method_is_refused_naming_it(checkpoint, tmp_path):
    source, _ = checkpoint(VARIANT)
    save_mxfp4(source, tmp_path / "q", {"quant_method": "mxfp4"})
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method='gptq'"):
        load_checkpoint(tmp_path / "q")


def test_missing_mxfp4_tensors_are_named(checkpoint, tmp_path):
    """A config saying mxfp4 over a dense checkpoint: the blocks it needs are missing."""
    source, _ = checkpoint(VARIANT)
    directory = tmp_path / "dense"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"experts\.(gate_up|down)_proj_blocks is missing"):
        load_checkpoint(directory)


@pytest.mark.parametrize("blocks, scales, match", [
    (torch.zeros(2, 4, 2, 16, dtype=torch.int8), torch.zeros(2, 4, 2, dtype=torch.uint8),
     "uint8"),
    (torch.zeros(2, 4, 2, 16, dtype=torch.uint8), torch.zeros(2, 4, 3, dtype=torch.uint8),
     "do not match"),
])
def test_malformed_mxfp4_tensors_are_refused(blocks, scales, match):
    with pytest.raises(CheckpointError, match=match):
        dequantize_mxfp4(blocks, scales)


# -- refused fields ----------------------------------------------------------------------

REFUSED = {
    "quant_method": ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
    "quant_method-missing": ({"quantization_config": {"bits": 4}}, "quant_method=None"),
    "modules_to_not_convert": ({"quantization_config": {"quant_method": "mxfp4",
                                                        "modules_to_not_convert": "lm_head"}},
                               "modules_to_not_convert"),
    "rope_type": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
                  "rope_type 'dynamic'"),
    "rope_scaling": ({"rope_scaling": {"type": "longrope", "factor": 2.0}},
                     "rope_scaling: rope_type 'longrope'"),
    "factor": ({"rope_parameters": {"rope_type": "yarn",
                                    "original_max_position_embeddings": 32}}, "needs factor"),
    "truncate": ({"rope_parameters": dict(YARN, truncate="no")}, "truncate='no'"),
    "beta_fast": ({"rope_parameters": dict(YARN, beta_fast="x")}, "beta_fast='x'"),
    "per-layer rope": ({"rope_parameters": {"full_attention": YARN,
                                            "sliding_attention": YARN}}, "per-layer-type"),
    "partial_rotary_factor": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "layer_types": ({"layer_types": ["sliding_attention", "chunked_attention",
                                     "sliding_attention", "full_attention"]}, "layer_types"),
    "layer_types-count": ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    "sliding_window": ({"sliding_window": None}, "sliding_window"),
    "num_experts_per_tok": ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    "num_key_value_heads": ({"num_key_value_heads": 3}, "num_key_value_heads 3"),
    "head_dim": ({"head_dim": 15}, "head_dim 15"),
    "swiglu_limit": ({"swiglu_limit": -1.0}, "swiglu_limit"),
    "attention_bias": ({"attention_bias": "yes"}, "attention_bias"),
    "architectures": ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_fields_are_named(case):
    changes, match = REFUSED[case]
    with pytest.raises(CheckpointError, match=match):
        parse_config(raw_config(**changes), "config.json")


def test_hidden_act_is_ignored_as_transformers_ignores_it():
    """GptOss experts always run the clamped SwiGLU; ``hidden_act`` changes nothing."""
    assert parse_config(raw_config(hidden_act="gelu")) == parse_config(raw_config())
