"""Gemma 3 (text) on paged KV, layer by layer as transformers' ``modeling_gemma3.py``
(``Gemma3ForCausalLM``, config ``gemma3_text``).

What differs from Llama:

- layers interleave sliding-window ("local") and full ("global") attention, from
  ``layer_types`` or the older ``sliding_window_pattern`` (every n-th layer full; default 6);
  a sliding layer at position p sees p-W+1..p (transformers' ``kv_idx > q_idx - W``), which
  is ``AttentionSpec.window``'s meaning;
- one RoPE per layer kind: ``rope_parameters`` keyed by layer type (transformers 5), or the
  older ``rope_theta`` (full layers, default 1e6) + ``rope_local_base_freq`` (sliding layers,
  default 1e4) + ``rope_scaling`` (full layers only);
- RMSNorm scales by ``1 + weight``, in float32, cast back after (Llama casts before);
  "sandwich" norms: after attention and around the MLP too; q_norm / k_norm per head;
- the embedding is multiplied by ``sqrt(hidden_size)`` rounded to the model dtype;
- attention scale ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- GeGLU MLP (``hidden_activation``, tanh-approximated GELU);
- optional tanh softcapping of the final logits; tied embeddings by default.

Attention logit softcapping is refused: ``ctx.attend`` has no softcap. (transformers 5's
Gemma 3 does not apply it either: its attention never passes ``attn_logit_softcapping`` on.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionSpec, MixerContext, ModelSpec
from .config import CheckpointError, RopeConfig, _Fields, _rope
from .llama import apply_rotary, rope_inv_freq

ARCHITECTURE = "Gemma3ForCausalLM"
# hidden_activation -> the function transformers' ACT2FN gives for it
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu": F.gelu}
# transformers' layer type names (and the legacy alias it remaps) -> ours
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding",
                "attention": "full"}
_ROPE_KEYS = {"full": "full_attention", "sliding": "sliding_attention"}
# Gemma3TextConfig.default_theta
_DEFAULT_THETA = {"full": 1_000_000.0, "sliding": 10_000.0}


@dataclass(frozen=True)
class Gemma3Args:
    """``config.json`` of a Gemma 3 text model, with transformers' defaults.

    ``layer_types[i]`` is ``"full"`` or ``"sliding"``; ``rope_full`` / ``rope_sliding``
    are the RoPE of each kind; ``sliding_window`` is None when no layer slides.
    """

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
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope_full: RopeConfig
    rope_sliding: RopeConfig
    query_pre_attn_scalar: float
    hidden_activation: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    dtype: str | None = None

    def rope(self, kind: str) -> RopeConfig:
        return self.rope_full if kind == "full" else self.rope_sliding


def parse_gemma3_config(raw: dict[str, Any], source: str = "config.json") -> Gemma3Args:
    """``Gemma3Args`` of a parsed ``config.json``, as ``Gemma3TextConfig`` reads it;
    anything computed otherwise than here is a ``CheckpointError`` naming the field."""
    fields = _Fields(raw, source)
    if raw.get("text_config") is not None:
        raise fields.error("text_config", "a multimodal Gemma3Config; only the text model's "
                                          "config (model_type gemma3_text) is supported")
    _refuse(fields)
    heads = fields.int("num_attention_heads", 8)
    hidden = fields.int("hidden_size", 2304)
    kv_heads = fields.int("num_key_value_heads", 4)
    head_dim = fields.int("head_dim", 256)
    if hidden % heads:  # Gemma3TextConfig.validate_architecture
        raise CheckpointError(f"{source}: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads}")
    if heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise CheckpointError(f"{source}: head_dim {head_dim} must be even for RoPE")
    max_len = fields.int("max_position_embeddings", 131_072)
    n_layers = fields.int("num_hidden_layers", 26)
    kinds = _layer_kinds(fields, n_layers)
    window = fields.window(4096)
    if "sliding" in kinds and window is None:
        raise fields.error("sliding_window", "layer_types has sliding_attention layers but "
                                             "no window")
    act = fields.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise fields.error("hidden_activation",
                           f"only {', '.join(sorted(ACTIVATIONS))} (GeGLU MLP) are supported")
    cap = raw.get("final_logit_softcapping")
    rope_full, rope_sliding = _ropes(fields, max_len)
    return Gemma3Args(
        architecture=ARCHITECTURE,
        vocab_size=fields.int("vocab_size", 262_208),
        hidden_size=hidden,
        intermediate_size=fields.int("intermediate_size", 9216),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=fields.float("rms_norm_eps", 1e-6),
        max_position_embeddings=max_len,
        layer_types=kinds,
        sliding_window=window if "sliding" in kinds else None,
        rope_full=rope_full,
        rope_sliding=rope_sliding,
        query_pre_attn_scalar=fields.float("query_pre_attn_scalar", 256),
        hidden_activation=act,
        attention_bias=fields.bool("attention_bias", False),
        final_logit_softcapping=None if cap is None
        else fields.float("final_logit_softcapping", cap),
        tie_word_embeddings=fields.bool("tie_word_embeddings", True),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _refuse(fields: _Fields) -> None:
    """Fields whose value changes the computation in ways this model does not implement."""
    if fields.raw.get("quantization_config") is not None:
        raise fields.error("quantization_config", "quantized checkpoints are not supported")
    if fields.raw.get("attn_logit_softcapping") is not None:
        raise fields.error("attn_logit_softcapping",
                           "softcapping of attention logits is not supported (paged "
                           "attention has no softcap; transformers 5's Gemma 3 ignores the "
                           "field, so no reference computes it)")
    if fields.raw.get("use_bidirectional_attention"):
        raise fields.error("use_bidirectional_attention",
                           "only causal attention is supported")


def _layer_kinds(fields: _Fields, n_layers: int) -> tuple[str, ...]:
    """``layer_types``, or else every ``sliding_window_pattern``-th layer full."""
    types = fields.raw.get("layer_types")
    if types is None:
        pattern = fields.int("sliding_window_pattern", 6)
        return tuple("sliding" if (i + 1) % pattern else "full" for i in range(n_layers))
    if not isinstance(types, list) or any(t not in _LAYER_TYPES for t in types):
        raise fields.error("layer_types", "entries must be full_attention or "
                                          "sliding_attention")
    if len(types) != n_layers:
        raise fields.error("layer_types", f"has {len(types)} entries for {n_layers} layers "
                                          "(num_hidden_layers)")
    return tuple(_LAYER_TYPES[t] for t in types)


def _ropes(fields: _Fields, max_len: int) -> tuple[RopeConfig, RopeConfig]:
    """The RoPE of full and of sliding layers, as ``Gemma3TextConfig``'s
    ``convert_rope_params_to_dict`` builds them: ``rope_parameters`` per layer type
    (absent: default RoPE for both); an older ``rope_scaling`` updates the full layers'
    entry; missing thetas come from ``rope_theta`` (full) and ``rope_local_base_freq``
    (sliding), else 1e6 and 1e4."""
    params = fields.raw.get("rope_parameters")
    if params is None:
        params = {}
    elif not isinstance(params, dict):
        raise fields.error("rope_parameters", "must be a mapping")
    flat = sorted(set(params) - set(_ROPE_KEYS.values()))
    if flat:
        raise fields.error("rope_parameters", f"keys {flat}: Gemma 3 takes one entry per "
                                              "layer type (full_attention, "
                                              "sliding_attention) and ignores others")
    scaling = fields.raw.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise fields.error("rope_scaling", "must be a mapping")
        if fields.raw.get("rope_parameters") is not None and not isinstance(
                params.get("full_attention"), dict):
            raise fields.error("rope_scaling", "updates rope_parameters.full_attention, "
                                               "which is missing (transformers fails here)")
    thetas = {"full": fields.get("rope_theta", _DEFAULT_THETA["full"]),
              "sliding": fields.get("rope_local_base_freq", _DEFAULT_THETA["sliding"])}
    out = []
    for kind, key in _ROPE_KEYS.items():
        entry = params.get(key)
        if entry is not None and not isinstance(entry, dict):
            raise fields.error("rope_parameters", f"{key} must be a mapping")
        entry = dict(entry or {"rope_type": "default"})
        if kind == "full" and scaling is not None:
            entry.update(scaling)
        if "type" in entry and "rope_type" in entry and entry["type"] != entry["rope_type"]:
            # e.g. rope_scaling {"type": "linear"} over the default entry: transformers 5
            # keeps rope_type "default" (unscaled), transformers 4 read "type" (scaled)
            name = "rope_scaling" if kind == "full" and scaling else "rope_parameters"
            raise fields.error(name, f"{key}: 'type' {entry['type']!r} and 'rope_type' "
                                     f"{entry['rope_type']!r} disagree (transformers 5 "
                                     "uses rope_type, older versions type)")
        entry.setdefault("rope_theta", thetas[kind])
        if fields.raw.get("partial_rotary_factor") is not None:
            entry.setdefault("partial_rotary_factor", fields.raw["partial_rotary_factor"])
        out.append(_rope(_Fields({"rope_parameters": entry},
                                 f"{fields.source}: rope_parameters.{key}"), max_len))
    return out[0], out[1]


# --------------------------------------------------------------------------- the model

class Gemma3RMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in float32, cast to the input's dtype at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Gemma3ScaledEmbedding(nn.Embedding):
    """Embeddings times ``sqrt(hidden_size)``: that float32 number rounded to the weights'
    dtype (in bfloat16 sqrt(3072) = 55.4256 becomes 55.5, as in transformers)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.embed_scale = hidden_size ** 0.5

    def forward(self, tokens: Tensor) -> Tensor:
        h = super().forward(tokens)
        return h * torch.tensor(self.embed_scale, dtype=torch.float32,
                                device=h.device).to(h.dtype)


class Gemma3RotaryEmbedding(nn.Module):
    """One table of inverse frequencies per layer kind the model has."""

    def __init__(self, args: Gemma3Args) -> None:
        super().__init__()
        self.kinds = tuple(sorted(set(args.layer_types)))
        for kind in self.kinds:
            self.register_buffer(f"{kind}_inv_freq", rope_inv_freq(args.rope(kind),
                                                                   args.head_dim),
                                 persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        """kind -> cos, sin ``[T, 1, head_dim]`` at absolute ``positions [T]``."""
        out = {}
        for kind in self.kinds:
            inv_freq = getattr(self, f"{kind}_inv_freq")
            freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
            out[kind] = emb.cos().to(dtype), emb.sin().to(dtype)
        return out


class Gemma3Attention(nn.Module):
    def __init__(self, args: Gemma3Args, layer: int) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, args.head_dim
        q_dim = args.num_attention_heads * args.head_dim
        kv_dim = args.num_key_value_heads * args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=bias)
        self.q_norm = Gemma3RMSNorm(args.head_dim, args.rms_norm_eps)  # over each head
        self.k_norm = Gemma3RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx: MixerContext) -> Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, -1, self.head_dim))
        v = self.v_proj(x).view(t, -1, self.head_dim)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v)  # scale: query_pre_attn_scalar ** -0.5
        return self.o_proj(out.reshape(t, -1))


class Gemma3MLP(nn.Module):
    def __init__(self, args: Gemma3Args) -> None:
        super().__init__()
        d, f = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act = ACTIVATIONS[args.hidden_activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: Gemma3Args, layer: int) -> None:
        super().__init__()
        self.kind = args.layer_types[layer]
        self.self_attn = Gemma3Attention(args, layer)
        self.mlp = Gemma3MLP(args)
        d, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(d, eps)
        self.post_attention_layernorm = Gemma3RMSNorm(d, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(d, eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(d, eps)

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor], ctx: MixerContext) -> Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope,
                                                             ctx))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3TextModel(nn.Module):
    def __init__(self, args: Gemma3Args) -> None:
        super().__init__()
        self.embed_tokens = Gemma3ScaledEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(args, i)
                                    for i in range(args.num_hidden_layers))
        self.norm = Gemma3RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = Gemma3RotaryEmbedding(args)

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        """Hidden states ``[T, D]`` before the final norm."""
        h = self.embed_tokens(tokens)
        ropes = self.rotary_emb(positions, h.dtype)  # one per layer kind
        for layer in self.layers:
            h = layer(h, ropes[layer.kind], ctx)
        return h


class Gemma3ForCausalLM(nn.Module):
    """A ``PagedLM``. Build it on the meta device and load weights by name
    (``replicas.checkpoint``); with tied embeddings ``lm_head`` is ``embed_tokens``."""

    parse_config = staticmethod(parse_gemma3_config)

    def __init__(self, args: Gemma3Args, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.model = Gemma3TextModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        scale = args.query_pre_attn_scalar ** -0.5
        self.spec = ModelSpec(
            tuple(AttentionSpec(args.num_key_value_heads, args.head_dim,
                                window=args.sliding_window if kind == "sliding" else None,
                                scale=scale)
                  for kind in args.layer_types),
            max_model_len=args.max_position_embeddings, vocab_size=args.vocab_size,
            dtype=dtype)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        return self.model(tokens, positions, ctx)

    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(self.model.norm(hidden))
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
