"""Qwen3 on paged KV, as transformers' ``modeling_qwen3.py``: Llama's blocks plus an RMSNorm
over each head of q and of k (``q_norm``, ``k_norm``) before RoPE; a ``head_dim`` of its own
(not ``hidden_size / heads``); ``layer_types`` mixing full and sliding-window layers.
"""

from __future__ import annotations

from torch import Tensor

from .config import ModelArgs
from .llama import LlamaAttention, LlamaForCausalLM, RMSNorm


class Qwen3Attention(LlamaAttention):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)  # over each head's dims
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention = Qwen3Attention
