"""Gemma 3 (``Gemma3ForCausalLM``, ``gemma3_text``) specifics, against transformers: the
pools its local/global layers give, the config forms it reads (``layer_types`` or
``sliding_window_pattern``; per-layer-type ``rope_parameters`` or the older ``rope_theta`` +
``rope_local_base_freq`` + ``rope_scaling``) exactly as ``Gemma3TextConfig`` reads them, the
(1 + w) norms and the scaled embedding bit for bit in bfloat16, a checkpoint in the older
config form with biases, untied head and trained-looking norms, and every refused field.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import transformers
from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3

from kvcache import FullAttention, KVCacheManager, SlidingWindow
from replicas.checkpoint import load_checkpoint
from replicas.engines.base import StepItem
from replicas.engines.torch_engine import TorchEngine
from replicas.models import ARCHITECTURES, AttentionSpec, CheckpointError
from replicas.models.gemma3 import (Gemma3ForCausalLM, Gemma3RMSNorm, Gemma3RotaryEmbedding,
                                    Gemma3ScaledEmbedding)
from tests.replicas.models.checkpoints import VOCAB, WINDOW, hf_config

TPB = 8
ATOL = 1e-4
# bench/gpu_check.sh runs these on CUDA (our engine there; transformers stays the CPU oracle).
DEVICE = os.environ.get("REPLICAS_TEST_DEVICE", "cpu")
BASE = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=VOCAB,
            hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_hidden_layers=6,
            max_position_embeddings=256)


def parse(**changes):
    return Gemma3ForCausalLM.parse_config({**BASE, **changes}, "config.json")


def hf_text_config(**changes) -> transformers.Gemma3TextConfig:
    """transformers' reading of the same config.json."""
    return transformers.Gemma3TextConfig.from_dict({**BASE, **changes})


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_registered():
    assert ARCHITECTURES["Gemma3ForCausalLM"] is Gemma3ForCausalLM


# -- pools ---------------------------------------------------------------------------------

def test_local_and_global_layers_give_a_full_and_a_sliding_pool(checkpoint):
    """The variant's layers sliding, sliding, full, sliding: one full pool of 1 layer and a
    sliding pool of 3, every layer scaled by query_pre_attn_scalar ** -0.5 (24, head_dim
    16), tied embeddings (no lm_head stored)."""
    directory, hf = checkpoint("gemma3")
    engine = TorchEngine.from_checkpoint(directory, device=DEVICE)
    scale = 24 ** -0.5
    sliding = AttentionSpec(2, 16, window=WINDOW, scale=scale)
    assert engine.model.spec.layers == (sliding, sliding, AttentionSpec(2, 16, scale=scale),
                                        sliding)
    assert engine.cache_config(16, TPB, True).life_cycles == (FullAttention(),
                                                              SlidingWindow(window=WINDOW))
    assert [layout.shape for layout in engine.page_layouts()] == [(1, 2, TPB, 2, 16),
                                                                 (3, 2, TPB, 2, 16)]
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert engine.describe()["parameters"] == hf.num_parameters()


def test_a_config_without_sliding_layers_has_no_window():
    args = parse(layer_types=["full_attention"] * 6, sliding_window=None)
    assert args.sliding_window is None
    assert {spec.window for spec in Gemma3ForCausalLM(args).spec.layers} == {None}


# -- config forms, as transformers reads them ------------------------------------------------

@pytest.mark.parametrize("changes", [
    {},                                              # sliding_window_pattern 6 by default
    {"num_hidden_layers": 7, "sliding_window_pattern": 3},
    {"sliding_window_pattern": 2},
    {"sliding_window_pattern": 1},                   # every layer full
    {"num_hidden_layers": 4, "sliding_window_pattern": 6},  # no full layer at all
    {"num_hidden_layers": 3, "_sliding_window_pattern": 2},  # not read (transformers: 6)
    {"num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention",
                                             "sliding_attention"]},
], ids=repr)
def test_layer_kinds_are_transformers_layer_types(changes):
    kinds = {"full_attention": "full", "sliding_attention": "sliding"}
    assert parse(**changes).layer_types == tuple(
        kinds[t] for t in hf_text_config(**changes).layer_types)


ROPE_FORMS = {
    "defaults": {},
    "older, linear scaling on the global layers (Gemma 3 4B..27B)": dict(
        rope_theta=500000.0, rope_local_base_freq=20000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "older, no scaling (Gemma 3 1B)": dict(rope_theta=500000.0, rope_local_base_freq=20000.0,
                                          rope_scaling=None),
    "per layer type, llama3 on the global layers": dict(rope_parameters={
        "full_attention": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 32},
        "sliding_attention": {"rope_type": "default", "rope_theta": 30000.0}}),
    "per layer type, one given, thetas from the older fields": dict(
        rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
        rope_theta=200000.0, rope_local_base_freq=5000.0),
    "per layer type, updated by rope_scaling": dict(
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 400000.0}},
        rope_scaling={"rope_type": "linear", "factor": 4.0}),
}


@pytest.mark.parametrize("form", list(ROPE_FORMS))
def test_each_layer_kind_gets_transformers_rope_frequencies(form):
    """Bit for bit the inverse frequencies of transformers' Gemma3RotaryEmbedding, per
    layer type; the two kinds differ."""
    changes = ROPE_FORMS[form]
    ours = Gemma3RotaryEmbedding(parse(**changes))
    theirs = hf_gemma3.Gemma3RotaryEmbedding(hf_text_config(**changes))
    assert ours.kinds == ("full", "sliding")
    for kind in ours.kinds:
        assert torch.equal(getattr(ours, f"{kind}_inv_freq"),
                           getattr(theirs, f"{kind}_attention_inv_freq")), kind
    assert not torch.equal(ours.full_inv_freq, ours.sliding_inv_freq)


def test_defaults_are_gemma3_text_configs():
    """A config.json naming only the architecture reads as Gemma3TextConfig's defaults
    (head_dim 256, not hidden_size / heads; tied embeddings; window 4096)."""
    args = Gemma3ForCausalLM.parse_config({"architectures": ["Gemma3ForCausalLM"]}, "c")
    hf = transformers.Gemma3TextConfig.from_dict({})
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                 "max_position_embeddings", "sliding_window", "query_pre_attn_scalar",
                 "hidden_activation", "attention_bias", "final_logit_softcapping",
                 "tie_word_embeddings"):
        assert getattr(args, name) == getattr(hf, name), name
    assert args.layer_types == tuple("full" if t == "full_attention" else "sliding"
                                     for t in hf.layer_types)
    assert (args.rope_full.theta, args.rope_sliding.theta) == (1e6, 1e4)
    assert args.rope_full.rope_type == args.rope_sliding.rope_type == "default"


# -- numerics -------------------------------------------------------------------------------

def test_norm_and_embedding_match_transformers_bit_for_bit_in_bfloat16():
    """(1 + w) in float32, cast after; the embedding scale rounded to bfloat16 (hidden 48:
    sqrt 6.928 -> 6.9375)."""
    torch.manual_seed(0)
    theirs = hf_gemma3.Gemma3RMSNorm(48, eps=1e-6)
    ours = Gemma3RMSNorm(48, 1e-6)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        ours.weight.copy_(theirs.weight)
    x = torch.randn(5, 3, 48).to(torch.bfloat16)
    assert torch.equal(ours.to(torch.bfloat16)(x), theirs.to(torch.bfloat16)(x))
    hf_embed = hf_gemma3.Gemma3TextScaledWordEmbedding(VOCAB, 48, None, embed_scale=48 ** 0.5)
    embed = Gemma3ScaledEmbedding(VOCAB, 48)
    with torch.no_grad():
        hf_embed.weight.normal_()
        embed.weight.copy_(hf_embed.weight)
    ids = torch.tensor(tokens(0, 20))
    got = embed.to(torch.bfloat16)(ids)
    assert torch.equal(got, hf_embed.to(torch.bfloat16)(ids))
    assert not torch.equal(got, embed.weight[ids] * 48 ** 0.5)  # the rounding matters


@pytest.fixture(scope="module")
def older_checkpoint(tmp_path_factory):
    """Six layers, the real 5 local : 1 global ratio by the default sliding_window_pattern,
    config.json in the older form (rope_theta, rope_local_base_freq, rope_scaling), q/k/v/o
    biases, an untied lm_head, exact GELU, random norm weights (so 1 + w matters), no
    softcapping. transformers loads it from the same directory."""
    directory = tmp_path_factory.mktemp("gemma3-older")
    torch.manual_seed(1)
    config = hf_config("gemma3", num_hidden_layers=6, layer_types=None, attention_bias=True,
                       tie_word_embeddings=False, hidden_activation="gelu",
                       final_logit_softcapping=None)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_(0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    for name in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        del raw[name]
    raw.update(rope_theta=500000.0, rope_local_base_freq=20000.0,
               rope_scaling={"rope_type": "linear", "factor": 4.0})
    path.write_text(json.dumps(raw))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    return directory, hf


def test_an_older_config_with_biases_and_an_untied_head_computes_transformers_logits(
        older_checkpoint):
    directory, hf = older_checkpoint
    engine = TorchEngine.from_checkpoint(directory, device=DEVICE)
    config = engine.cache_config(64, TPB, True)
    assert [layout.shape for layout in engine.page_layouts()] == [(1, 2, TPB, 2, 16),
                                                                 (5, 2, TPB, 2, 16)]
    assert engine.model.lm_head.weight is not engine.model.model.embed_tokens.weight
    manager = KVCacheManager(config, engine.page_layouts())
    engine.bind(manager)
    prompt = tokens(3, 40)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    cache = manager.create_kv_cache(prompt[:-1])
    assert cache.resize(len(prompt))
    pos = 0
    for size in (5, 11, 9, 15):
        got = engine.forward_logits([StepItem("s", cache, prompt[pos:pos + size], pos,
                                              None)])[0]
        cache.commit(prompt[pos:pos + size])
        pos += size
        torch.testing.assert_close(got, expected[pos - 1], atol=ATOL, rtol=0)
    cache.close()


# -- refused fields -------------------------------------------------------------------------

REFUSED = [
    ("attn_logit_softcapping", dict(attn_logit_softcapping=50.0)),
    ("use_bidirectional_attention", dict(use_bidirectional_attention=True)),
    ("quantization_config", dict(quantization_config={"quant_method": "fp8"})),
    ("hidden_activation", dict(hidden_activation="silu")),
    ("sliding_window", dict(sliding_window=None)),
    ("text_config", dict(text_config={"model_type": "gemma3_text"})),
    ("layer_types", dict(layer_types=["full_attention"] * 5)),
    ("layer_types", dict(layer_types=["chunked_attention"] * 6)),
    ("sliding_window_pattern", dict(sliding_window_pattern=0)),
    ("query_pre_attn_scalar", dict(query_pre_attn_scalar=0)),
    ("final_logit_softcapping", dict(final_logit_softcapping=-30.0)),
    ("num_key_value_heads", dict(num_key_value_heads=3)),
    ("head_dim", dict(head_dim=15)),
    # a flat (not per-layer-type) mapping: transformers silently ignores its keys
    ("rope_parameters", dict(rope_parameters={"rope_type": "linear", "factor": 8.0})),
    ("rope_type", dict(rope_parameters={"full_attention": {"rope_type": "yarn",
                                                           "factor": 8.0}})),
    ("partial_rotary_factor", dict(partial_rotary_factor=0.5)),
    # transformers 5 keeps the default rope_type under it (unscaled), transformers 4 scaled
    ("rope_scaling", dict(rope_scaling={"type": "linear", "factor": 8.0})),
    # transformers raises a KeyError here
    ("rope_scaling", dict(rope_parameters={"sliding_attention": {"rope_type": "default"}},
                          rope_scaling={"rope_type": "linear", "factor": 8.0})),
]


@pytest.mark.parametrize("field,changes", REFUSED, ids=[f for f, _ in REFUSED])
def test_refused_fields_are_named(field, changes):
    with pytest.raises(CheckpointError, match=field):
        parse(**changes)


def test_a_refused_field_stops_loading_the_checkpoint(checkpoint, tmp_path):
    directory, _ = checkpoint("gemma3")
    for path in directory.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "attn_logit_softcapping": 50.0}))
    with pytest.raises(CheckpointError, match="attn_logit_softcapping"):
        load_checkpoint(tmp_path)
