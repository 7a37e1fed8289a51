"""What the paged engine needs of a model, whatever its architecture: its layers as specs.

A model declares one spec per layer (``ModelSpec.layers``); the engine pages what the specs
say, and a mixer finds its history through a ``MixerContext``:

    AttentionSpec(n_kv_heads, head_dim, window=None)   keys and values of every token, in
        the FullAttention pool (window None) or the SlidingWindow pool of that window;
        ``ctx.attend(layer, q, k, v)`` writes the new ones and attends over what is visible;
        ``ctx.history(layer, k, v)`` writes them and hands the mixer the visible entries to
        attend over itself (a layer caching latents it expands first, e.g. MLA, whose
        cached "values" may have their own width ``v_head_dim``)
    RecurrentSpec(states=(StateSpec("conv", (C, K)), StateSpec("ssm", (H, N, P))))
        a fixed-size state per sequence, in the Recurrent pool (the live state, and the
        snapshots the manager keeps and restores); ``ctx.read_states(layer)`` and
        ``ctx.write_states(layer, ...)`` move it between the pages and the mixer
    None                                                a layer that keeps no cache (an
        MLP-only layer)

Pools, in the order the engine gives them to the manager: full attention, one sliding-window
pool per distinct window (smallest first), recurrent. A pool holds all of its layers' pages
together, so every attention layer of a pool has the same ``n_kv_heads``, ``head_dim`` and
``value_dim``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Union

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionSpec:
    """Softmax attention over keys/values kept per token.

    ``window``: positions ``p-window+1 .. p`` are visible to position p (None: all earlier
    ones). ``scale``: the factor on ``q.k`` (None: ``head_dim ** -0.5``). ``sinks``: the layer
    has a learned logit per head that joins every softmax without a value (GPT-OSS); the
    mixer passes its weights to ``attend``. Keys are stored after RoPE. ``v_head_dim``: the
    width of a cached value when it differs from a key's (None: ``head_dim``); such a layer
    reads its history with ``ctx.history`` (``attend`` needs equal widths).
    """

    n_kv_heads: int
    head_dim: int
    window: int | None = None
    scale: float | None = None
    sinks: bool = False
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_kv_heads", "head_dim"):
            if not _positive(getattr(self, name)):
                raise ValueError(f"AttentionSpec.{name} must be an int >= 1, got "
                                 f"{getattr(self, name)!r}")
        if self.v_head_dim is not None and not _positive(self.v_head_dim):
            raise ValueError(f"AttentionSpec.v_head_dim must be None or an int >= 1, got "
                             f"{self.v_head_dim!r}")
        if self.window is not None and not _positive(self.window):
            raise ValueError(f"AttentionSpec.window must be None or an int >= 1, got "
                             f"{self.window!r}")

    @property
    def kind(self) -> str:
        return "full" if self.window is None else "sliding"

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale

    @property
    def value_dim(self) -> int:
        """The width of a cached value."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def split_kv(self) -> bool:
        """Keys and values of equal width: a page holds them apart, ``[layers, 2, tpb, KV,
        hd]``; else side by side, ``[layers, tpb, KV, hd + vd]``."""
        return self.value_dim == self.head_dim


@dataclass(frozen=True)
class StateSpec:
    """One tensor of a recurrent layer's state, e.g. ``("conv", (channels, kernel - 1))``.
    States are kept in float32 (lossless for float16 and bfloat16 models too)."""

    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if not self.shape or not all(_positive(d) for d in self.shape):
            raise ValueError(f"StateSpec {self.name!r}: shape must be positive ints, got "
                             f"{self.shape!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class RecurrentSpec:
    """A mixer whose history is a fixed-size state (linear attention, state-space, short
    convolution): zero for a new sequence, carried from token to token."""

    states: tuple[StateSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "states", tuple(self.states))
        names = [s.name for s in self.states]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"RecurrentSpec needs states with distinct names, got {names}")

    kind = "recurrent"

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.states)


LayerSpec = Union[AttentionSpec, RecurrentSpec, None]
LAYER_KINDS = ("full", "sliding", "recurrent", "none")


def layer_kind(spec: LayerSpec) -> str:
    """``"full"``, ``"sliding"``, ``"recurrent"`` or ``"none"`` (no cache)."""
    return "none" if spec is None else spec.kind


@dataclass(frozen=True)
class ModelSpec:
    """A model's cache needs: one ``LayerSpec`` per layer, bottom first."""

    layers: tuple[LayerSpec, ...]
    max_model_len: int
    vocab_size: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, spec in enumerate(self.layers):
            if spec is not None and not isinstance(spec, (AttentionSpec, RecurrentSpec)):
                raise ValueError(f"layer {i}: spec must be an AttentionSpec, a RecurrentSpec "
                                 f"or None, got {spec!r}")
        if all(spec is None for spec in self.layers):
            raise ValueError("a model needs at least one attention or recurrent layer")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(layer_kind(spec) for spec in self.layers)


@dataclass(frozen=True)
class History:
    """What one sequence's new tokens see of an attention layer's cache (``ctx.history``):
    the entries at positions ``first .. first + m - 1``, its new tokens' last.

    ``keys [m, KV, hd]`` and ``values [m, KV, vd]`` as the layer wrote them; ``mask``: bool
    ``[n, m]``, new token i (at position ``first + m - n + i``) sees entry j, or None when
    the sequence has one new token (it sees them all). A window is in both: entries before
    the first token's window are not read, and the mask hides those a later token's
    window has left behind.
    """

    keys: Tensor
    values: Tensor
    first: int
    mask: Tensor | None

    @property
    def positions(self) -> Tensor:
        """The entries' absolute positions ``[m]``."""
        return torch.arange(self.first, self.first + self.keys.shape[0],
                            device=self.keys.device)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class MixerContext(Protocol):
    """Where mixers find history. Tensors hold the new tokens of all sequences, packed:
    sequence i's rows are ``bounds[i] = (a, e)``."""

    bounds: list[tuple[int, int]]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
               sinks: Tensor | None = None) -> Tensor:
        """q ``[T, H, hd]``, k/v ``[T, KV, hd]`` (RoPE applied) -> output ``[T, H, hd]``;
        ``sinks [H]`` for a layer whose spec has ``sinks``. Keys and values of equal width
        only (else ``history``)."""

    def history(self, layer: int, k: Tensor, v: Tensor) -> list[History]:
        """Write the new tokens' k ``[T, KV, hd]`` and v ``[T, KV, vd]`` into the pages and
        return, per sequence (in ``bounds`` order), the entries its new tokens see, for
        the mixer to attend over itself (its own scale, its own expansion of them)."""

    def read_states(self, layer: int) -> dict[str, Tensor]:
        """Each sequence's state before this step: name -> float32 ``[B, *shape]`` (a
        copy; zero for a sequence with no history)."""

    def write_states(self, layer: int, states: dict[str, Tensor]) -> None:
        """Each sequence's state after its last new token, every state of the layer."""


class PagedLM(Protocol):
    """A decoder-only LM the paged engine can run."""

    spec: ModelSpec

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        """Hidden states ``[T, D]`` of the packed ``tokens`` at ``positions``."""

    def logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits ``[N, V]`` of some of those hidden states."""
