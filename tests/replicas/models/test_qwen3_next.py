"""Qwen3-Next specifics, against transformers (fp32, CPU): the pools and page layouts its
config gives, how config.json is read (and what is refused), the projections' layout, the
norms, partial RoPE, MoE routing, the Gated DeltaNet states carried in the pages (equal to
transformers' cache after each step), and the chunked and token-by-token paths.

Served end to end (cold, reused, resumed, forked, batched, preempted, chunked) by
test_families.py's ``qwen3-next`` variant."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_next import modeling_qwen3_next as hf_q3n

from kvcache import FullAttention, KVCacheManager, Recurrent
from replicas.checkpoint import load_checkpoint
from replicas.engines.base import StepItem
from replicas.engines.torch_engine import TorchEngine
from replicas.models import CheckpointError, RecurrentSpec, StateSpec
from replicas.models.qwen3_next import (
    GatedRMSNorm,
    Qwen3NextForCausalLM,
    RMSNorm,
    SparseMoeBlock,
    apply_partial_rotary,
    chunk_gated_delta_rule,
    recurrent_gated_delta_step,
)
from tests.replicas.models.checkpoints import VOCAB, hf_config, save_checkpoint
from tests.replicas.models.serving import Served, hf_generate, hf_logits

TPB = 8
ATOL = 1e-4
VARIANT = "qwen3-next"
# The tiny variant: 2 key heads and 4 value heads of 16 dims, kernel 4.
CONV_DIM = 2 * 2 * 16 + 4 * 16  # q, k, v channels of the short convolution
CONV = (CONV_DIM, 3)
RECURRENT = (4, 16, 16)
# Another checkpoint of the family: layer_types derived from full_attention_interval 2,
# attention biases, RoPE on a quarter of each head, top-3 routing without renormalising,
# MoE every other layer (decoder_sparse_step), tied embeddings, and an MTP tensor.
OTHER = {"layer_types": None, "full_attention_interval": 2, "attention_bias": True,
         "partial_rotary_factor": 0.25, "num_experts_per_tok": 3, "norm_topk_prob": False,
         "decoder_sparse_step": 2, "mlp_only_layers": [], "tie_word_embeddings": True}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """The OTHER checkpoint, with an ``mtp.*`` tensor added as real checkpoints have."""
    directory = tmp_path_factory.mktemp("qwen3-next-other")
    hf = save_checkpoint(VARIANT, directory, seed=3, changes=OTHER)
    tensors = load_file(directory / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory, hf


def engine_for(directory, pages: int = 64, dtype=None) -> tuple[TorchEngine, KVCacheManager]:
    engine = TorchEngine(load_checkpoint(directory, dtype))
    manager = KVCacheManager(engine.cache_config(pages, TPB, True), engine.page_layouts())
    engine.bind(manager)
    return engine, manager


def raw_config(**changes) -> dict:
    """The tiny variant's config.json as transformers saves it, with ``changes``."""
    return {**hf_config(VARIANT).to_dict(), "architectures": ["Qwen3NextForCausalLM"],
            **changes}


# -- pools, pages, layers ----------------------------------------------------------------

def test_pools_and_pages_follow_the_config(checkpoint):
    directory, hf = checkpoint(VARIANT)
    engine = TorchEngine.from_checkpoint(directory, device="cpu")
    state = RecurrentSpec((StateSpec("conv", CONV), StateSpec("recurrent", RECURRENT)))
    assert engine.spec.layers[:3] == (state,) * 3
    assert engine.spec.layers[3].n_kv_heads == 2 and engine.spec.layers[3].head_dim == 16
    assert engine.kinds == ("full", "recurrent")
    assert engine.pool_layers == ((3,), (0, 1, 2))
    assert engine.cache_config(16, TPB, True).life_cycles == (FullAttention(), Recurrent())
    layouts = engine.page_layouts()
    assert [layout.shape for layout in layouts] == [
        (1, 2, TPB, 2, 16), (3, CONV_DIM * 3 + 4 * 16 * 16)]
    assert [layout.dtype for layout in layouts] == ["float32", "float32"]
    assert engine.max_model_len == 256
    assert engine.describe()["parameters"] == hf.num_parameters()


def test_bfloat16_keeps_the_states_in_float32(checkpoint):
    """In bfloat16 the attention pages are bfloat16, the states float32; a prefill and a
    decode give transformers' bfloat16 logits up to bfloat16 rounding (0.02 measured,
    logits up to ~5; float32's differ from both by 0.15)."""
    directory, _ = checkpoint(VARIANT)
    engine, manager = engine_for(directory, dtype="bfloat16")
    assert [layout.dtype for layout in engine.page_layouts()] == ["bfloat16", "float32"]
    assert engine.storage[1].dtype == torch.float32
    prompt = tokens(1, 20)
    cache = manager.create_kv_cache([])
    assert cache.resize(len(prompt) + 1)
    engine.forward_logits([StepItem("s", cache, prompt, 0, None)])
    cache.commit(prompt)
    got = engine.forward_logits([StepItem("s", cache, [5], len(prompt), None)])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    expected = hf_logits(hf.eval(), prompt + [5])[-1]
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0)


def test_checkpoint_names_are_the_parameter_names_and_mtp_is_ignored(checkpoint, other,
                                                                     tmp_path):
    """Every stored tensor is read: under its parameter's name, but for the experts, stored
    one by one (as save_pretrained writes them) and stacked at load into transformers'
    in-memory parameters (gate_up_proj [E, 2I, D]: gate rows, then up rows; down_proj)."""
    directory, hf = checkpoint(VARIANT)
    model = load_checkpoint(directory)
    stored = load_file(directory / "model.safetensors")
    read = [s for name, _ in model.named_parameters() for s in model.checkpoint_tensor(name)[0]]
    assert sorted(read) == sorted(stored)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in stored
    params = dict(model.named_parameters())
    assert set(params) == set(dict(hf.named_parameters()))
    for name, p in hf.named_parameters():
        assert torch.equal(params[name], p), name
    gate_up = params["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[3, :32], stored["model.layers.0.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(gate_up[3, 32:], stored["model.layers.0.mlp.experts.3.up_proj.weight"])
    load_checkpoint(other[0])  # its mtp.fc.weight is ignored, as transformers ignores it
    tensors = load_file(other[0] / "model.safetensors")
    tensors["model.layers.0.mlp.experts.9.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((other[0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="unexpected tensor .*experts.9.up_proj"):
        load_checkpoint(tmp_path)
    del tensors["model.layers.0.mlp.experts.9.up_proj.weight"]  # (layer 0 has no MoE)
    tensors["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.zeros(31, 64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="cannot make model.layers.1.mlp.experts."
                                              "gate_up_proj.*one shape"):
        load_checkpoint(tmp_path)
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts.2.up_proj.weight is missing"):
        load_checkpoint(tmp_path)


def test_which_layers_have_a_sparse_moe_as_transformers_builds_them():
    for changes in ({}, {"mlp_only_layers": [0, 3]}, {"decoder_sparse_step": 2},
                    {"decoder_sparse_step": 3, "mlp_only_layers": [2]}, {"num_experts": 0}):
        raw = raw_config(**changes)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(
                transformers.Qwen3NextConfig.from_dict(raw))
            ours = Qwen3NextForCausalLM(Qwen3NextForCausalLM.parse_config(raw))
        expected = [isinstance(layer.mlp, hf_q3n.Qwen3NextSparseMoeBlock)
                    for layer in hf.model.layers]
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] \
            == expected, changes
        assert ({n: p.shape for n, p in ours.named_parameters()}
                == {n: p.shape for n, p in hf.named_parameters()})


# -- config.json ------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    {},  # Qwen3NextConfig's defaults: 48 layers, every 4th full, RoPE on a quarter
    {"num_hidden_layers": 6, "full_attention_interval": 3, "rope_theta": 5e6,
     "partial_rotary_factor": 0.5, "head_dim": 64},
    {"num_hidden_layers": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                 "partial_rotary_factor": 1.0}},
    {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"],
     "partial_rotary_factor": 0.75, "rope_parameters": {"rope_theta": 100.0}},
])
def test_config_fields_are_read_as_transformers_reads_them(raw):
    raw = {"architectures": ["Qwen3NextForCausalLM"], **raw}
    hf = transformers.Qwen3NextConfig.from_dict(dict(raw))
    args = Qwen3NextForCausalLM.parse_config(raw)
    kinds = {"linear_attention": "linear", "full_attention": "full"}
    assert args.layer_types == tuple(kinds[t] for t in hf.layer_types)
    assert args.rope_theta == hf.rope_parameters["rope_theta"]
    assert args.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                 "max_position_embeddings", "linear_conv_kernel_dim", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "norm_topk_prob", "attention_bias",
                 "tie_word_embeddings"):
        assert getattr(args, name) == getattr(hf, name), name


@pytest.mark.parametrize("changes, field", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1875}},
     "partial_rotary_factor"),  # 3 of 16 dims: odd
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     "partial_rotary_factor"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention",
                      "full_attention"]}, "layer_types"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts": -1}, "num_experts"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers"),
    ({"head_dim": 0}, "head_dim"),
    ({"architectures": ["Qwen3NextForCausalLM", "Qwen3ForCausalLM"]}, "architectures"),
])
def test_refused_config_fields_are_named(changes, field):
    with pytest.raises(CheckpointError, match=field):
        Qwen3NextForCausalLM.parse_config(raw_config(**changes), "config.json")


def test_a_refused_field_stops_loading(checkpoint, tmp_path):
    directory, _ = checkpoint(VARIANT)
    raw = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "hidden_act": "relu"}))
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="hidden_act"):
        load_checkpoint(tmp_path)


# -- blocks against transformers' ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_transformers(dtype):
    torch.manual_seed(0)
    x, gate = torch.randn(7, 16).to(dtype), torch.randn(7, 16).to(dtype)
    weight = torch.randn(16).to(dtype)
    ours, theirs = RMSNorm(16, 1e-6).to(dtype), hf_q3n.Qwen3NextRMSNorm(16, 1e-6).to(dtype)
    ours.weight.data, theirs.weight.data = weight.clone(), weight.clone()
    assert torch.equal(ours(x), theirs(x))  # (1 + w), zero-centred
    ours, theirs = GatedRMSNorm(16, 1e-6).to(dtype), hf_q3n.Qwen3NextRMSNormGated(16).to(dtype)
    ours.weight.data, theirs.weight.data = weight.clone(), weight.clone()
    assert torch.equal(ours(x, gate), theirs(x, gate))  # w, not 1 + w


@pytest.mark.parametrize("rotary_dim", [4, 8, 16])
def test_partial_rotary_matches_transformers(rotary_dim):
    torch.manual_seed(0)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    angles = torch.randn(5, rotary_dim // 2)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    hq, hk = hf_q3n.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         cos[None], sin[None])
    assert torch.equal(apply_partial_rotary(q, cos[:, None], sin[:, None]),
                       hq[0].transpose(0, 1))
    assert torch.equal(apply_partial_rotary(k, cos[:, None], sin[:, None]),
                       hk[0].transpose(0, 1))
    assert torch.equal(q[..., rotary_dim:], apply_partial_rotary(q, cos[:, None],
                                                                 sin[:, None])[..., rotary_dim:])


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_projections_split_per_key_head_group_as_transformers(checkpoint, layer):
    directory, hf = checkpoint(VARIANT)
    model = load_checkpoint(directory)
    x = torch.randn(6, 64)
    if layer == 3:  # the gated attention: query and gate interleaved per head
        ours = model.model.layers[3].self_attn
        q, gate = ours.q_proj(x).view(6, 4, 32).chunk(2, dim=-1)
        theirs_q, theirs_gate = torch.chunk(hf.model.layers[3].self_attn.q_proj(x)
                                            .view(6, -1, 32), 2, dim=-1)
        assert torch.equal(q, theirs_q) and torch.equal(gate, theirs_gate)
        return
    ours, theirs = model.model.layers[layer].linear_attn, hf.model.layers[layer].linear_attn
    mixed, z, b, a = ours.project(x)
    with torch.no_grad():
        q, k, v, hz, hb, ha = theirs.fix_query_key_value_ordering(
            theirs.in_proj_qkvz(x[None]), theirs.in_proj_ba(x[None]))
    assert torch.equal(mixed, torch.cat([t.reshape(6, -1) for t in (q[0], k[0], v[0])], -1))
    assert torch.equal(z, hz[0]) and torch.equal(b, hb[0]) and torch.equal(a, ha[0])


def test_moe_block_routes_as_transformers(checkpoint, other):
    """Top-2 renormalised (the variant) and top-3 as is (norm_topk_prob false), with the
    shared expert and its gate: the same output as transformers' block."""
    torch.manual_seed(0)
    x = torch.randn(33, 64)
    for (directory, hf), layer in ((checkpoint(VARIANT), 0), (other, 1)):
        model = load_checkpoint(directory)
        assert isinstance(model.model.layers[layer].mlp, SparseMoeBlock)
        with torch.no_grad():
            expected = hf.model.layers[layer].mlp(x[None])[0]
        torch.testing.assert_close(model.model.layers[layer].mlp(x), expected, atol=1e-5,
                                   rtol=0)


def test_another_checkpoint_of_the_family_matches_transformers(other):
    """OTHER (two full layers, biases, a quarter of RoPE, top-3, tied, MTP): prefill
    logits whole and chunked, and greedy decoding."""
    directory, hf = other
    engine, manager = engine_for(directory)
    assert engine.pool_layers == ((1, 3), (0, 2))
    prompt = tokens(1, 40)
    expected = hf_logits(hf, prompt)
    for chunks in ([40], [5, 11, 9, 15]):
        cache = manager.create_kv_cache([])
        assert cache.resize(len(prompt))
        pos = 0
        for size in chunks:
            got = engine.forward_logits([StepItem("s", cache, prompt[pos:pos + size], pos,
                                                  None)])[0]
            cache.commit(prompt[pos:pos + size])
            pos += size
            torch.testing.assert_close(got, expected[pos - 1], atol=ATOL, rtol=0)
        cache.close()
    assert Served(directory, TPB).one(prompt).tokens == hf_generate(hf, prompt)


# -- the Gated DeltaNet: states and paths ------------------------------------------------

def live_states(engine: TorchEngine, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's conv and recurrent state of ``layer``, as its live page holds them."""
    pool = engine.kinds.index("recurrent")
    row = engine.storage[pool][cache.live_state_page(pool), engine.slots[layer][1]]
    n = CONV[0] * CONV[1]
    return row[:n].view(CONV), row[n:].view(RECURRENT)


def hf_steps(hf, prompt: list[int], follow: list[int]):
    """transformers over ``prompt`` (one forward) then ``follow`` one token at a time with
    its cache: after each call, the last logits and each linear layer's (conv, recurrent)
    cache states."""
    cache, out = transformers.DynamicCache(config=hf.config), []
    with torch.inference_mode():
        for ids in [prompt] + [[t] for t in follow]:
            logits = hf(torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
            out.append((logits.clone(), {
                layer: (cache.get_conv_state(layer)[0].clone(),
                        cache.get_recurrent_state(layer)[0].clone()) for layer in (0, 1, 2)}))
    return out


def test_decode_states_equal_transformers_cache_after_each_step(checkpoint):
    """Two sequences, teacher-forced: A prefills 11 tokens alone, then decodes while B
    prefills 6 (a step mixing a chunk and a decode), then both decode together for 12
    steps. After every step, each one's logits and its conv and recurrent states in the
    pages equal transformers' (its cache after prefill + the same decodes): the conv state
    is the last kernel - 1 inputs, transformers keeps kernel of them."""
    directory, hf = checkpoint(VARIANT)
    engine, manager = engine_for(directory)
    prompts, follow = {"A": tokens(40, 11), "B": tokens(41, 6)}, {"A": tokens(42, 13),
                                                                    "B": tokens(43, 12)}
    expected = {name: hf_steps(hf, prompts[name], follow[name]) for name in prompts}
    caches, done = {}, {"A": 0, "B": 0}

    def item(name: str) -> StepItem:
        cache = caches[name]
        n = cache.num_committed_tokens
        new = prompts[name] if n == 0 else [follow[name][done[name] - 1]]
        return StepItem(name, cache, new, n, None)

    for step in range(14):
        active = ["A"] if step == 0 else ["A", "B"]
        for name in active:
            if name not in caches:
                caches[name] = manager.create_kv_cache([])
                assert caches[name].resize(40)
        items = [item(name) for name in active]
        logits = engine.forward_logits(items)
        for name, it, got in zip(active, items, logits):
            caches[name].commit(it.tokens)
            want_logits, want_states = expected[name][done[name]]
            torch.testing.assert_close(got, want_logits, atol=ATOL, rtol=0)
            for layer, (conv, recurrent) in want_states.items():
                ours_conv, ours_rec = live_states(engine, caches[name], layer)
                torch.testing.assert_close(ours_conv, conv[:, 1:], atol=ATOL, rtol=0)
                torch.testing.assert_close(ours_rec, recurrent, atol=ATOL, rtol=0)
            done[name] += 1
    assert done == {"A": 14, "B": 13}


def test_chunked_and_recurrent_rules_agree_across_any_chunk_boundaries():
    """The gated delta rule alone, in float32, from a non-zero state: the chunked form in
    pieces of 1, 5, 64, 70 and 7 tokens (crossing its 64-token chunks) equals the token
    recurrence, outputs and final state; both equal transformers' functions."""
    torch.manual_seed(0)
    heads, n, dk, dv = 4, 147, 16, 8
    q = hf_q3n.l2norm(torch.randn(heads, n, dk)) * dk ** -0.5
    k = hf_q3n.l2norm(torch.randn(heads, n, dk))
    v, beta = torch.randn(heads, n, dv), torch.rand(heads, n)
    g = -torch.rand(heads, n) * 3
    state0 = torch.randn(heads, dk, dv) * 0.1
    state, recurrent = state0[None], []
    for t in range(n):
        out, state = recurrent_gated_delta_step(q[None, :, t], k[None, :, t], v[None, :, t],
                                                g[None, :, t], beta[None, :, t], state)
        recurrent.append(out[0])
    recurrent, final = torch.stack(recurrent, 1), state[0]
    chunked, state, pos = [], state0, 0
    for size in (1, 5, 64, 70, 7):
        out, state = chunk_gated_delta_rule(q[:, pos:pos + size], k[:, pos:pos + size],
                                            v[:, pos:pos + size], g[:, pos:pos + size],
                                            beta[:, pos:pos + size], state)
        chunked.append(out)
        pos += size
    torch.testing.assert_close(torch.cat(chunked, 1), recurrent, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, final, atol=1e-5, rtol=0)
    # transformers': [batch, seq, heads, dim]; it normalises and scales q itself
    hf_in = [x.transpose(0, 1)[None] for x in (q * dk ** 0.5, k, v)]
    hf_out, hf_state = hf_q3n.torch_chunk_gated_delta_rule(
        *hf_in, g=g.T[None], beta=beta.T[None], initial_state=state0[None],
        output_final_state=True)
    torch.testing.assert_close(hf_out[0].transpose(0, 1), recurrent, atol=1e-5, rtol=0)
    torch.testing.assert_close(hf_state[0], final, atol=1e-5, rtol=0)


def test_prefill_chunks_and_one_token_steps_give_the_same_logits(checkpoint):
    """The whole model over 40 tokens: in one chunk, in chunks of 5/11/9/15, and one token
    a step (the recurrence). In float32 each equals transformers' own path (its forward;
    its cached token-by-token decode) within 1e-4. Between the two paths the float32
    rounding of this sharp random model alone reaches ~1.5e-4 (transformers' own two paths
    differ by as much), so they are compared at 1e-4 in float64, where only the delta
    rule's float32 (its inputs and the states in the pages) is left."""
    directory, hf = checkpoint(VARIANT)
    prompt = tokens(1, 40)

    def run(chunks, dtype=None, prompt=prompt) -> dict[int, torch.Tensor]:
        engine, manager = engine_for(directory, dtype=dtype)
        cache = manager.create_kv_cache([])
        assert cache.resize(len(prompt))
        pos, out = 0, {}
        for size in chunks:
            out[pos + size - 1] = engine.forward_logits(
                [StepItem("s", cache, prompt[pos:pos + size], pos, None)])[0].double()
            cache.commit(prompt[pos:pos + size])
            pos += size
        return out

    token_by_token = run([1] * 40)
    hf_token_by_token = [logits for logits, _ in hf_steps(hf, prompt[:1], prompt[1:])]
    for pos, got in token_by_token.items():
        torch.testing.assert_close(got.float(), hf_token_by_token[pos], atol=ATOL, rtol=0)
    whole = hf_logits(hf, prompt)
    for chunks in ([40], [5, 11, 9, 15]):
        for pos, got in run(chunks).items():
            torch.testing.assert_close(got.float(), whole[pos], atol=ATOL, rtol=0)
    long = tokens(2, 200)  # several 64-token chunks of the chunked rule in one item
    whole = hf_logits(hf, long)
    for chunks in ([200], [70, 129, 1]):
        for pos, got in run(chunks, prompt=long).items():
            torch.testing.assert_close(got.float(), whole[pos], atol=ATOL, rtol=0)
    steps = run([1] * 40, torch.float64)
    for chunks in ([40], [5, 11, 9, 15], [3, 1, 30, 6]):
        for pos, got in run(chunks, torch.float64).items():
            torch.testing.assert_close(got, steps[pos], atol=ATOL, rtol=0)
