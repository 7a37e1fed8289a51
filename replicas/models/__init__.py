"""Hugging Face architectures served on the KV pages, one file per family.

``ARCHITECTURES`` maps a ``config.json`` ``architectures`` entry to its model class; each
class takes a ``ModelArgs`` (``config.py``) and is a ``PagedLM`` (``base.py``). Loading a
checkpoint directory into one is ``replicas.checkpoint``'s job.
"""

from __future__ import annotations

from .base import (LAYER_KINDS, AttentionSpec, LayerSpec, MixerContext, ModelSpec, PagedLM,
                   RecurrentSpec, StateSpec)
from .config import CheckpointError, ModelArgs, RopeConfig, parse_config
from .llama import LlamaForCausalLM, MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_next import Qwen3NextForCausalLM

ARCHITECTURES = {cls.__name__: cls for cls in (
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    Qwen3NextForCausalLM)}

__all__ = ["ARCHITECTURES", "AttentionSpec", "CheckpointError", "LAYER_KINDS", "LayerSpec",
           "MixerContext", "ModelArgs", "ModelSpec", "PagedLM", "Qwen3NextForCausalLM",
           "RecurrentSpec", "RopeConfig", "StateSpec", "parse_config"]
