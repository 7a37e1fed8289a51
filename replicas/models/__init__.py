"""Hugging Face architectures served on the KV pages, one file per family.

``ARCHITECTURES`` maps a ``config.json`` ``architectures`` entry to its model class; each
class parses its own config (``parse_config``), declares its layers as specs (``base.py``)
and is a ``PagedLM``. Loading a checkpoint directory into one is ``replicas.checkpoint``'s
job.
"""

from __future__ import annotations

from .base import (LAYER_KINDS, AttentionSpec, History, LayerSpec, MixerContext, ModelSpec,
                   PagedLM, RecurrentSpec, StateSpec)
from .config import CheckpointError, ModelArgs, RopeConfig, parse_config
from .gemma3 import Gemma3ForCausalLM
from .gpt_oss import GptOssForCausalLM
from .kimi_linear import KimiLinearForCausalLM
from .lfm2 import Lfm2ForCausalLM
from .llama import LlamaForCausalLM, MistralForCausalLM
from .nemotron_h import NemotronHForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_next import Qwen3NextForCausalLM

ARCHITECTURES = {cls.__name__: cls for cls in (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Gemma3ForCausalLM,
    GptOssForCausalLM,
    Lfm2ForCausalLM,
    NemotronHForCausalLM,
    Qwen3NextForCausalLM,
    KimiLinearForCausalLM,
)}

__all__ = ["ARCHITECTURES", "AttentionSpec", "CheckpointError", "Gemma3ForCausalLM",
           "GptOssForCausalLM", "History", "KimiLinearForCausalLM", "LAYER_KINDS", "LayerSpec",
           "Lfm2ForCausalLM", "MixerContext", "ModelArgs", "ModelSpec", "NemotronHForCausalLM",
           "PagedLM", "Qwen3NextForCausalLM", "RecurrentSpec", "RopeConfig", "StateSpec",
           "parse_config"]
