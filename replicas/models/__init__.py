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
from .nemotron_h import NemotronHForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

ARCHITECTURES = {cls.__name__: cls for cls in (
    LlamaForCausalLM, MistralForCausalLM, NemotronHForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM)}

__all__ = ["ARCHITECTURES", "AttentionSpec", "CheckpointError", "LAYER_KINDS", "LayerSpec",
           "MixerContext", "ModelArgs", "ModelSpec", "NemotronHForCausalLM", "PagedLM",
           "RecurrentSpec", "RopeConfig", "StateSpec", "parse_config"]
