"""LFM2 on paged KV and recurrent pages, as transformers' ``modeling_lfm2.py``.

Liquid's hybrid: most layers are a gated short convolution (``Lfm2ShortConv``: in_proj to
B, C, x; ``y = C * conv(B * x)`` with a depthwise causal convolution of ``conv_L_cache``
taps), the rest softmax attention with RMSNorm over each head of q and k. A convolution
layer's history is its last ``conv_L_cache - 1`` inputs ``B * x``: that is its whole state
(``RecurrentSpec`` ``conv``), so a sequence resumes exactly from a snapshot of it. Every
layer has a SwiGLU feed-forward (``w1``, ``w3``, ``w2``) behind ``ffn_norm``; the final norm
is ``embedding_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionSpec, MixerContext, ModelSpec, RecurrentSpec, StateSpec
from .config import CheckpointError, RopeConfig, _Fields, _rope
from .llama import RMSNorm, RotaryEmbedding, apply_rotary

LAYER_TYPES = ("conv", "full_attention")


@dataclass(frozen=True)
class Lfm2Args:
    """What ``Lfm2ForCausalLM`` needs from ``config.json`` (transformers' ``Lfm2Config``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the feed-forward, after transformers' adjustment
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    layer_types: tuple[str, ...]
    conv_kernel: int  # conv_L_cache
    conv_bias: bool
    tie_word_embeddings: bool
    dtype: str | None = None


def parse_config(raw: dict[str, Any], source: str = "config.json") -> Lfm2Args:
    fields = _Fields(raw, source)
    if raw.get("quantization_config") is not None:
        raise fields.error("quantization_config", "quantized checkpoints are not supported")
    n = fields.int("num_hidden_layers", 32)
    heads = fields.int("num_attention_heads", 32)
    hidden = fields.int("hidden_size", 2560)
    kv_heads = fields.int("num_key_value_heads", 8)
    if heads % kv_heads or hidden % heads:
        raise CheckpointError(f"{source}: hidden_size {hidden}, num_attention_heads {heads} "
                              f"and num_key_value_heads {kv_heads} must divide evenly")
    max_len = fields.int("max_position_embeddings", 128_000)
    if raw.get("rope_parameters") is None and raw.get("rope_theta") is None:
        raw = {**raw, "rope_theta": 1_000_000.0}  # Lfm2Config's default theta
        fields = _Fields(raw, source)
    tie = fields.bool("tie_embedding", True) if "tie_embedding" in raw \
        else fields.bool("tie_word_embeddings", True)
    return Lfm2Args(
        architecture="Lfm2ForCausalLM",
        vocab_size=fields.int("vocab_size", 65536),
        hidden_size=hidden,
        intermediate_size=_feed_forward_size(fields),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        norm_eps=fields.float("norm_eps", 1e-5),
        max_position_embeddings=max_len,
        rope=_rope(fields, max_len),
        layer_types=_layer_types(fields, n),
        conv_kernel=_conv_kernel(fields),
        conv_bias=fields.bool("conv_bias", False),
        tie_word_embeddings=tie,
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _feed_forward_size(fields: _Fields) -> int:
    """``intermediate_size`` (or ``block_ff_dim``), adjusted as ``Lfm2MLP`` does: 2/3 of
    it, times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``."""
    size = fields.int("block_ff_dim", None) or fields.int("intermediate_size", 12288)
    if not fields.bool("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = fields.get("block_ffn_dim_multiplier", 1.0)
    if "block_ffn_dim_multiplier" in fields.raw and fields.raw["block_ffn_dim_multiplier"] is None:
        return size
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
        raise fields.error("block_ffn_dim_multiplier", "must be a number or null")
    multiple = fields.int("block_multiple_of", 256)
    size = int(multiplier * size)
    return multiple * ((size + multiple - 1) // multiple)


def _conv_kernel(fields: _Fields) -> int:
    kernel = fields.int("conv_L_cache", 3)
    if kernel < 2:
        raise fields.error("conv_L_cache", "must be at least 2 (a convolution over earlier "
                                           "tokens)")
    return kernel


def _layer_types(fields: _Fields, n: int) -> tuple[str, ...]:
    types = fields.get("layer_types")
    if types is None:
        full = fields.get("full_attn_idxs")
        full = list(range(n)) if full is None else full
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES
                                                             for t in types):
        raise fields.error("layer_types", f"must list {n} entries of {list(LAYER_TYPES)}")
    return tuple(types)


class Lfm2Attention(nn.Module):
    def __init__(self, args: Lfm2Args, layer: int) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, args.head_dim
        q_dim = args.num_attention_heads * args.head_dim
        kv_dim = args.num_key_value_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=False)
        self.out_proj = nn.Linear(q_dim, args.hidden_size, bias=False)
        self.q_layernorm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_layernorm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx: MixerContext) -> Tensor:
        t = x.shape[0]
        q = self.q_layernorm(self.q_proj(x).view(t, -1, self.head_dim))
        k = self.k_layernorm(self.k_proj(x).view(t, -1, self.head_dim))
        v = self.v_proj(x).view(t, -1, self.head_dim)
        cos, sin = rope
        out = ctx.attend(self.layer, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.out_proj(out.reshape(t, -1))


class Lfm2ShortConv(nn.Module):
    """``y = out_proj(C * conv(B * x))``; the convolution sees the layer's last
    ``kernel - 1`` inputs from the state before this step's tokens."""

    def __init__(self, args: Lfm2Args, layer: int) -> None:
        super().__init__()
        self.layer, self.kernel = layer, args.conv_kernel
        d = args.hidden_size
        self.conv = nn.Conv1d(d, d, kernel_size=args.conv_kernel, groups=d, bias=args.conv_bias,
                              padding=args.conv_kernel - 1)
        self.in_proj = nn.Linear(d, 3 * d, bias=args.conv_bias)
        self.out_proj = nn.Linear(d, d, bias=args.conv_bias)

    def forward(self, x: Tensor, ctx: MixerContext) -> Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)  # [T, D] each
        bx = b * h
        past = ctx.read_states(self.layer)["conv"]  # [B, D, kernel - 1], oldest first
        weight = self.conv.weight  # [D, 1, kernel]
        outs, states = [], []
        for i, (a, e) in enumerate(ctx.bounds):
            window = torch.cat([past[i].to(bx.dtype), bx[a:e].T], dim=1)  # [D, k-1+n]
            outs.append(F.conv1d(window[None], weight, self.conv.bias,
                                 groups=weight.shape[0])[0].T)  # [n, D]
            states.append(window[:, -(self.kernel - 1):])
        ctx.write_states(self.layer, {"conv": torch.stack(states)})
        return self.out_proj(c * torch.cat(outs))


class Lfm2MLP(nn.Module):
    def __init__(self, args: Lfm2Args) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, args: Lfm2Args, layer: int) -> None:
        super().__init__()
        self.is_attention = args.layer_types[layer] == "full_attention"
        if self.is_attention:
            self.self_attn = Lfm2Attention(args, layer)
        else:
            self.conv = Lfm2ShortConv(args, layer)
        self.feed_forward = Lfm2MLP(args)
        self.operator_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.norm_eps)

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor], ctx: MixerContext) -> Tensor:
        x = self.operator_norm(h)
        h = h + (self.self_attn(x, rope, ctx) if self.is_attention else self.conv(x, ctx))
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2Model(nn.Module):
    def __init__(self, args: Lfm2Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(args, i)
                                    for i in range(args.num_hidden_layers))
        self.embedding_norm = RMSNorm(args.hidden_size, args.norm_eps)  # the final norm
        self.rotary_emb = RotaryEmbedding(args)  # reads args.rope and args.head_dim

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        h = self.embed_tokens(tokens)
        rope = self.rotary_emb(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, rope, ctx)
        return h


class Lfm2ForCausalLM(nn.Module):
    """A ``PagedLM``: attention layers in the full-attention pool, convolution layers'
    states in the recurrent pool."""

    parse_config = staticmethod(parse_config)

    def __init__(self, args: Lfm2Args, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.model = Lfm2Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        conv = RecurrentSpec((StateSpec("conv", (args.hidden_size, args.conv_kernel - 1)),))
        attention = AttentionSpec(args.num_key_value_heads, args.head_dim)
        self.spec = ModelSpec(
            tuple(attention if t == "full_attention" else conv for t in args.layer_types),
            max_model_len=args.max_position_embeddings, vocab_size=args.vocab_size, dtype=dtype)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        return self.model(tokens, positions, ctx)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.model.embedding_norm(hidden))
