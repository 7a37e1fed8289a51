"""Nemotron-H specifics (``replicas/models/nemotron_h.py``) against transformers.

Beyond ``test_families.py``: the pools and pages its layers give; Mamba-2 states after
prefill and decode equal transformers' cache; prefill one token at a time, in chunks or
whole agrees, in steps mixing sequences too; the dt clamp at ``time_step_min`` (where
transformers' decode step departs from its own forward); MoE routing with a score
correction, its router in float32; how the config's fields are read, and each one refused.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from replicas.checkpoint import load_checkpoint
from replicas.engines.base import StepItem
from replicas.models import ARCHITECTURES, AttentionSpec, CheckpointError, RecurrentSpec, StateSpec
from replicas.models.nemotron_h import ACTIVATIONS, NemotronHForCausalLM
from tests.replicas.models.checkpoints import VOCAB, hf_config, save_checkpoint
from tests.replicas.models.serving import Served, hf_logits

TPB = 8
ATOL = 1e-4
# nemotron-h: hidden 64, 4 Mamba heads of 16 channels, state 16, 2 groups, kernel 4
CONV_DIM = 4 * 16 + 2 * 2 * 16  # x, B, C channels
MAMBA = RecurrentSpec((StateSpec("conv", (CONV_DIM, 3)), StateSpec("ssm", (4, 16, 16))))
ATTENTION = AttentionSpec(2, 24)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def prefill(served: Served, prompt: list[int], chunks: list[int]):
    """Run ``prompt`` in ``chunks``; the cache and each chunk's last logits."""
    cache = served.manager.create_kv_cache(prompt[:-1])
    assert cache.resize(len(prompt) + 32)
    pos, out = 0, []
    for size in chunks:
        out.append(served.engine.forward_logits(
            [StepItem("s", cache, prompt[pos:pos + size], pos, None)])[0])
        cache.commit(prompt[pos:pos + size])
        pos += size
    assert pos == len(prompt)
    return cache, out


def live_states(served: Served, cache, layer: int) -> dict[str, torch.Tensor]:
    """The live conv and ssm states of ``layer`` as the engine's pages hold them."""
    engine = served.engine
    pool, slot = engine.slots[layer]
    row = engine.storage[pool][cache.live_state_page(pool), slot].cpu()
    states, offset = {}, 0
    for state in engine.pool_specs[pool].states:
        states[state.name] = row[offset:offset + state.numel].view(state.shape)
        offset += state.numel
    return states


# -- pools, pages and layer kinds --------------------------------------------------------

@pytest.mark.parametrize("variant, layers", [
    ("nemotron-h", [MAMBA, ATTENTION, MAMBA, None]),  # M*M-
    ("nemotron-h-moe", [MAMBA, None, ATTENTION, MAMBA]),  # ME*M
])
def test_layers_pools_and_pages_follow_the_pattern(checkpoint, variant, layers):
    """Mamba layers in one recurrent pool (a float32 row of conv then ssm state), attention
    in the full pool with its own head_dim 24, MLP and MoE layers in none."""
    directory, hf = checkpoint(variant)
    served = Served(directory, TPB, pages=16)
    engine = served.engine
    assert list(engine.spec.layers) == layers
    assert engine.kinds == ("full", "recurrent")
    mamba = tuple(i for i, spec in enumerate(layers) if spec == MAMBA)
    assert engine.pool_layers == ((layers.index(ATTENTION),), mamba)
    assert [layout.shape for layout in engine.page_layouts()] == [
        (1, 2, TPB, 2, 24), (2, CONV_DIM * 3 + 4 * 16 * 16)]
    assert [layout.dtype for layout in engine.page_layouts()] == ["float32", "float32"]
    assert engine.max_model_len == 256
    # the router's score correction is a buffer in transformers, a parameter here
    buffers = 8 if variant == "nemotron-h-moe" else 0
    assert engine.describe()["parameters"] == hf.num_parameters() + buffers


class RecordingContext:
    """One sequence from scratch, densely; records which layers touch the context."""

    def __init__(self, model: NemotronHForCausalLM, n: int) -> None:
        self.model, self.bounds, self.calls = model, [(0, n)], []

    def attend(self, layer, q, k, v, sinks=None):
        self.calls.append(("attend", layer))
        groups = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(groups, 1).transpose(0, 1),
            v.repeat_interleave(groups, 1).transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)

    def read_states(self, layer):
        self.calls.append(("read", layer))
        return {s.name: torch.zeros(1, *s.shape) for s in self.model.spec.layers[layer].states}

    def write_states(self, layer, states):
        self.calls.append(("write", layer))


@pytest.mark.parametrize("variant", ["nemotron-h", "nemotron-h-moe"])
def test_mlp_and_moe_layers_keep_no_cache_and_positions_are_unused(checkpoint, variant):
    """Only Mamba layers read and write states, only attention attends; the MLP and MoE
    layers never reach the context. With no RoPE the positions change nothing."""
    directory, hf = checkpoint(variant)
    model = load_checkpoint(directory)
    prompt = tokens(3, 20)
    ids = torch.tensor(prompt)
    ctx = RecordingContext(model, len(prompt))
    with torch.inference_mode():
        logits = model.logits(model(ids, torch.arange(20), ctx))
        shifted = model.logits(model(ids, torch.arange(20) + 100,
                                     RecordingContext(model, len(prompt))))
    kinds = model.args.layer_types
    assert ctx.calls == [call for i, kind in enumerate(kinds) for call in
                         ([("read", i), ("write", i)] if kind == "linear_attention" else
                          [("attend", i)] if kind == "full_attention" else [])]
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    assert torch.equal(logits, shifted)


# -- Mamba-2 states and chunking ---------------------------------------------------------

@pytest.mark.parametrize("variant", ["nemotron-h", "nemotron-h-moe"])
def test_states_after_prefill_and_decode_equal_transformers_cache(checkpoint, variant):
    """A 37-token prompt in chunks of 5, 11, 9, 12 (scan chunks of 16 cut inside them),
    then 8 decode steps of transformers' greedy tokens: after each, every Mamba layer's
    conv state is transformers' last kernel - 1 conv inputs and its ssm state transformers'
    recurrent state, and the logits agree."""
    directory, hf = checkpoint(variant)
    prompt = tokens(4, 37)
    served = Served(directory, TPB)
    cache, _ = prefill(served, prompt, [5, 11, 9, 12])
    mamba = [i for i, kind in enumerate(hf.config.layers_block_type)
             if kind == "linear_attention"]
    with torch.inference_mode():
        out = hf(torch.tensor([prompt]), use_cache=True)
    hf_cache, pos = out.cache, len(prompt)
    for step in range(9):
        for layer in mamba:
            ours = live_states(served, cache, layer)
            torch.testing.assert_close(ours["conv"], hf_cache.get_conv_state(layer)[0, :, 1:],
                                       atol=ATOL, rtol=0)
            torch.testing.assert_close(ours["ssm"], hf_cache.get_recurrent_state(layer)[0],
                                       atol=ATOL, rtol=0)
        if step == 8:
            break
        token = int(out.logits[0, -1].argmax())
        got = served.engine.forward_logits([StepItem("s", cache, [token], pos, None)])[0]
        cache.commit([token])
        pos += 1
        with torch.inference_mode():
            out = hf(torch.tensor([[token]]), cache=hf_cache, use_cache=True)
        torch.testing.assert_close(got, out.logits[0, -1], atol=ATOL, rtol=0)
    cache.close()


@pytest.mark.parametrize("variant", ["nemotron-h", "nemotron-h-moe"])
def test_one_token_at_a_time_chunked_and_whole_prefill_agree(checkpoint, variant):
    """45 tokens one per step (the one-step recurrence), in chunks of 5, 11, 9, 15, 5 (the
    chunked scan from a carried state) and whole: each position's logits agree with each
    other and with transformers' forward; the final states agree."""
    directory, hf = checkpoint(variant)
    prompt = tokens(5, 45)
    expected = hf_logits(hf, prompt)
    runs = {}
    for name, chunks in {"single": [1] * 45, "chunked": [5, 11, 9, 15, 5],
                         "whole": [45]}.items():
        served = Served(directory, TPB)
        cache, logits = prefill(served, prompt, chunks)
        ends = [sum(chunks[:i + 1]) - 1 for i in range(len(chunks))]
        torch.testing.assert_close(torch.stack(logits), expected[ends], atol=ATOL, rtol=0)
        runs[name] = ({end: row for end, row in zip(ends, logits)},
                      {layer: live_states(served, cache, layer)
                       for layer, spec in enumerate(served.engine.spec.layers)
                       if spec == MAMBA})
    for name in ("chunked", "whole"):
        for end, row in runs[name][0].items():
            torch.testing.assert_close(row, runs["single"][0][end], atol=ATOL, rtol=0)
        torch.testing.assert_close(runs[name][1], runs["single"][1], atol=ATOL, rtol=0)


def test_a_step_mixing_prefill_chunks_and_decodes_matches_each_sequence_alone(checkpoint):
    """One step with two prefill chunks (from a carried state and from scratch) and two
    decodes (stepped together): each item's logits and states are those of running it
    alone."""
    directory, _ = checkpoint("nemotron-h")
    done = [(12, 8), (17, 1), (25, 1), (0, 9)]  # (tokens before the step, in the step)
    prompts = [tokens(10 + i, before + n) for i, (before, n) in enumerate(done)]

    def run(indices):
        served = Served(directory, TPB)
        caches = []
        for i in indices:
            before, cache = done[i][0], served.manager.create_kv_cache([])
            assert cache.resize(32)
            if before:
                served.engine.forward_logits([StepItem("s", cache, prompts[i][:before], 0,
                                                       None)])
                cache.commit(prompts[i][:before])
            caches.append(cache)
        items = [StepItem(f"s{i}", cache, prompts[i][done[i][0]:sum(done[i])], done[i][0],
                          None) for i, cache in zip(indices, caches)]
        logits = served.engine.forward_logits(items)
        return logits, [live_states(served, cache, 2) for cache in caches]

    together, together_states = run([0, 1, 2, 3])
    for i in range(4):
        alone, alone_states = run([i])
        torch.testing.assert_close(together[i], alone[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(together_states[i], alone_states[0], atol=ATOL, rtol=0)


def test_dt_is_clamped_at_time_step_min_in_every_step(tmp_path):
    """With transformers' default time_step_min (1e-3; dt_bias drawn down to softplus^-1 of
    it), softplus(dt + dt_bias) falls below the clamp for some tokens. transformers' forward
    (its chunked scan) clamps; its one-token decode step does not, so its own token-by-token
    logits leave its forward by more than 1e-4. Here every step clamps: one token at a time,
    chunked or whole, the logits are transformers' forward."""
    hf = save_checkpoint("nemotron-h", tmp_path, changes={"time_step_min": 1e-3,
                                                          "time_step_floor": 1e-4})
    prompt = tokens(1, 40)
    expected = hf_logits(hf, prompt)
    with torch.inference_mode():
        out = hf(torch.tensor([prompt[:1]]), use_cache=True)
        stepwise = [out.logits[0, -1]]
        for token in prompt[1:]:
            out = hf(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            stepwise.append(out.logits[0, -1])
    assert (torch.stack(stepwise) - expected).abs().max() > 10 * ATOL  # transformers' own gap
    for chunks in ([1] * 40, [5, 11, 9, 15], [40]):
        _, logits = prefill(Served(tmp_path, TPB), prompt, chunks)
        ends = [sum(chunks[:i + 1]) - 1 for i in range(len(chunks))]
        torch.testing.assert_close(torch.stack(logits), expected[ends], atol=ATOL, rtol=0)


# -- MoE ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corrected_moe(tmp_path_factory):
    """nemotron-h-moe with a random score correction (transformers initialises it to 0),
    large enough to change which experts win."""
    directory = tmp_path_factory.mktemp("nemotron-h-moe-corrected")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config("nemotron-h-moe")).eval()
    with torch.no_grad():
        hf.model.layers[1].mixer.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    hf.save_pretrained(directory, safe_serialization=True)
    return directory, hf


def test_moe_routing_equals_transformers_router(corrected_moe):
    """The same experts (as sets) with the same weights per token, and the same logits."""
    directory, hf = corrected_moe
    ours = load_checkpoint(directory)
    torch.manual_seed(1)
    x = torch.randn(50, 64)
    with torch.inference_mode():
        _, hf_weights, hf_experts = hf.model.layers[1].mixer.gate(x)
        experts, weights = ours.backbone.layers[1].mixer.gate(x)
    hf_order, order = hf_experts.argsort(-1), experts.argsort(-1)
    assert torch.equal(experts.gather(1, order), hf_experts.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order),
                               atol=1e-6, rtol=0)
    gate = hf.model.layers[1].mixer.gate
    saved = gate.e_score_correction_bias.clone()
    with torch.no_grad():  # without the correction other experts would win
        gate.e_score_correction_bias.zero_()
        plain = gate(x)[2]
        gate.e_score_correction_bias.copy_(saved)
    assert not torch.equal(plain.sort(-1)[0], hf_experts.sort(-1)[0])
    prompt = tokens(6, 30)
    _, logits = prefill(Served(directory, TPB), prompt, [30])
    torch.testing.assert_close(logits[0], hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)


def test_experts_are_stacked_at_load_and_the_block_is_transformers(corrected_moe):
    """The per-expert tensors save_pretrained writes are all read, stacked into
    transformers' in-memory experts (up_proj [E, I, W], down_proj [E, W, I]); the MoE block
    (router, latent projections, grouped experts, shared expert) gives transformers' bits."""
    directory, hf = corrected_moe
    ours = load_checkpoint(directory)
    stored = load_file(directory / "model.safetensors")
    read = [s for name, _ in ours.named_parameters() for s in ours.checkpoint_tensor(name)[0]]
    assert sorted(read) == sorted(stored)
    experts, theirs = ours.backbone.layers[1].mixer.experts, hf.model.layers[1].mixer.experts
    assert experts.up_proj.shape == (8, 32, 32) and experts.down_proj.shape == (8, 32, 32)
    assert torch.equal(experts.up_proj, theirs.up_proj)
    assert torch.equal(experts.down_proj, theirs.down_proj)
    assert torch.equal(experts.up_proj[5],
                       stored["backbone.layers.1.mixer.experts.5.up_proj.weight"])
    torch.manual_seed(2)
    x = torch.randn(40, 64)
    with torch.inference_mode():
        assert torch.equal(ours.backbone.layers[1].mixer(x), hf.model.layers[1].mixer(x[None])[0])


def test_the_router_loads_in_float32_in_a_bfloat16_model(corrected_moe):
    """transformers keeps gate.weight and e_score_correction_bias in float32
    (_keep_in_fp32_modules_strict): so does the loader (FLOAT32_PARAMETERS)."""
    directory, hf = corrected_moe
    model = load_checkpoint(directory, dtype="bfloat16")
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    router = {name for name in dtypes if ".mixer.gate." in name}
    assert router == {"backbone.layers.1.mixer.gate.weight",
                      "backbone.layers.1.mixer.gate.e_score_correction_bias"}
    assert {dtypes[name] for name in router} == {torch.float32}
    assert {dtype for name, dtype in dtypes.items() if name not in router} == {torch.bfloat16}
    assert torch.equal(model.backbone.layers[1].mixer.gate.e_score_correction_bias,
                       hf.model.layers[1].mixer.gate.e_score_correction_bias)


# -- config.json -------------------------------------------------------------------------

def raw_config(variant: str = "nemotron-h", **changes) -> dict:
    """config.json as transformers writes it (``Infinity`` as ``{"__float__": ...}``)."""
    config = hf_config(variant)
    raw = json.loads(config.to_json_string(use_diff=False))
    raw["architectures"] = ["NemotronHForCausalLM"]
    raw.update(changes)
    return raw


def parse(raw: dict):
    return ARCHITECTURES["NemotronHForCausalLM"].parse_config(raw, "config.json")


def test_layer_types_from_pattern_list_legacy_names_or_default():
    base = {k: v for k, v in raw_config().items() if k != "layers_block_type"}
    m, a, mlp, moe = "linear_attention", "full_attention", "mlp", "moe"
    assert parse({**base, "hybrid_override_pattern": "M-*E"}).layer_types == (m, mlp, a, moe)
    assert parse({**base, "layers_block_type": ["mamba", "attention", "mlp"],
                  "hybrid_override_pattern": "MM"}).layer_types == (m, a, mlp)  # list wins
    assert parse({**base, "layer_types": ["full_attention", "moe"]}).layer_types == (a, moe)
    assert parse(base).layer_types == (m, moe, a, mlp)  # transformers' default
    assert parse({**base, "hybrid_override_pattern": "M*", "num_hidden_layers": 7}
                 ).num_hidden_layers == 2  # num_hidden_layers is ignored, as transformers does


def test_fields_defaults_and_aliases_as_transformers_reads_them():
    raw = raw_config(mamba_chunk_size=64, mamba_d_conv=3, mamba_n_groups=4,
                     mamba_dt_min=0.01, time_step_limit=[0.0, math.inf])
    args = parse(raw)
    assert (args.chunk_size, args.conv_kernel, args.n_groups, args.time_step_min) == (
        64, 3, 4, 0.01)
    config = transformers.NemotronHConfig.from_dict(raw)
    assert (config.chunk_size, config.conv_kernel, config.n_groups, config.time_step_min) == (
        64, 3, 4, 0.01)
    without = {k: v for k, v in raw_config().items() if k not in ("head_dim",
                                                                  "num_key_value_heads")}
    args = parse(without)
    assert (args.head_dim, args.num_key_value_heads) == (128, 4)  # not hidden / heads
    assert raw_config()["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    assert parse(raw_config()).tie_word_embeddings is False
    assert parse(raw_config(time_step_min=0)).time_step_min == 0.0  # no clamp at all


def test_tie_word_embeddings_ties_nothing_as_in_transformers(tmp_path):
    """transformers' NemotronH keeps lm_head apart even with tie_word_embeddings (and saves
    it): the stored lm_head is used."""
    hf = save_checkpoint("nemotron-h", tmp_path, changes={"tie_word_embeddings": True})
    assert not torch.equal(hf.lm_head.weight, hf.model.embeddings.weight)
    model = load_checkpoint(tmp_path)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    prompt = tokens(7, 20)
    _, logits = prefill(Served(tmp_path, TPB), prompt, [20])
    torch.testing.assert_close(logits[0], hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)


def test_multi_token_prediction_tensors_are_ignored_others_refused(tmp_path):
    save_checkpoint("nemotron-h", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    save_file({**tensors, "mtp.layers.0.norm.weight": torch.ones(64)}, path)
    load_checkpoint(tmp_path)
    save_file({**tensors, "backbone.layers.0.mixer.extra": torch.ones(64)}, path)
    with pytest.raises(CheckpointError, match="backbone.layers.0.mixer.extra"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_are_transformers(name):
    x = torch.linspace(-4, 4, 101)
    torch.testing.assert_close(ACTIVATIONS[name](x), transformers.activations.ACT2FN[name](x),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("field, value, variant", [
    ("quantization_config", {"quant_method": "fp8"}, "nemotron-h"),
    ("attention_bias", True, "nemotron-h"),
    ("mamba_proj_bias", True, "nemotron-h"),
    ("residual_in_fp32", True, "nemotron-h"),
    ("sliding_window", 12, "nemotron-h"),
    ("time_step_limit", [0.0, 0.1], "nemotron-h"),
    ("mlp_hidden_act", "tanh", "nemotron-h"),
    ("mamba_hidden_act", "relu6", "nemotron-h"),
    ("conv_kernel", 1, "nemotron-h"),
    ("n_groups", 3, "nemotron-h"),
    ("num_key_value_heads", 3, "nemotron-h"),
    ("hybrid_override_pattern", "M*X", "nemotron-h"),
    ("layers_block_type", ["linear_attention", "cross_attention"], "nemotron-h"),
    ("layers_block_type", ["mlp", "moe"], "nemotron-h"),
    ("n_shared_experts", 2, "nemotron-h-moe"),
    ("n_group", 3, "nemotron-h-moe"),
    ("n_group", 8, "nemotron-h-moe"),  # groups of one expert
    ("topk_group", 3, "nemotron-h-moe"),
    ("num_experts_per_tok", 5, "nemotron-h-moe"),  # more than topk_group=1 group of 4
    ("chunk_size", 0, "nemotron-h"),
    ("time_step_min", -0.1, "nemotron-h"),
])
def test_refused_fields_are_named(field, value, variant):
    raw = raw_config(variant, **{field: value})
    if field == "hybrid_override_pattern":
        del raw["layers_block_type"]
    with pytest.raises(CheckpointError, match=field):
        parse(raw)


def test_fields_ignored_only_where_the_moe_is_absent():
    """MoE fields are checked when a layer is moe; otherwise they describe nothing."""
    parse(raw_config("nemotron-h", n_shared_experts=2, n_group=3))


def test_a_refused_field_stops_the_load(tmp_path):
    save_checkpoint("nemotron-h", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "attention_bias": True}))
    with pytest.raises(CheckpointError, match="attention_bias"):
        load_checkpoint(tmp_path)
