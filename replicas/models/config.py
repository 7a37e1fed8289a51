"""A Hugging Face ``config.json`` read into one frozen ``ModelArgs``, as transformers reads it.

Each architecture's rules mirror its ``configuration_*.py`` in transformers 5: its defaults,
how Qwen2/Qwen3 derive ``layer_types`` from ``use_sliding_window`` / ``max_window_layers``,
which projections carry biases. RoPE comes from ``rope_parameters`` (transformers 5) or the
older ``rope_theta`` + ``rope_scaling``. Anything these models would not compute the way
transformers does is refused with a ``CheckpointError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


class CheckpointError(ValueError):
    """A checkpoint directory this engine cannot serve; the message names the file, field
    or tensor at fault."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: ``rope_type`` ``default`` (theta only), ``linear`` (frequencies
    divided by ``factor``) or ``llama3`` (Llama 3.1's banded rescaling)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    """What the models in ``replicas.models`` need from ``config.json``.

    ``layer_types[i]`` is ``"full"`` or ``"sliding"``; sliding layers see the last
    ``sliding_window`` positions, the current one included.
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
    rope: RopeConfig
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    dtype: str | None = None  # what the checkpoint says it was saved in


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """``ModelArgs`` of a parsed ``config.json``; ``source`` names it in errors."""
    fields = _Fields(raw, source)
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise CheckpointError(f"{source}: 'architectures' must list one architecture, "
                              f"got {archs!r}")
    arch = archs[0]
    if arch not in ARCHITECTURE_RULES:
        raise CheckpointError(f"{source}: architecture {arch!r} is not supported; supported: "
                              f"{', '.join(sorted(ARCHITECTURE_RULES))}")
    family = ARCHITECTURE_RULES[arch](fields)
    max_len = fields.int("max_position_embeddings", family.pop("max_position_embeddings"))
    _refuse_unsupported(fields)
    heads = fields.int("num_attention_heads")
    hidden = fields.int("hidden_size")
    head_dim = fields.int("head_dim", None) or hidden // heads
    kv_heads = fields.int("num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise CheckpointError(f"{source}: head_dim {head_dim} must be even for RoPE")
    args = ModelArgs(
        architecture=arch,
        vocab_size=fields.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=fields.int("intermediate_size"),
        num_hidden_layers=fields.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=fields.float("rms_norm_eps", 1e-6),
        max_position_embeddings=max_len,
        rope=_rope(fields, max_len),
        tie_word_embeddings=fields.bool("tie_word_embeddings", False),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
        **family,
    )
    if len(args.layer_types) != args.num_hidden_layers:
        raise CheckpointError(f"{source}: layer_types has {len(args.layer_types)} entries for "
                              f"{args.num_hidden_layers} layers (num_hidden_layers)")
    return args


class _Fields:
    """Typed reads of ``config.json`` fields, each error naming the field."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def get(self, name: str, default: Any = None) -> Any:
        value = self.raw.get(name)
        return default if value is None else value

    def error(self, name: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {name}={self.raw.get(name)!r}: {why}")

    def int(self, name: str, default: Any = ...) -> Any:
        value = self.get(name, default)
        if value is ...:
            raise CheckpointError(f"{self.source}: missing field {name!r}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise self.error(name, "must be a positive integer")
        return value

    def float(self, name: str, default: float) -> float:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.error(name, "must be a positive number")
        return float(value)

    def window(self, default: int) -> int | None:
        """``sliding_window``: ``default`` when absent, None when null."""
        return None if self.raw.get("sliding_window", default) is None \
            else self.int("sliding_window", default)

    def bool(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, "must be true or false")
        return value

    def refuse_true(self, name: str, arch: str, why: str) -> None:
        """``name`` is a field ``arch`` does not take; a true value would mean weights or
        math it does not have."""
        if self.raw.get(name):
            raise self.error(name, f"{arch} does not take this field ({why})")


def _refuse_unsupported(fields: _Fields) -> None:
    """Fields whose value changes the computation in ways these models do not implement."""
    if fields.raw.get("quantization_config") is not None:
        raise fields.error("quantization_config", "quantized checkpoints are not supported")
    if fields.get("hidden_act", "silu") != "silu":
        raise fields.error("hidden_act", "only 'silu' (SwiGLU MLP) is supported")


def _rope(fields: _Fields, max_position_embeddings: int) -> RopeConfig:
    """``rope_scaling`` (older configs) or else ``rope_parameters`` (transformers 5; which
    one wins when both are there is transformers' choice), with ``rope_theta`` and
    ``partial_rotary_factor`` at the top level as fallbacks."""
    name = "rope_scaling" if fields.raw.get("rope_scaling") else "rope_parameters"
    params = dict(fields.get(name, {}))
    if not isinstance(fields.get(name, {}), dict):
        raise fields.error(name, "must be a mapping")
    if any(isinstance(v, dict) for v in params.values()):
        raise fields.error(name, "per-layer-type RoPE parameters are not supported")
    theta = params.get("rope_theta", fields.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{fields.source}: {name}: rope_type {rope_type!r} is not "
                              f"supported; supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", fields.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"{fields.source}: partial_rotary_factor {partial!r}: only 1.0 "
                              "(RoPE on the whole head) is supported")
    needed = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor")}[rope_type]
    missing = [key for key in needed if params.get(key) is None]
    if missing:
        raise CheckpointError(f"{fields.source}: {name}: rope_type {rope_type!r} needs "
                              f"{', '.join(missing)}")
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    try:
        return RopeConfig(rope_type, float(theta), float(params.get("factor", 1.0)),
                          float(params.get("low_freq_factor", 1.0)),
                          float(params.get("high_freq_factor", 4.0)), int(original))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{fields.source}: {name}: {exc}") from None


# --------------------------------------------------------------------------- architectures
# Each returns the architecture-specific ModelArgs fields, plus max_position_embeddings's
# default (popped by parse_config), as transformers' configuration_<arch>.py sets them.

def _llama(fields: _Fields) -> dict:
    fields.refuse_true("sliding_window", "LlamaForCausalLM", "no sliding-window attention")
    bias = fields.bool("attention_bias", False)
    return {"max_position_embeddings": 2048, "layer_types": _all("full", fields),
            "qkv_bias": bias, "o_bias": bias, "mlp_bias": fields.bool("mlp_bias", False)}


def _mistral(fields: _Fields) -> dict:
    for name in ("attention_bias", "mlp_bias"):
        fields.refuse_true(name, "MistralForCausalLM", "its projections have no biases")
    fields.refuse_true("layer_types", "MistralForCausalLM",
                       "every layer uses sliding_window; alternating layers are Ministral's")
    window = fields.window(4096)
    kind = "full" if window is None else "sliding"
    return {"max_position_embeddings": 4096 * 32, "layer_types": _all(kind, fields),
            "sliding_window": window}


def _qwen2(fields: _Fields) -> dict:
    for name in ("attention_bias", "mlp_bias"):
        fields.refuse_true(name, "Qwen2ForCausalLM",
                           "its q/k/v projections always have biases, o_proj and the MLP none")
    return {"max_position_embeddings": 32768, **_qwen_layers(fields),
            "qkv_bias": True, "o_bias": False}


def _qwen3(fields: _Fields) -> dict:
    fields.refuse_true("mlp_bias", "Qwen3ForCausalLM", "its MLP has no biases")
    bias = fields.bool("attention_bias", False)
    return {"max_position_embeddings": 32768, **_qwen_layers(fields),
            "qkv_bias": bias, "o_bias": bias, "qk_norm": True}


def _qwen_layers(fields: _Fields) -> dict:
    """Qwen2/Qwen3: the window applies only with ``use_sliding_window``; without explicit
    ``layer_types``, layers from ``max_window_layers`` on slide."""
    window = fields.window(4096) if fields.bool("use_sliding_window", False) else None
    types = fields.get("layer_types")
    if types is None:
        first = fields.int("max_window_layers", 28)
        n = fields.int("num_hidden_layers")
        kinds = tuple("sliding" if window is not None and i >= first else "full"
                      for i in range(n))
    else:
        kinds = _layer_types(fields)
    if "sliding" in kinds and window is None:
        raise fields.error("layer_types", "names sliding_attention layers but no sliding_window "
                                          "is set (use_sliding_window is false or "
                                          "sliding_window is null)")
    return {"layer_types": kinds, "sliding_window": window if "sliding" in kinds else None}


def _layer_types(fields: _Fields) -> tuple[str, ...]:
    types = fields.raw["layer_types"]
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise fields.error("layer_types", f"entries must be one of {sorted(LAYER_TYPES)}")
    return tuple(LAYER_TYPES[t] for t in types)


def _all(kind: str, fields: _Fields) -> tuple[str, ...]:
    return (kind,) * fields.int("num_hidden_layers")


ARCHITECTURE_RULES: dict[str, Callable[[_Fields], dict]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
}
