"""Qwen3-Next on paged KV and recurrent state pages, as transformers' ``modeling_qwen3_next.py``.

A hybrid: ``layer_types`` mixes Gated DeltaNet layers (``linear_attention``; by default
three of every four) with gated softmax attention (``full_attention``). Module names follow
the checkpoints' (``model.layers.0.linear_attn.in_proj_qkvz``, ``model.layers.3.self_attn``),
so a safetensors file loads name for name, but for the routed experts: stored one by one
(``model.layers.0.mlp.experts.7.gate_proj.weight``), they are stacked at load into
``mlp.experts.gate_up_proj`` / ``down_proj`` as transformers holds them
(``checkpoint_tensor``). The multi-token-prediction tensors (``mtp.*``) are not used
(transformers drops them too).

Gated DeltaNet (``GatedDeltaNet``), per token t and value head h::

    q, k, v, z, b, a   from in_proj_qkvz / in_proj_ba, grouped per key head as stored
    q, k, v            <- silu(causal depthwise conv1d over the last ``kernel`` inputs)
    q, k               <- l2-normalised (q also scaled by head_k_dim ** -0.5); each key head
                          serves num_v_heads / num_k_heads consecutive value heads
    beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)
    S    <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q   (S [head_k, head_v])
    out  = out_proj(RMSNorm(o) * silu(z))

Its states, kept in the recurrent pool as float32: ``conv`` (the last ``kernel - 1`` conv
inputs, ``[conv_dim, kernel - 1]``) and ``recurrent`` (``S``, ``[num_v_heads, head_k_dim,
head_v_dim]``). A prefill chunk runs the chunked (WY) form of the rule, 64 tokens a chunk
as ``torch_chunk_gated_delta_rule``, from the state read from the pages; one-token items
(decodes) run the token recurrence of ``torch_recurrent_gated_delta_rule``, all together.
Both start from the carried state, so chunks may stop anywhere.

Full attention (``GatedAttention``): ``q_proj`` emits each head's query and an output gate
side by side; q and k get a zero-centred RMSNorm per head, RoPE turns only the first
``partial_rotary_factor`` of each head's dims, and the attention output is multiplied by
``sigmoid(gate)`` before ``o_proj``.

Every norm but the DeltaNet output norm scales by ``1 + weight`` (weights stored
zero-centred). The MLP is a sparse MoE (softmax router, top-k, optionally renormalised,
plus a shared expert behind a sigmoid gate; the routed experts in two grouped matmuls,
``moe.py``) except in ``mlp_only_layers`` and layers off the ``decoder_sparse_step`` grid,
which have a dense SwiGLU MLP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionSpec, MixerContext, ModelSpec, RecurrentSpec, StateSpec
from .config import CheckpointError, _Fields
from .moe import routed_experts, stacked_sources, swiglu

ARCHITECTURE = "Qwen3NextForCausalLM"
LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}
CHUNK = 64  # tokens per chunk of the chunked delta rule (transformers' chunk_size)
_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


# --------------------------------------------------------------------------- config

@dataclass(frozen=True)
class Qwen3NextArgs:
    """What the model needs from ``config.json``. ``layer_types[i]`` is ``"linear"``
    (Gated DeltaNet) or ``"full"``; ``moe_layers[i]``: layer i's MLP is the sparse MoE."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rotary_dim: int  # the leading dims of each head RoPE turns
    attention_bias: bool
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    moe_layers: tuple[bool, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    tie_word_embeddings: bool = False
    dtype: str | None = None

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v of every head."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)


def parse_qwen3_next_config(raw: dict[str, Any], source: str = "config.json") -> Qwen3NextArgs:
    """``Qwen3NextArgs`` of a parsed ``config.json``, with ``Qwen3NextConfig``'s defaults;
    fields whose values would compute something this model does not are refused."""
    fields = _Fields(raw, source)
    archs = raw.get("architectures")
    if archs != [ARCHITECTURE]:
        raise CheckpointError(f"{source}: 'architectures' must be [{ARCHITECTURE!r}], got "
                              f"{archs!r}")
    if raw.get("quantization_config") is not None:
        raise fields.error("quantization_config", "quantized checkpoints are not supported")
    if fields.get("hidden_act", "silu") != "silu":
        raise fields.error("hidden_act", "only 'silu' (the conv activation and SwiGLU "
                                         "MLPs) is supported")
    n = fields.int("num_hidden_layers", 48)
    heads = fields.int("num_attention_heads", 16)
    kv_heads = fields.int("num_key_value_heads", 2)
    if heads % kv_heads:
        raise fields.error("num_key_value_heads", f"must divide num_attention_heads {heads}")
    head_dim = fields.int("head_dim", 256)  # Qwen3NextConfig's default, not hidden / heads
    k_heads = fields.int("linear_num_key_heads", 16)
    v_heads = fields.int("linear_num_value_heads", 32)
    if v_heads % k_heads:
        raise fields.error("linear_num_value_heads",
                           f"must be a multiple of linear_num_key_heads {k_heads}")
    kernel = fields.int("linear_conv_kernel_dim", 4)
    if kernel < 2:
        raise fields.error("linear_conv_kernel_dim", "must be at least 2 (the conv state "
                                                     "holds kernel - 1 inputs)")
    num_experts = _count(fields, "num_experts", 512)
    top_k = fields.int("num_experts_per_tok", 10)
    if num_experts and top_k > num_experts:
        raise fields.error("num_experts_per_tok", f"exceeds num_experts {num_experts}")
    layer_types = _layer_types(fields, n)
    only = fields.get("mlp_only_layers", [])
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                         for i in only):
        raise fields.error("mlp_only_layers", "must be a list of layer indices")
    step = fields.int("decoder_sparse_step", 1)
    moe = tuple(i not in only and num_experts > 0 and (i + 1) % step == 0 for i in range(n))
    return Qwen3NextArgs(
        architecture=ARCHITECTURE,
        vocab_size=fields.int("vocab_size", 151936),
        hidden_size=fields.int("hidden_size", 2048),
        intermediate_size=fields.int("intermediate_size", 5632),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=fields.float("rms_norm_eps", 1e-6),
        max_position_embeddings=fields.int("max_position_embeddings", 32768),
        **_rope(fields, head_dim),
        attention_bias=fields.bool("attention_bias", False),
        layer_types=layer_types,
        linear_conv_kernel_dim=kernel,
        linear_key_head_dim=fields.int("linear_key_head_dim", 128),
        linear_value_head_dim=fields.int("linear_value_head_dim", 128),
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        moe_layers=moe,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields.int("moe_intermediate_size", 512),
        shared_expert_intermediate_size=fields.int("shared_expert_intermediate_size", 512),
        norm_topk_prob=fields.bool("norm_topk_prob", True),
        tie_word_embeddings=fields.bool("tie_word_embeddings", False),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _count(fields: _Fields, name: str, default: int) -> int:
    value = fields.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fields.error(name, "must be a non-negative integer")
    return value


def _layer_types(fields: _Fields, n: int) -> tuple[str, ...]:
    """``layer_types``, or (absent) every ``full_attention_interval``-th layer full."""
    types = fields.get("layer_types")
    if types is None:
        interval = fields.int("full_attention_interval", 4)
        return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(n))
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise fields.error("layer_types", f"entries must be one of {sorted(LAYER_TYPES)}")
    if len(types) != n:
        raise fields.error("layer_types", f"has {len(types)} entries for {n} layers "
                                          "(num_hidden_layers)")
    return tuple(LAYER_TYPES[t] for t in types)


def _rope(fields: _Fields, head_dim: int) -> dict:
    """RoPE as transformers standardises it: ``rope_scaling`` (when set) or
    ``rope_parameters`` first, then top-level ``rope_theta`` / ``partial_rotary_factor``,
    then the defaults (10000, and 0.25 for Qwen3-Next)."""
    name = "rope_scaling" if fields.raw.get("rope_scaling") else "rope_parameters"
    params = fields.get(name, {})
    if not isinstance(params, dict):
        raise fields.error(name, "must be a mapping")
    if any(isinstance(v, dict) for v in params.values()):
        raise fields.error(name, "per-layer-type RoPE parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise fields.error(name, f"rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", fields.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", fields.get("partial_rotary_factor", 0.25))
    for key, value in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise CheckpointError(f"{fields.source}: {key}={value!r}: must be a positive "
                                  "number")
    rotary_dim = int(head_dim * partial)
    if partial > 1 or rotary_dim < 2 or rotary_dim % 2:
        raise CheckpointError(f"{fields.source}: partial_rotary_factor={partial!r}: RoPE "
                              f"would turn {rotary_dim} of head_dim {head_dim} dims; it "
                              "must be an even number, at least 2 and at most head_dim")
    return {"rope_theta": float(theta), "rotary_dim": rotary_dim}


# --------------------------------------------------------------------------- blocks

class RMSNorm(nn.Module):
    """Qwen3-Next's zero-centred RMSNorm: ``norm(x) * (1 + weight)``, all in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The DeltaNet output norm: ``weight * norm(x) * silu(gate)`` (weight not
    zero-centred), normalised in float32, scaled in the model's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for the first ``rotary_dim`` dims of each head."""

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__()
        dim = args.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        self.register_buffer("inv_freq", 1.0 / (args.rope_theta ** exponents), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin ``[T, 1, rotary_dim]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of ``x [T, heads, head_dim]``; the rest
    pass through."""
    dim = cos.shape[-1]
    turned, kept = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    return torch.cat((turned * cos + rotated * sin, kept), dim=-1)


class GatedAttention(nn.Module):
    """Softmax attention whose output each head gates by ``sigmoid`` of a second half of
    ``q_proj``; q/k RMSNorm per head; partial RoPE."""

    def __init__(self, args: Qwen3NextArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, args.head_dim
        heads, kv, d, bias = (args.num_attention_heads, args.num_key_value_heads,
                              args.hidden_size, args.attention_bias)
        self.q_proj = nn.Linear(d, heads * args.head_dim * 2, bias=bias)  # query, gate
        self.k_proj = nn.Linear(d, kv * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, kv * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * args.head_dim, d, bias=bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx: MixerContext) -> Tensor:
        t, hd = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(t, -1, 2 * hd).chunk(2, dim=-1)  # per head: q | gate
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, -1, hd))
        v = self.v_proj(x).view(t, -1, hd)
        cos, sin = rope
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v).reshape(t, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


# --------------------------------------------------------------------------- Gated DeltaNet

def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           state: Tensor, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """One sequence's tokens through the gated delta rule in chunks (the WY form), from
    ``state [H, dk, dv]``. float32 ``q``/``k [H, n, dk]`` (normalised, q scaled),
    ``v [H, n, dv]``, ``g``/``beta [H, n]`` -> outputs ``[H, n, dv]``, the final state.

    Padding to whole chunks adds tokens with k = v = 0 and g = 0: they change nothing."""
    n = q.shape[1]
    pad = -n % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, chunks = q.shape[0], (n + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.view(heads, chunks, chunk, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    g = g.view(heads, chunks, chunk).cumsum(-1)  # log decay from the chunk's start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its unit lower triangle is solved
    intra = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None],
                                              upper=False, unitriangular=True)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = values.new_empty(values.shape)  # contiguous (the solver's may not be)
    for i in range(chunks):
        v_new = values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.view(heads, chunks * chunk, -1)[:, :n], state


def recurrent_gated_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """One token of each of B sequences: float32 ``q``/``k [B, H, dk]`` (normalised, q
    scaled), ``v [B, H, dv]``, ``g``/``beta [B, H]``, ``state [B, H, dk, dv]`` -> outputs
    ``[B, H, dv]``, the new states (``inplace``: in ``state``'s memory; the same values,
    two state-sized allocations fewer)."""
    decay = g.exp()[..., None, None]
    state = state.mul_(decay) if inplace else state * decay
    remembered = (state * k[..., None]).sum(dim=-2)
    delta = (v - remembered) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(dim=-2), state


@dataclass
class _Rows:
    """How a step's items split for the recurrent layers (the same for all of them): the
    one-token items run together, each longer one on its own."""

    singles: list[int]  # indices of the one-token items
    single_items: Tensor | None  # the same on the device; None when every item is one
    single_rows: Tensor | None  # their token rows
    runs: list[int]  # indices of the longer items


def _split_rows(bounds: list[tuple[int, int]], device: torch.device) -> _Rows:
    singles = [i for i, (a, e) in enumerate(bounds) if e - a == 1]
    runs = [i for i, (a, e) in enumerate(bounds) if e - a > 1]
    index = None if len(singles) in (0, len(bounds)) else \
        torch.tensor(singles, dtype=torch.long, device=device)
    rows = torch.tensor([bounds[i][0] for i in singles], dtype=torch.long, device=device) \
        if singles else None
    return _Rows(singles, index, rows, runs)


class GatedDeltaNet(nn.Module):
    def __init__(self, args: Qwen3NextArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_k_heads, self.num_v_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.kernel = args.linear_conv_kernel_dim
        conv_dim = args.conv_dim
        d = args.hidden_size
        self.in_proj_qkvz = nn.Linear(d, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.kernel, groups=conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The conv input ``[T, conv_dim]`` (q, k, v of all heads, in that order), z
        ``[T, Hv, dv]``, b and a ``[T, Hv]``: the stored projections interleave them per
        key head group (q, k, then the group's v and z; b then a)."""
        t, groups = x.shape[0], self.num_k_heads
        per = self.num_v_heads // groups
        qkvz = self.in_proj_qkvz(x).view(t, groups, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, per * self.head_v_dim,
                                 per * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, groups, 2 * per).split([per, per], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return (mixed, z.reshape(t, self.num_v_heads, self.head_v_dim),
                b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads))

    def convolve(self, x: Tensor, conv: Tensor) -> tuple[Tensor, Tensor]:
        """Causal depthwise conv + silu over ``x [B, C, n]`` after ``conv [B, C, K-1]``
        (the inputs before them) -> ``[B, C, n]`` and the last K-1 inputs."""
        full = torch.cat((conv.to(x.dtype), x), dim=-1)
        weight = self.conv1d.weight
        out = F.conv1d(full.to(weight.dtype), weight, groups=full.shape[1])
        return F.silu(out).to(x.dtype), full[..., -(self.kernel - 1):]

    def heads(self, mixed: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
        """The conv output ``[.., conv_dim]`` as float32 q, k ``[.., Hv, dk]`` (each key
        head repeated for its value heads, l2-normalised; q not yet scaled) and v
        ``[.., Hv, dv]``; g and beta as float32."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        per = self.num_v_heads // self.num_k_heads
        q = q.unflatten(-1, (self.num_k_heads, self.head_k_dim)).repeat_interleave(per, dim=-2)
        k = k.unflatten(-1, (self.num_k_heads, self.head_k_dim)).repeat_interleave(per, dim=-2)
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        return l2norm(q.float()), l2norm(k.float()), v.float(), g.float(), beta.float()

    def forward(self, x: Tensor, rows: _Rows, ctx: MixerContext) -> Tensor:
        t = x.shape[0]
        mixed, z, b, a = self.project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        states = ctx.read_states(self.layer)
        conv, rec = states["conv"], states["recurrent"]  # float32 [B, ...]: updated in place
        every = bool(rows.singles) and rows.single_items is None  # all items one token each
        core = None if every else torch.empty(t, self.num_v_heads, self.head_v_dim,
                                              dtype=torch.float32, device=x.device)
        if rows.singles:  # one token each, together: the recurrence
            r, items = rows.single_rows, rows.single_items
            if every:  # their token rows are all the rows, in order: nothing to gather
                m, g_r, beta_r, conv_in, rec_in = mixed, g, beta, conv, rec
            else:
                m, g_r, beta_r, conv_in, rec_in = mixed[r], g[r], beta[r], conv[items], rec[items]
            conv_out, conv_new = self.convolve(m[:, :, None], conv_in)
            q, k, v, g_r, beta_r = self.heads(conv_out[:, :, 0], g_r, beta_r)
            out, rec_new = recurrent_gated_delta_step(q / self.head_k_dim ** 0.5, k, v, g_r,
                                                      beta_r, rec_in, inplace=True)
            if every:
                core, conv, rec = out, conv_new, rec_new
            else:
                core[r] = out
                conv[items], rec[items] = conv_new.to(conv.dtype), rec_new
        for i in rows.runs:  # a prefill chunk: the chunked form
            start, end = ctx.bounds[i]
            conv_out, conv_new = self.convolve(mixed[start:end].T[None], conv[i:i + 1])
            conv[i] = conv_new[0]
            q, k, v, g_r, beta_r = self.heads(conv_out[0].T, g[start:end], beta[start:end])
            out, rec[i] = chunk_gated_delta_rule(
                (q * self.head_k_dim ** -0.5).transpose(0, 1), k.transpose(0, 1),
                v.transpose(0, 1), g_r.T, beta_r.T, rec[i])
            core[start:end] = out.transpose(0, 1)
        ctx.write_states(self.layer, {"conv": conv, "recurrent": rec})
        out = self.norm(core.to(x.dtype).view(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.view(t, self.value_dim))


# --------------------------------------------------------------------------- MLPs

class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """The routed experts' weights stacked as transformers' ``Qwen3NextExperts`` holds them:
    ``gate_up_proj [E, 2I, D]`` (each expert's gate rows, then its up rows) and
    ``down_proj [E, D, I]``, built at load from the checkpoint's per-expert
    ``experts.<e>.{gate,up,down}_proj.weight`` (``Qwen3NextForCausalLM.checkpoint_tensor``).
    Run with grouped matmuls (``moe.routed_experts``), as transformers' default
    ``grouped_mm`` experts."""

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__()
        e, d, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        return routed_experts(x, experts, weights, self.gate_up_proj, self.down_proj, swiglu)


class SparseMoeBlock(nn.Module):
    """Routed experts (softmax over ``gate``'s logits in float32, top-k, renormalised when
    ``norm_topk_prob``) plus a shared expert scaled by ``sigmoid(shared_expert_gate)``."""

    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__()
        d = args.hidden_size
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(d, args.num_experts, bias=False)  # the router
        self.experts = Experts(args)
        self.shared_expert = MLP(d, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(d, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, chosen, weights.to(logits.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared


# --------------------------------------------------------------------------- the model

class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3NextArgs, layer: int) -> None:
        super().__init__()
        self.kind = args.layer_types[layer]
        if self.kind == "linear":
            self.linear_attn = GatedDeltaNet(args, layer)
        else:
            self.self_attn = GatedAttention(args, layer)
        self.mlp = SparseMoeBlock(args) if args.moe_layers[layer] \
            else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor], rows: _Rows,
                ctx: MixerContext) -> Tensor:
        x = self.input_layernorm(h)
        if self.kind == "linear":
            h = h + self.linear_attn(x, rows, ctx)
        else:
            h = h + self.self_attn(x, rope, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(nn.Module):
    def __init__(self, args: Qwen3NextArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args)

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        h = self.embed_tokens(tokens)
        rope = self.rotary_emb(positions, h.dtype)
        rows = _split_rows(ctx.bounds, h.device)
        for layer in self.layers:
            h = layer(h, rope, rows, ctx)
        return h


class Qwen3NextForCausalLM(nn.Module):
    """A ``PagedLM``; ``spec``: an ``AttentionSpec`` per full-attention layer, a
    ``RecurrentSpec`` (conv, recurrent) per Gated DeltaNet layer."""

    IGNORED_TENSORS = (r"mtp\..*",)  # the multi-token-prediction head

    def __init__(self, args: Qwen3NextArgs, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.model = Qwen3NextModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        recurrent = RecurrentSpec((
            StateSpec("conv", (args.conv_dim, args.linear_conv_kernel_dim - 1)),
            StateSpec("recurrent", (args.linear_num_value_heads, args.linear_key_head_dim,
                                    args.linear_value_head_dim))))
        attention = AttentionSpec(args.num_key_value_heads, args.head_dim)
        self.spec = ModelSpec(
            tuple(recurrent if kind == "linear" else attention for kind in args.layer_types),
            max_model_len=args.max_position_embeddings, vocab_size=args.vocab_size,
            dtype=dtype)

    @staticmethod
    def parse_config(raw: dict[str, Any], source: str = "config.json") -> Qwen3NextArgs:
        return parse_qwen3_next_config(raw, source)

    def checkpoint_tensor(self, name: str) -> tuple[tuple[str, ...], Any]:
        """The stacked experts' ``gate_up_proj`` / ``down_proj``: from the per-expert
        ``experts.<e>.gate_proj`` and ``up_proj`` (stacked, then concatenated) /
        ``down_proj`` weights, as checkpoints (and transformers' ``save_pretrained``) store
        them."""
        match = _EXPERTS.fullmatch(name)
        if match is None:
            return (name,), None
        projections = ("gate_proj", "up_proj") if match[2] == "gate_up_proj" else ("down_proj",)
        return stacked_sources(match[1], projections, self.args.num_experts)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        return self.model(tokens, positions, ctx)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(hidden))
