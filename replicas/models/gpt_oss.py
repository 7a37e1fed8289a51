"""GPT-OSS on paged KV, layer by layer as transformers' ``modeling_gpt_oss.py``.

What sets it apart from Llama:

- attention: q/k/v/o projections with biases (``attention_bias``), layers alternating
  sliding-window (``sliding_window``, 128 in the released models) and full attention as
  ``layer_types`` says, and a learned sink per head: a logit that joins every softmax and
  carries no value (``AttentionSpec(sinks=True)``; ``ctx.attend(..., sinks=...)``);
- RoPE: YaRN (``rope_type`` "yarn": frequencies blended between extrapolation and
  interpolation by ``factor``, ``beta_fast``, ``beta_slow``, ``original_max_position_embeddings``
  and ``truncate``; cos and sin multiplied by the attention factor), applied to the two
  halves of each head;
- MLP: a mixture of experts. A router (linear with bias) picks ``num_experts_per_tok`` of
  ``num_local_experts`` experts per token, weighted by a softmax over the chosen logits;
  each expert is a clamped SwiGLU with biases, its gate and up projections fused and
  interleaved (``gate_up_proj[..., 0::2]`` gate, ``[..., 1::2]`` up), stored as transformers
  stores them (``gate_up_proj [E, D, 2F]``, ``down_proj [E, F, D]`` and their biases); the
  experts run in two grouped matmuls (``moe.py``), as transformers' default;
- MXFP4 checkpoints (``quantization_config.quant_method`` "mxfp4", the released ones): the
  experts' projections are stored as ``*_blocks`` (two FP4 E2M1 values a byte, 32 a block)
  and ``*_scales`` (an E8M0 exponent a block) and dequantized at load
  (``checkpoint_tensor``), as transformers' ``integrations.mxfp4`` dequantizes them.

Config parsing is this file's (``GptOssArgs``, ``parse_config``), with transformers'
``GptOssConfig`` defaults; fields it would compute differently are refused by name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionSpec, MixerContext, ModelSpec
from .config import LAYER_TYPES, CheckpointError, _Fields
from .moe import routed_experts

ARCHITECTURE = "GptOssForCausalLM"
ROPE_TYPES = ("default", "yarn")
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
# GptOssConfig's rope_parameters when config.json has none.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
# E2M1 code -> value; the high bit is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
_EXPERT_PROJ = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


@dataclass(frozen=True)
class GptOssRope:
    """``rope_type`` "default" (theta only) or "yarn" (the rest)."""

    rope_type: str = "yarn"
    theta: float = DEFAULT_THETA
    factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: from factor (and mscale, mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class GptOssArgs:
    """What ``GptOssForCausalLM`` needs from ``config.json``. ``layer_types[i]`` is "full"
    or "sliding". ``mxfp4``: the experts are stored MXFP4-packed, except those of the
    modules ``mxfp4_skip`` names (``modules_to_not_convert``)."""

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
    rope: GptOssRope
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_bias: bool
    num_local_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float
    tie_word_embeddings: bool = False
    dtype: str | None = None
    mxfp4: bool = False
    mxfp4_skip: tuple[str, ...] = ()


# --------------------------------------------------------------------------- config.json

def parse_config(raw: dict[str, Any], source: str = "config.json") -> GptOssArgs:
    """``GptOssArgs`` of a parsed ``config.json``, with ``GptOssConfig``'s defaults."""
    fields = _Fields(raw, source)
    if raw.get("architectures") != [ARCHITECTURE]:
        raise CheckpointError(f"{source}: 'architectures' must be [{ARCHITECTURE!r}], got "
                              f"{raw.get('architectures')!r}")
    hidden = fields.int("hidden_size", 2880)
    heads = fields.int("num_attention_heads", 64)
    # GptOssConfig: absent -> its default, null -> derived
    kv_heads = fields.int("num_key_value_heads", 8 if "num_key_value_heads" not in raw
                          else heads)
    head_dim = fields.int("head_dim", 64 if "head_dim" not in raw else hidden // heads)
    if heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise CheckpointError(f"{source}: head_dim {head_dim} must be even for RoPE")
    n_layers = fields.int("num_hidden_layers", 36)
    layer_types = _layer_types(fields, n_layers)
    window = None if raw.get("sliding_window", 128) is None else fields.int("sliding_window",
                                                                            128)
    if "sliding" in layer_types and window is None:
        raise fields.error("sliding_window", "layer_types names sliding_attention layers but "
                                             "sliding_window is null")
    experts = fields.int("num_local_experts", 128)
    top_k = fields.int("num_experts_per_tok", 4)
    if top_k > experts:
        raise fields.error("num_experts_per_tok", f"more than num_local_experts ({experts})")
    max_len = fields.int("max_position_embeddings", 131072)
    mxfp4, skip = _quantization(fields)
    return GptOssArgs(
        architecture=ARCHITECTURE,
        vocab_size=fields.int("vocab_size", 201088),
        hidden_size=hidden,
        intermediate_size=fields.int("intermediate_size", 2880),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=fields.float("rms_norm_eps", 1e-5),
        max_position_embeddings=max_len,
        rope=_rope(fields, max_len),
        layer_types=layer_types,
        sliding_window=window if "sliding" in layer_types else None,
        attention_bias=fields.bool("attention_bias", True),
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        swiglu_alpha=fields.float("swiglu_alpha", 1.702),
        swiglu_limit=fields.float("swiglu_limit", 7.0),
        tie_word_embeddings=fields.bool("tie_word_embeddings", False),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
        mxfp4=mxfp4,
        mxfp4_skip=skip,
    )


def _layer_types(fields: _Fields, n_layers: int) -> tuple[str, ...]:
    """``layer_types``, or GptOssConfig's default: even layers slide, odd ones are full."""
    types = fields.raw.get("layer_types")
    if types is None:
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(n_layers))
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise fields.error("layer_types", f"entries must be one of {sorted(LAYER_TYPES)}")
    if len(types) != n_layers:
        raise fields.error("layer_types", f"{len(types)} entries for {n_layers} layers "
                                          "(num_hidden_layers)")
    return tuple(LAYER_TYPES[t] for t in types)


def _quantization(fields: _Fields) -> tuple[bool, tuple[str, ...]]:
    """Only MXFP4 (the experts packed, dequantized at load) is taken."""
    config = fields.raw.get("quantization_config")
    if config is None:
        return False, ()
    if not isinstance(config, dict):
        raise fields.error("quantization_config", "must be a mapping")
    method = config.get("quant_method")
    if method != "mxfp4":
        raise CheckpointError(f"{fields.source}: quantization_config.quant_method={method!r}: "
                              "only 'mxfp4' (GPT-OSS experts, dequantized at load) is "
                              "supported")
    skip = config.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise CheckpointError(f"{fields.source}: quantization_config.modules_to_not_convert="
                              f"{skip!r}: must be a list of module names")
    return True, tuple(skip)


def _rope(fields: _Fields, max_position_embeddings: int) -> GptOssRope:
    """As ``GptOssConfig`` standardises it: ``rope_scaling`` (older configs) or else
    ``rope_parameters`` (GptOssConfig's YaRN when absent); ``rope_theta`` at the top level
    or 150000; ``original_max_position_embeddings`` at the top level wins, else the one in
    the parameters, else ``max_position_embeddings``."""
    name = "rope_scaling" if fields.raw.get("rope_scaling") else "rope_parameters"
    params = fields.raw.get(name)
    if params is None:
        params = DEFAULT_ROPE
    if not isinstance(params, dict):
        raise fields.error(name, "must be a mapping")
    if any(isinstance(v, dict) for v in params.values()):
        raise fields.error(name, "per-layer-type RoPE parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{fields.source}: {name}: rope_type {rope_type!r} is not "
                              f"supported; supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", fields.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"{fields.source}: partial_rotary_factor {partial!r}: only 1.0 "
                              "(RoPE on the whole head) is supported")
    theta = params.get("rope_theta", fields.get("rope_theta", DEFAULT_THETA))
    if rope_type == "default":
        return GptOssRope("default", _number(fields, name, "rope_theta", theta))
    if "factor" not in params:
        raise CheckpointError(f"{fields.source}: {name}: rope_type 'yarn' needs factor")
    original = fields.get("original_max_position_embeddings",
                          params.get("original_max_position_embeddings", max_position_embeddings))
    original = _number(fields, name, "original_max_position_embeddings", original)
    factor = params["factor"]
    factor = max_position_embeddings / original if factor is None else factor
    optional = {key: None if params.get(key) is None
                else _number(fields, name, key, params[key])
                for key in ("attention_factor", "mscale", "mscale_all_dim")}
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise CheckpointError(f"{fields.source}: {name}: truncate={truncate!r}: must be true "
                              "or false")
    return GptOssRope(
        "yarn", _number(fields, name, "rope_theta", theta),
        _number(fields, name, "factor", factor), int(original),
        # transformers: `get("beta_fast") or 32`, so a 0 is the default too
        _number(fields, name, "beta_fast", params.get("beta_fast") or 32),
        _number(fields, name, "beta_slow", params.get("beta_slow") or 1),
        truncate, **optional)


def _number(fields: _Fields, name: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CheckpointError(f"{fields.source}: {name}: {key}={value!r}: must be a positive "
                              "number")
    return float(value)


# --------------------------------------------------------------------------- RoPE

def rope_parameters(rope: GptOssRope, head_dim: int) -> tuple[Tensor, float]:
    """Inverse frequencies ``[head_dim / 2]`` (float32, CPU) and the factor on cos and sin,
    as transformers' ``_compute_yarn_parameters`` (or the default RoPE) computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    pos_freqs = rope.theta ** (exponents / head_dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    low, high = _yarn_correction_range(rope, head_dim)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low ones)
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, _yarn_attention_factor(rope)


def _yarn_correction_range(rope: GptOssRope, dim: int) -> tuple[float, float]:
    """The dimensions where ``beta_fast`` and ``beta_slow`` rotations fit in the original
    context: below ``low`` RoPE extrapolates, above ``high`` it interpolates."""
    def dim_of(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))
    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_attention_factor(rope: GptOssRope) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


class GptOssRotaryEmbedding(nn.Module):
    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_parameters(args.rope, args.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin ``[T, 1, head_dim / 2]`` at absolute ``positions [T]``, scaled by the
        attention factor."""
        freqs = positions.to(torch.float32)[:, None, None] * self.inv_freq
        return ((freqs.cos() * self.attention_scaling).to(dtype),
                (freqs.sin() * self.attention_scaling).to(dtype))


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on ``x [T, heads, head_dim]``: the first half of each head against the second."""
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


# --------------------------------------------------------------------------- layers

class GptOssRMSNorm(nn.Module):
    """Normalised and scaled in float32, then cast (transformers keeps these in float32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * h).to(x.dtype)


class GptOssAttention(nn.Module):
    def __init__(self, args: GptOssArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, args.head_dim
        q_dim = args.num_attention_heads * args.head_dim
        kv_dim = args.num_key_value_heads * args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(args.num_attention_heads))

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx: MixerContext) -> Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, -1, self.head_dim)
        k = self.k_proj(x).view(t, -1, self.head_dim)
        v = self.v_proj(x).view(t, -1, self.head_dim)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v, sinks=self.sinks)
        return self.o_proj(out.reshape(t, -1))


class GptOssTopKRouter(nn.Module):
    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(args.num_local_experts, args.hidden_size))
        self.bias = nn.Parameter(torch.empty(args.num_local_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's experts ``[T, k]`` and their weights ``[T, k]`` (a softmax over the
        chosen logits)."""
        logits = F.linear(x, self.weight, self.bias)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return experts, torch.softmax(top, dim=-1, dtype=top.dtype)


class GptOssExperts(nn.Module):
    """The experts' clamped SwiGLU, parameters laid out as transformers' ``GptOssExperts``:
    ``x @ gate_up_proj[e] + gate_up_proj_bias[e]`` gives gate (even columns) and up (odd)."""

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        e, d, f = args.num_local_experts, args.hidden_size, args.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, d, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(e, f, d))
        self.down_proj_bias = nn.Parameter(torch.empty(e, d))
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit

    def gate(self, gate_up: Tensor) -> Tensor:
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """``x [T, D]``, each token's ``experts`` and ``weights [T, k]`` -> ``[T, D]``: the
        weighted sum of its experts' outputs, in two grouped matmuls over the experts
        (``moe.routed_experts``), as transformers' default ``grouped_mm`` experts."""
        return routed_experts(x, experts, weights, self.gate_up_proj, self.down_proj,
                              self.gate, self.gate_up_proj_bias, self.down_proj_bias,
                              transposed=True)


class GptOssMLP(nn.Module):
    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        self.router = GptOssTopKRouter(args)
        self.experts = GptOssExperts(args)

    def forward(self, x: Tensor) -> Tensor:
        experts, weights = self.router(x)
        return self.experts(x, experts, weights)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, args: GptOssArgs, layer: int) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(args, layer)
        self.mlp = GptOssMLP(args)
        self.input_layernorm = GptOssRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor], ctx: MixerContext) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssModel(nn.Module):
    def __init__(self, args: GptOssArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(args, i)
                                    for i in range(args.num_hidden_layers))
        self.norm = GptOssRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = GptOssRotaryEmbedding(args)

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        """Hidden states ``[T, D]`` before the final norm."""
        h = self.embed_tokens(tokens)
        rope = self.rotary_emb(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, rope, ctx)
        return h


class GptOssForCausalLM(nn.Module):
    """A ``PagedLM``. Build it on the meta device and load weights by name
    (``replicas.checkpoint``); MXFP4 experts through ``checkpoint_tensor``."""

    parse_config = staticmethod(parse_config)

    def __init__(self, args: GptOssArgs, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.model = GptOssModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.spec = ModelSpec(
            tuple(AttentionSpec(args.num_key_value_heads, args.head_dim,
                                window=args.sliding_window if kind == "sliding" else None,
                                sinks=True)
                  for kind in args.layer_types),
            max_model_len=args.max_position_embeddings, vocab_size=args.vocab_size,
            dtype=dtype)

    def checkpoint_tensor(self, name: str) -> tuple[tuple[str, ...], Any]:
        """An MXFP4 checkpoint's experts ``gate_up_proj`` / ``down_proj``: from
        ``<name>_blocks`` and ``<name>_scales`` (unless ``modules_to_not_convert`` keeps that
        layer's experts dense, as transformers decides it)."""
        match = _EXPERT_PROJ.fullmatch(name)
        if (self.args.mxfp4 and match
                and mxfp4_converts(f"model.layers.{match[1]}.mlp.experts", self.args.mxfp4_skip)):
            return (f"{name}_blocks", f"{name}_scales"), dequantize_mxfp4
        return (name,), None

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        return self.model(tokens, positions, ctx)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(hidden))


# --------------------------------------------------------------------------- MXFP4

def mxfp4_converts(module: str, skip: tuple[str, ...]) -> bool:
    """Whether transformers quantizes ``module`` given ``modules_to_not_convert``: a pattern
    skips it when it matches from the start up to a module boundary (as a regex) or is a
    suffix of the name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key)
                   for key in skip)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """Experts' weights ``[E, in, out]`` (float32) of MXFP4 ``blocks [E, out, G, 16]``
    (uint8: the low nibble is the even element, the high one the odd) and ``scales
    [E, out, G]`` (uint8 E8M0: 2 ** (s - 127) for each block of 32 inputs)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                              f"{scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks {list(blocks.shape)} do not match scales "
                              f"{list(scales.shape)} (blocks [E, out, G, 16], scales "
                              "[E, out, G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    e, rows, groups, width = blocks.shape
    out = torch.empty(e, groups * width * 2, rows, dtype=torch.float32, device=blocks.device)
    for i in range(e):  # an expert at a time: the intermediates of one, not of all
        codes = blocks[i].long()
        values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).flatten(-2)
        exponents = scales[i].to(torch.int32)[..., None] - E8M0_BIAS
        out[i] = torch.ldexp(values, exponents).flatten(-2).T
    return out
