"""Qwen2 on paged KV, as transformers' ``modeling_qwen2.py``: Llama's blocks with biases on
the q/k/v projections (none on o_proj), optionally tied embeddings, and sliding-window
layers where ``layer_types`` says so (``use_sliding_window`` / ``max_window_layers``, read in
``config.py``). Everything that differs is in ``ModelArgs``; the modules are Llama's.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``ModelArgs.qkv_bias`` is always true for Qwen2, ``o_bias`` and ``mlp_bias`` false."""
