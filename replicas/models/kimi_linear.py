"""Kimi Linear on paged KV and recurrent pages, as transformers' ``modeling_kimi_linear.py``
computes it (its pure-torch paths).

Moonshot's hybrid: most layers are Kimi Delta Attention (KDA), a gated delta rule whose
decay is per channel, the rest Multi-head Latent Attention (MLA) without positional
encoding; the feed-forward is a dense SwiGLU MLP in the first ``first_k_dense_replace``
layers, a mixture of experts after them.

KDA (``KimiDeltaAttention``): q, k, v projections, each through its own depthwise causal
convolution of ``short_conv_kernel_size`` taps and SiLU; a forget gate ``g = -exp(A_log) *
softplus(f_b(f_a(x)) + dt_bias)`` per channel and ``beta = sigmoid(b_proj(x))`` per head;
q and k L2-normalised, q scaled by ``head_dim ** -0.5``; then per head the state
``S [k_dim, v_dim]`` goes token by token

    S = diag(exp(g)) S;  S = S + beta k (v - S^T k)^T;  o = S^T q

(chunks of 64 tokens at once in prefill, as transformers' chunked form; one step per
decoded token); the output ``o_proj(rmsnorm(o) * sigmoid(g_b(g_a(x))))``. Its whole
history is its state: each convolution's last ``kernel - 1`` inputs and ``S``
(``RecurrentSpec``: ``q_conv``, ``k_conv``, ``v_conv``, ``recurrent``), so a chunk or a
decode resumes exactly from the state in the pages.

MLA (``KimiMLAAttention``): what is cached per token is the compressed latent ``kv_nope``
(``kv_lora_rank``, after ``kv_a_layernorm``) and the key part shared by every head
``k_rot`` (``qk_rope_head_dim``; no RoPE is applied to it, or to anything: Kimi Linear's
MLA is NoPE), as transformers' cache holds them: the layer's ``AttentionSpec`` has one
"KV head" whose keys are the latents and whose "values" are ``k_rot`` (``v_head_dim``),
side by side in the page. At every step ``ctx.history`` hands each sequence's cached
entries back, ``kv_b_proj`` expands them into per-head keys ``[k_nope, k_rot]`` and values,
and the layer attends (scale ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).

MoE (``KimiLinearMoE``): sigmoid router scores plus ``e_score_correction_bias`` choose
the top ``num_experts_per_token`` experts (within the best ``topk_group`` of
``num_expert_group`` groups), weighted by their scores (renormalised with
``moe_renormalize``) times ``routed_scaling_factor``; the shared experts' MLP is added.

Module names follow the checkpoints Moonshot publishes (and transformers saves):
``self_attn.q_conv1d``, ``self_attn.f_a_proj``, ``block_sparse_moe.experts.3.w1``; a dense
layer's MLP is ``mlp`` (transformers saves it as ``block_sparse_moe``: read either).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionSpec, MixerContext, ModelSpec, RecurrentSpec, StateSpec
from .config import CheckpointError, _Fields
from .llama import RMSNorm

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
CHUNK = 64  # tokens per chunk of the chunked delta rule (transformers' chunk_size)
# linear_attn_config keys transformers reads; any other would change the model
LINEAR_ATTN_KEYS = ("head_dim", "num_heads", "short_conv_kernel_size", "kda_layers",
                    "full_attn_layers")


@dataclass(frozen=True)
class KimiLinearArgs:
    """What ``KimiLinearForCausalLM`` needs from ``config.json`` (transformers'
    ``KimiLinearConfig``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense MLPs
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # "linear_attention" (KDA) or "full_attention" (MLA)
    mlp_layer_types: tuple[str, ...]  # "dense" or "sparse" (MoE)
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel: int
    # MoE
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    tie_word_embeddings: bool  # always False: transformers' KimiLinear ties nothing
    dtype: str | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def parse_config(raw: dict[str, Any], source: str = "config.json") -> KimiLinearArgs:
    fields = _Fields(raw, source)
    _refuse_unsupported(fields)
    n = fields.int("num_hidden_layers", 27)
    heads = fields.int("num_attention_heads", 32)
    kv_heads = fields.int("num_key_value_heads", None) or heads
    if kv_heads != heads:
        raise fields.error("num_key_value_heads", f"must equal num_attention_heads ({heads}): "
                                                  "MLA expands a key and a value per head")
    linear = _linear_attn_config(fields)
    experts = _aliased(fields, "num_experts", "num_local_experts", 256)
    top_k = _aliased(fields, "num_experts_per_token", "num_experts_per_tok", 8)
    groups = _aliased(fields, "num_expert_group", "n_group", 1)
    topk_group = fields.int("topk_group", 1)
    _check_routing(fields, experts, top_k, groups, topk_group)
    renormalize = _aliased(fields, "moe_renormalize", "norm_topk_prob", True, kind="bool")
    # transformers' KimiLinearForCausalLM ties nothing (its _tied_weights_keys is empty):
    # lm_head is read from the checkpoint whatever tie_word_embeddings says
    fields.bool("tie_word_embeddings", False)
    kernel = linear.get("short_conv_kernel_size", fields.int("linear_conv_kernel_dim", 4))
    if kernel < 2:
        raise fields.error("linear_attn_config", f"short_conv_kernel_size {kernel} must be at "
                                                 "least 2 (a convolution over earlier tokens)")
    return KimiLinearArgs(
        architecture="KimiLinearForCausalLM",
        vocab_size=fields.int("vocab_size", 163840),
        hidden_size=fields.int("hidden_size", 2304),
        intermediate_size=fields.int("intermediate_size", 9216),
        num_hidden_layers=n,
        rms_norm_eps=fields.float("rms_norm_eps", 1e-5),
        max_position_embeddings=_aliased(fields, "model_max_length", "max_position_embeddings",
                                         1048576),
        layer_types=_layer_types(fields, n, linear),
        mlp_layer_types=_mlp_layer_types(fields, n),
        num_attention_heads=heads,
        q_lora_rank=fields.int("q_lora_rank", None),
        kv_lora_rank=fields.int("kv_lora_rank", 512),
        qk_nope_head_dim=fields.int("qk_nope_head_dim", 128),
        qk_rope_head_dim=fields.int("qk_rope_head_dim", 64),
        v_head_dim=fields.int("v_head_dim", 128),
        attention_bias=fields.bool("attention_bias", False),
        linear_num_heads=linear.get("num_heads", fields.int("linear_num_heads", 32)),
        linear_head_dim=linear.get("head_dim", fields.int("linear_head_dim", 128)),
        conv_kernel=kernel,
        moe_intermediate_size=fields.int("moe_intermediate_size", 1024),
        num_experts=experts,
        num_experts_per_token=top_k,
        num_shared_experts=_aliased(fields, "num_shared_experts", "n_shared_experts", 1),
        num_expert_group=groups,
        topk_group=topk_group,
        moe_renormalize=renormalize,
        routed_scaling_factor=fields.float("routed_scaling_factor", 2.446),
        tie_word_embeddings=False,
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _refuse_unsupported(fields: _Fields) -> None:
    """Fields of Kimi checkpoints whose values change the model in ways transformers'
    KimiLinear (and so this one) does not compute."""
    raw = fields.raw
    if raw.get("quantization_config") is not None:
        raise fields.error("quantization_config", "quantized checkpoints are not supported")
    if fields.get("hidden_act", "silu") != "silu":
        raise fields.error("hidden_act", "only 'silu' is supported (the MLPs' SwiGLU and the "
                                         "KDA convolutions' activation)")
    if raw.get("mla_use_nope") not in (None, True):
        raise fields.error("mla_use_nope", "Kimi Linear's MLA has no positional encoding; "
                                           "RoPE in MLA is not implemented")
    refused = {  # field -> (its value in the model computed here, why)
        "mla_use_output_gate": (False, "an output gate on MLA is not implemented"),
        "moe_layer_freq": (1, ("MoE on every layer from first_k_dense_replace on is what "
                               "transformers computes; other frequencies are not implemented")),
        "moe_router_activation_func": ("sigmoid", "only sigmoid router scores are implemented"),
        "topk_method": ("noaux_tc", "only bias-corrected (noaux_tc) top-k is implemented"),
        "attn_res_block_size": (None, "attention residuals are not implemented"),
        "routed_expert_hidden_size": (None, "latent MoE is not implemented"),
        "latent_moe_use_norm": (False, "latent MoE is not implemented"),
        "num_nextn_predict_layers": (0, "multi-token-prediction layers are not implemented"),
    }
    for name, (served, why) in refused.items():
        if raw.get(name) is not None and raw[name] != served:
            raise fields.error(name, why)
    if raw.get("use_grouped_topk") is False and (raw.get("num_expert_group") or
                                                 raw.get("n_group") or 1) > 1:
        raise fields.error("use_grouped_topk", "transformers always routes within the best "
                                               "groups; ungrouped top-k over several groups "
                                               "is not implemented")


def _aliased(fields: _Fields, saved: str, alias: str, default: Any, kind: str = "int") -> Any:
    """A field transformers saves as ``saved`` and also reads as ``alias`` (its
    ``attribute_map``)."""
    raw = fields.raw
    if raw.get(saved) is not None and raw.get(alias) is not None and raw[saved] != raw[alias]:
        raise CheckpointError(f"{fields.source}: {saved}={raw[saved]!r} and {alias}="
                              f"{raw[alias]!r} name one setting with two values")
    name = alias if raw.get(saved) is None and raw.get(alias) is not None else saved
    return getattr(fields, kind)(name, default)


def _linear_attn_config(fields: _Fields) -> dict[str, Any]:
    config = fields.get("linear_attn_config", {})
    if not isinstance(config, dict):
        raise fields.error("linear_attn_config", "must be a mapping")
    for key, value in config.items():
        if key not in LINEAR_ATTN_KEYS:
            raise CheckpointError(f"{fields.source}: linear_attn_config.{key}={value!r}: not "
                                  f"implemented (known: {', '.join(LINEAR_ATTN_KEYS)})")
    for key in ("head_dim", "num_heads", "short_conv_kernel_size"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise CheckpointError(f"{fields.source}: linear_attn_config.{key}={value!r}: must "
                                  "be a positive integer")
    return {k: v for k, v in config.items() if v is not None}


def _layer_types(fields: _Fields, n: int, linear: dict[str, Any]) -> tuple[str, ...]:
    """``layer_types``, else ``linear_attn_config``'s 1-based ``full_attn_layers`` and
    ``kda_layers``, else every 4th layer after the first MLA (KimiLinearConfig's order)."""
    types = fields.get("layer_types")
    if types is None and "full_attn_layers" in linear and "kda_layers" in linear:
        full, kda = linear["full_attn_layers"], linear["kda_layers"]
        listed = sorted([*full, *kda]) if isinstance(full, list) and isinstance(kda, list) \
            else None
        if listed != list(range(1, n + 1)):
            raise fields.error("linear_attn_config", f"full_attn_layers and kda_layers must "
                                                     f"list each of the layers 1..{n} once")
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                 for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES
                                                             for t in types):
        raise fields.error("layer_types", f"must list {n} entries of {list(LAYER_TYPES)}")
    return tuple(types)


def _mlp_layer_types(fields: _Fields, n: int) -> tuple[str, ...]:
    types = fields.get("mlp_layer_types")
    if types is None:
        dense = fields.get("first_k_dense_replace", 1)
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
            raise fields.error("first_k_dense_replace", "must be an integer >= 0")
        types = ["dense" if i < dense else "sparse" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in MLP_LAYER_TYPES
                                                             for t in types):
        raise fields.error("mlp_layer_types", f"must list {n} entries of "
                                              f"{list(MLP_LAYER_TYPES)}")
    return tuple(types)


def _check_routing(fields: _Fields, experts: int, top_k: int, groups: int,
                   topk_group: int) -> None:
    if experts % groups or experts // groups < 2:
        raise fields.error("num_expert_group", f"must divide num_experts ({experts}) into "
                                               "groups of at least 2 (a group scores by its "
                                               "best two)")
    if topk_group > groups:
        raise fields.error("topk_group", f"must be at most num_expert_group ({groups})")
    if top_k > topk_group * (experts // groups):
        raise fields.error("num_experts_per_token", f"{top_k} experts cannot be chosen from "
                                                    f"{topk_group} groups of "
                                                    f"{experts // groups}")


# --------------------------------------------------------------------------- KDA

def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's, as transformers')."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of each of D sequences: q, k ``[D, H, dk]`` (normalised, q scaled), v
    ``[D, H, dv]``, log decay g ``[D, H, dk]``, beta ``[D, H]``, state ``[D, H, dk, dv]``
    (float32) -> output ``[D, H, dv]`` and the new state."""
    state = state * g.exp()[..., None]
    remembered = (state * k[..., None]).sum(dim=-2)  # what S predicts for k: [D, H, dv]
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       state: Tensor, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The delta rule over one sequence's n tokens, ``chunk`` at a time (WY form, as
    transformers' ``chunk_kimi_delta_attention``): q, k ``[n, H, dk]``, v ``[n, H, dv]``,
    g ``[n, H, dk]``, beta ``[n, H]``, state ``[H, dk, dv]`` (float32) -> output
    ``[n, H, dv]`` and the state after the last token. A last chunk shorter than ``chunk``
    is computed at its own length (transformers pads it with tokens that change nothing)."""
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # [H, n, d]
    beta = beta.T[..., None]  # [H, n, 1]
    k_beta, v_beta = k * beta, v * beta
    n, outs = q.shape[1], []
    for a in range(0, n, chunk):
        e = min(a + chunk, n)
        c = e - a
        qc, kc, gc = q[:, a:e], k[:, a:e], g[:, a:e].cumsum(dim=1)
        later = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)  # key j > query i
        # exp(g_i - g_j): the decay from token j to token i, per channel [H, c, c, dk]
        decay = (gc[:, :, None] - gc[:, None, :]).masked_fill(later[..., None],
                                                              float("-inf")).exp()
        # (I + strictly lower A)^-1 by forward substitution, A_ij = -beta_i k_i.(decay k_j)
        solve = -(k_beta[:, a:e, None] * kc[:, None] * decay).sum(dim=-1)
        solve = solve.masked_fill(later | torch.eye(c, dtype=torch.bool, device=q.device), 0)
        for i in range(1, c):
            row = solve[:, i, :i]
            solve[:, i, :i] = row + (row[..., None] * solve[:, :i, :i]).sum(dim=-2)
        solve = solve + torch.eye(c, dtype=solve.dtype, device=q.device)
        u = solve @ v_beta[:, a:e]
        w = solve @ (k_beta[:, a:e] * gc.exp())
        v_new = u - w @ state
        scores = (qc[:, :, None] * kc[:, None] * decay).sum(dim=-1).masked_fill(later, 0)
        outs.append((qc * gc.exp()) @ state + scores @ v_new)
        last = gc[:, -1:]  # [H, 1, dk]
        state = (state * last[:, 0, :, None].exp()
                 + (kc * (last - gc).exp()).transpose(-1, -2) @ v_new)
    return torch.cat(outs, dim=1).transpose(0, 1), state


def short_conv(conv: nn.Conv1d, x: Tensor, past: Tensor,
               bounds: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """SiLU of a depthwise causal convolution over each sequence's rows of ``x [T, C]``
    after its last ``kernel - 1`` inputs ``past [B, C, kernel - 1]`` -> ``[T, C]`` and the
    new ``[B, C, kernel - 1]``."""
    keep = conv.kernel_size[0] - 1
    outs, states = [], []
    for i, (a, e) in enumerate(bounds):
        window = torch.cat([past[i].to(x.dtype), x[a:e].T], dim=1)  # [C, keep + n]
        outs.append(F.conv1d(window[None], conv.weight, None, groups=window.shape[0])[0].T)
        states.append(window[:, -keep:])
    return F.silu(torch.cat(outs)), torch.stack(states)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times ``sigmoid(gate)``, all in float32 (transformers'
    ``KimiLinearRMSNormGated``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = self.weight.to(torch.float32) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)
                                                            + self.eps))
        return (h * torch.sigmoid(gate.to(torch.float32))).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, args: KimiLinearArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim = args.linear_num_heads, args.linear_head_dim
        d, dim = args.hidden_size, args.linear_num_heads * args.linear_head_dim
        self.q_proj = nn.Linear(d, dim, bias=False)
        self.k_proj = nn.Linear(d, dim, bias=False)
        self.v_proj = nn.Linear(d, dim, bias=False)
        self.q_conv1d = _depthwise(dim, args.conv_kernel)
        self.k_conv1d = _depthwise(dim, args.conv_kernel)
        self.v_conv1d = _depthwise(dim, args.conv_kernel)
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.heads, 1))
        self.f_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))
        self.b_proj = nn.Linear(d, self.heads, bias=False)
        self.g_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, args.rms_norm_eps)
        self.o_proj = nn.Linear(dim, d, bias=False)

    def forget_gate(self, x: Tensor) -> Tensor:
        """Log decay per channel ``[T, H, dk]`` (float32): ``-exp(A_log) * softplus(f_b(f_a(x))
        + dt_bias)``, softplus taken as the identity above 20."""
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float())
        g = g.view(x.shape[0], self.heads, self.head_dim)
        softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return -torch.exp(self.A_log.float()).view(self.heads, 1) * softplus

    def forward(self, x: Tensor, ctx: MixerContext) -> Tensor:
        t, shape = x.shape[0], (x.shape[0], self.heads, self.head_dim)
        past = ctx.read_states(self.layer)
        q, q_state = short_conv(self.q_conv1d, self.q_proj(x), past["q_conv"], ctx.bounds)
        k, k_state = short_conv(self.k_conv1d, self.k_proj(x), past["k_conv"], ctx.bounds)
        v, v_state = short_conv(self.v_conv1d, self.v_proj(x), past["v_conv"], ctx.bounds)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x)).float()
        q = l2norm(q.view(shape).float()) * (1 / self.head_dim ** 0.5)
        k = l2norm(k.view(shape).float())
        v = v.view(shape).float()
        out, states = self._delta_rule(q, k, v, g, beta, past["recurrent"], ctx.bounds)
        ctx.write_states(self.layer, {"q_conv": q_state, "k_conv": k_state,
                                      "v_conv": v_state, "recurrent": states})
        gate = self.g_b_proj(self.g_a_proj(x)).view(shape)
        return self.o_proj(self.o_norm(out.to(x.dtype), gate).reshape(t, -1))

    @staticmethod
    def _delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, past: Tensor,
                    bounds: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """Decoded tokens (sequences with one new token) in one recurrent step together,
        each prefill chunk chunked on its own, from its state in ``past [B, H, dk, dv]``."""
        out, states = torch.empty_like(v), past.clone()
        decodes = [i for i, (a, e) in enumerate(bounds) if e - a == 1]
        if decodes:
            rows = torch.tensor([bounds[i][0] for i in decodes], device=q.device)
            seqs = torch.tensor(decodes, device=q.device)
            out[rows], states[seqs] = recurrent_delta_rule(q[rows], k[rows], v[rows], g[rows],
                                                           beta[rows], past[seqs])
        for i, (a, e) in enumerate(bounds):
            if e - a > 1:
                out[a:e], states[i] = chunked_delta_rule(q[a:e], k[a:e], v[a:e], g[a:e],
                                                         beta[a:e], past[i])
        return out, states


def _depthwise(channels: int, kernel: int) -> nn.Conv1d:
    return nn.Conv1d(channels, channels, kernel_size=kernel, groups=channels, bias=False,
                     padding=kernel - 1)


# --------------------------------------------------------------------------- MLA

class KimiMLAAttention(nn.Module):
    """Latent attention without positional encoding; caches ``kv_nope`` and ``k_rot``."""

    def __init__(self, args: KimiLinearArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.heads = layer, args.num_attention_heads
        self.nope, self.rope = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.rank, self.v_dim = args.kv_lora_rank, args.v_head_dim
        self.scale = args.qk_head_dim ** -0.5
        d, bias, q_dim = args.hidden_size, args.attention_bias, self.heads * args.qk_head_dim
        self.q_lora = args.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = nn.Linear(d, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, 1e-6)  # transformers' default eps
            self.q_b_proj = nn.Linear(args.q_lora_rank, q_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, d, bias=bias)

    def expand(self, kv_nope: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
        """Cached latents ``[m, rank]`` and shared key parts ``[m, rope]`` -> keys
        ``[H, m, nope + rope]`` and values ``[H, m, v_dim]``."""
        m = kv_nope.shape[0]
        k_nope, values = self.kv_b_proj(kv_nope).view(m, self.heads, -1).split(
            [self.nope, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, k_rot[:, None].expand(-1, self.heads, -1)], dim=-1)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def forward(self, x: Tensor, ctx: MixerContext) -> Tensor:
        t = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(t, self.heads, -1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        out = x.new_empty(t, self.heads, self.v_dim)
        for (a, e), seen in zip(ctx.bounds, ctx.history(self.layer, kv_nope[:, None],
                                                        k_rot[:, None])):
            keys, values = self.expand(seen.keys[:, 0], seen.values[:, 0])
            out[a:e] = F.scaled_dot_product_attention(
                q[a:e].transpose(0, 1)[None], keys[None], values[None], attn_mask=seen.mask,
                scale=self.scale)[0].transpose(0, 1)
        return self.o_proj(out.reshape(t, -1))


# --------------------------------------------------------------------------- MLP / MoE

class KimiLinearMLP(nn.Module):
    def __init__(self, args: KimiLinearArgs, intermediate_size: int) -> None:
        super().__init__()
        d = args.hidden_size
        self.gate_proj = nn.Linear(d, intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KimiExpert(nn.Module):
    """One routed expert: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, args: KimiLinearArgs) -> None:
        super().__init__()
        d, f = args.hidden_size, args.moe_intermediate_size
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class KimiMoEGate(nn.Module):
    """The router: its weight and the bias added to scores when choosing (both float32)."""

    def __init__(self, args: KimiLinearArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(args.num_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts))
        self.top_k, self.groups = args.num_experts_per_token, args.num_expert_group
        self.topk_group, self.renormalize = args.topk_group, args.moe_renormalize
        self.scaling = args.routed_scaling_factor

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's experts ``[T, k]`` and their weights ``[T, k]`` (float32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        t, experts = choice.shape
        per_group = choice.view(t, self.groups, experts // self.groups)
        best = per_group.topk(2, dim=-1)[0].sum(dim=-1).topk(self.topk_group, dim=-1,
                                                             sorted=False)[1]
        allowed = torch.zeros(t, self.groups, dtype=torch.bool, device=x.device)
        allowed.scatter_(1, best, True)
        allowed = allowed[..., None].expand_as(per_group).reshape(t, experts)
        chosen = choice.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1,
                                                                  sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.scaling


class KimiLinearMoE(nn.Module):
    def __init__(self, args: KimiLinearArgs) -> None:
        super().__init__()
        self.gate = KimiMoEGate(args)
        self.experts = nn.ModuleList(KimiExpert(args) for _ in range(args.num_experts))
        self.shared_experts = KimiLinearMLP(args, args.moe_intermediate_size
                                            * args.num_shared_experts)

    def forward(self, x: Tensor) -> Tensor:
        chosen, weights = self.gate(x)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():  # ascending, as transformers adds them
            tokens, slot = torch.where(chosen == expert)
            y = self.experts[expert](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out + self.shared_experts(x)


# --------------------------------------------------------------------------- the model

class KimiLinearDecoderLayer(nn.Module):
    def __init__(self, args: KimiLinearArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = (KimiMLAAttention(args, layer)
                          if args.layer_types[layer] == "full_attention"
                          else KimiDeltaAttention(args, layer))
        self.sparse = args.mlp_layer_types[layer] == "sparse"
        if self.sparse:
            self.block_sparse_moe = KimiLinearMoE(args)
        else:
            self.mlp = KimiLinearMLP(args, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, h: Tensor, ctx: MixerContext) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx)
        x = self.post_attention_layernorm(h)
        return h + (self.block_sparse_moe(x) if self.sparse else self.mlp(x))


class KimiLinearModel(nn.Module):
    def __init__(self, args: KimiLinearArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(KimiLinearDecoderLayer(args, i)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, tokens: Tensor, ctx: MixerContext) -> Tensor:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, ctx)
        return h


class KimiLinearForCausalLM(nn.Module):
    """A ``PagedLM``: MLA layers' latents in the full-attention pool (one page row per
    token: ``kv_nope`` then ``k_rot``), KDA layers' states in the recurrent pool."""

    parse_config = staticmethod(parse_config)
    # transformers saves a dense layer's MLP under block_sparse_moe (Moonshot's: mlp)
    TENSOR_ALIASES = ((r"(model\.layers\.\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight",
                       r"\1.block_sparse_moe.\2.weight"),)
    # what transformers keeps in float32 (_keep_in_fp32_modules_strict)
    FLOAT32_PARAMETERS = (r".*\.self_attn\.dt_bias", r".*\.block_sparse_moe\.gate\.weight",
                          r".*\.block_sparse_moe\.gate\.e_score_correction_bias")

    def __init__(self, args: KimiLinearArgs, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.model = KimiLinearModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        dim, keep = args.linear_num_heads * args.linear_head_dim, args.conv_kernel - 1
        kda = RecurrentSpec((
            StateSpec("q_conv", (dim, keep)), StateSpec("k_conv", (dim, keep)),
            StateSpec("v_conv", (dim, keep)),
            StateSpec("recurrent", (args.linear_num_heads, args.linear_head_dim,
                                    args.linear_head_dim))))
        mla = AttentionSpec(1, args.kv_lora_rank, v_head_dim=args.qk_rope_head_dim,
                            scale=args.qk_head_dim ** -0.5)
        self.spec = ModelSpec(
            tuple(mla if t == "full_attention" else kda for t in args.layer_types),
            max_model_len=args.max_position_embeddings, vocab_size=args.vocab_size, dtype=dtype)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        return self.model(tokens, ctx)  # no positional encoding anywhere

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(hidden))
