"""What the paged engine needs of a model, whatever its architecture.

A model computes the new tokens of all running sequences packed together
(``forward(tokens, positions, ctx)``); where a layer's earlier keys/values (or recurrent
state) live is the ``MixerContext``'s business. ``Paging`` tells the engine which pools a
model needs and what a page holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

LAYER_KINDS = ("full", "sliding", "recurrent")


class MixerContext(Protocol):
    """Where mixers find history. Tensors hold the new tokens of all sequences, packed."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q ``[T, H, hd]``, k/v ``[T, KV, hd]`` (RoPE applied) -> output ``[T, H, hd]``."""

    def recur(self, layer: int, log_a: Tensor, b: Tensor) -> Tensor:
        """States ``h_t = exp(log_a_t) * h_{t-1} + b_t`` for each new token, ``[T, D]``."""


@dataclass(frozen=True)
class Paging:
    """A model's KV needs. ``layers[i]`` is layer i's kind (``LAYER_KINDS``);
    ``windows[i]`` its sliding window (positions ``p-window+1 .. p`` are visible to
    position p), None for other kinds. Attention pages hold ``n_kv_heads x head_dim`` keys
    and values per token in ``dtype``; a recurrent page ``state_dim`` float32 per layer."""

    layers: tuple[str, ...]
    windows: tuple[int | None, ...]
    n_kv_heads: int
    head_dim: int
    max_model_len: int
    vocab_size: int
    dtype: torch.dtype = torch.float32
    state_dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "windows", tuple(self.windows))
        if len(self.windows) != len(self.layers):
            raise ValueError("Paging needs one window entry per layer")
        for kind, window in zip(self.layers, self.windows):
            if kind not in LAYER_KINDS:
                raise ValueError(f"unknown layer kind {kind!r}; use one of {LAYER_KINDS}")
            if (kind == "sliding") != (window is not None):
                raise ValueError(f"a {kind} layer has window {window!r}: sliding layers, "
                                 "and only they, have a window")


class PagedLM(Protocol):
    """A decoder-only LM the paged engine can run."""

    paging: Paging

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        """Hidden states ``[T, D]`` of the packed ``tokens`` at ``positions``."""

    def logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits ``[N, V]`` of some of those hidden states."""
