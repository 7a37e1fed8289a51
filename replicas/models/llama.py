"""Llama and Mistral on paged KV, layer by layer as transformers' ``modeling_llama.py``.

Module names follow the checkpoints' (``model.layers.3.self_attn.q_proj``), so a
safetensors file loads name for name. Two differences from transformers, both about the
paging: the tokens of all running sequences arrive packed in one ``[T]`` batch, each at its
own absolute position, and attention reads earlier keys/values from a ``MixerContext``
(the engine's pages) instead of a dense cache. Mistral is this model with every layer
sliding (``ModelArgs.layer_types``); Qwen2 and Qwen3 (``qwen2.py``, ``qwen3.py``) change
the attention block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionSpec, MixerContext, ModelSpec
from .config import ModelArgs, RopeConfig, parse_config


class RMSNorm(nn.Module):
    """Normalised in float32, scaled in the model's dtype (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32, CPU) of ``rope``'s type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (rope.theta ** (exponents / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    """Llama 3.1: wavelengths above ``original / low_freq_factor`` slow down by ``factor``,
    those below ``original / high_freq_factor`` stay, the band between is interpolated."""
    old = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                       - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(args.rope, args.head_dim),
                             persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin ``[T, 1, head_dim]`` at absolute ``positions [T]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on ``x [T, heads, head_dim]``."""
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, args.head_dim
        q_dim = args.num_attention_heads * args.head_dim
        kv_dim = args.num_key_value_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=args.o_bias)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q ``[T, H, hd]``, k and v ``[T, KV, hd]`` before RoPE."""
        t = x.shape[0]
        return (self.q_proj(x).view(t, -1, self.head_dim),
                self.k_proj(x).view(t, -1, self.head_dim),
                self.v_proj(x).view(t, -1, self.head_dim))

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx: MixerContext) -> Tensor:
        q, k, v = self.project(x)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(x.shape[0], -1))


class LlamaMLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        d, f = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=args.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=args.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=args.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, attention: type[LlamaAttention]) -> None:
        super().__init__()
        self.self_attn = attention(args, layer)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor], ctx: MixerContext) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, attention: type[LlamaAttention]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i, attention)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args)

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        """Hidden states ``[T, D]`` before the final norm."""
        h = self.embed_tokens(tokens)
        rope = self.rotary_emb(positions, h.dtype)  # shared by every layer
        for layer in self.layers:
            h = layer(h, rope, ctx)
        return h


class LlamaForCausalLM(nn.Module):
    """A ``PagedLM``. Build it on the meta device and load weights by name
    (``replicas.checkpoint``); with tied embeddings ``lm_head`` is ``embed_tokens``."""

    attention: type[LlamaAttention] = LlamaAttention
    parse_config = staticmethod(parse_config)  # config.json -> ModelArgs (config.py)

    def __init__(self, args: ModelArgs, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, self.attention)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.spec = ModelSpec(
            tuple(AttentionSpec(args.num_key_value_heads, args.head_dim,
                                window=args.sliding_window if kind == "sliding" else None)
                  for kind in args.layer_types),
            max_model_len=args.max_position_embeddings, vocab_size=args.vocab_size,
            dtype=dtype)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        return self.model(tokens, positions, ctx)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(hidden))


class MistralForCausalLM(LlamaForCausalLM):
    """Llama without biases, every layer sliding over ``sliding_window`` (or none when the
    config's window is null): all in ``ModelArgs``."""
