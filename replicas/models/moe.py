"""Routed experts with grouped matmuls, as transformers' ``grouped_mm`` experts compute them
(``integrations/moe.py``: ``grouped_mm_experts_forward``, its default
``_experts_implementation``, on the CPU too).

Each token's ``k`` (token, slot) pairs are sorted by expert; the rows they pick go through
every expert's up (or fused gate-up) projection in one grouped matmul over the experts'
stacked weights (``offsets``: where each expert's rows end), the family's activation, the
down projection in a second one; each pair is weighted by its routing weight, the pairs go
back to (token, slot) order and a token's ``k`` outputs are summed over the slots, in slot
order (``.sum(dim=1)``, as transformers sums them: with more than two experts a token the
order of the additions shows in the last bits). Two matmul calls a layer, where a loop over
the experts hit makes three linears, a gather and an ``index_add_`` per expert.

Without ``torch.nn.functional.grouped_mm`` (torch < 2.10 has only ``torch._grouped_mm``,
< 2.9 none on the CPU), or where its kernel refuses the operands (float64; a stride that is
not a multiple of 16 bytes), each expert's rows go through ``torch.mm`` into their slice of
the output, as transformers' fallback does.

Weights, one ``[E, out, in]`` tensor per projection (``transposed``: ``[E, in, out]``), are
stacked at load from the checkpoint's per-expert tensors: ``stacked_sources`` gives a
family's ``checkpoint_tensor`` hook the stored names and the function combining them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import CheckpointError

Activation = Callable[[Tensor], Tensor]
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def swiglu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of a fused ``[.., 2I]`` projection, gate first (transformers'
    ``_default_apply_gate`` with silu)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def routed_experts(x: Tensor, experts: Tensor, weights: Tensor, up: Tensor, down: Tensor,
                   activation: Activation, up_bias: Tensor | None = None,
                   down_bias: Tensor | None = None, transposed: bool = False) -> Tensor:
    """``x [T, D]`` through each token's ``experts [T, k]`` weighted by ``weights [T, k]``
    -> ``[T, D]`` in ``x``'s dtype.

    ``up [E, U, D]`` (a fused gate-up projection, or up alone), ``activation`` maps its
    output ``[S, U]`` to ``[S, I]``, ``down [E, D, I]``; ``transposed``: ``up [E, D, U]``,
    ``down [E, I, D]``. Optional biases ``[E, U]`` / ``[E, D]``. The weighted outputs are
    summed in the dtype of ``output * weights`` (float32 with float32 routing weights)."""
    t, k = experts.shape
    num_experts = up.shape[0]
    flat = experts.reshape(-1)
    sorted_experts, order = torch.sort(flat)  # (token, slot) pairs, grouped by expert
    rows = x[order // k]
    offsets = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    h = grouped_linear(rows, up, offsets, transposed)
    if up_bias is not None:
        h.add_(up_bias[sorted_experts])
    h = grouped_linear(activation(h), down, offsets, transposed)
    if down_bias is not None:
        h.add_(down_bias[sorted_experts])
    weighted = h * weights.reshape(-1)[order, None]
    pairs = torch.empty_like(weighted).index_copy_(0, order, weighted)  # (token, slot) order
    return pairs.view(t, k, -1).sum(dim=1).to(x.dtype)


def grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor, transposed: bool = False
                   ) -> Tensor:
    """Rows ``x[offsets[e-1]:offsets[e]]`` times expert e's ``weight [E, out, in]``
    (``transposed``: ``[E, in, out]``) -> ``[S, out]``."""
    w = weight if transposed else weight.transpose(-2, -1)  # [E, in, out]
    x = x.to(w.dtype)
    if _grouped_mm_usable(x, w):
        return F.grouped_mm(x, w, offs=offsets)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):  # one host sync, as transformers' fallback
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


def _grouped_mm_usable(x: Tensor, w: Tensor) -> bool:
    """transformers' ``_can_use_grouped_mm`` for an eager call: ``F.grouped_mm`` exists
    (torch >= 2.10) and, on CUDA, the GPU is sm80 or newer; besides, what the kernel
    refuses: a dtype but float32, bfloat16 and float16, a start or a stride (but the unit
    one) that is not a multiple of 16 bytes (e.g. 10 float32 columns)."""
    if not hasattr(F, "grouped_mm") or w.dtype not in _GROUPED_MM_DTYPES:
        return False
    if not all(_aligned(t) for t in (x, w)):
        return False
    if w.device.type == "cuda":
        return torch.cuda.get_device_capability(w.device) >= (8, 0)
    return True


def _aligned(t: Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride() if s != 1)


def stacked_sources(prefix: str, projections: Sequence[str], num_experts: int
                    ) -> tuple[tuple[str, ...], Callable[..., Tensor]]:
    """A ``checkpoint_tensor`` entry: the experts' weights stored one by one as
    ``{prefix}.{e}.{projection}.weight``, each projection's stacked over the experts
    (``[E, out, in]``) and the projections concatenated along ``out`` (e.g. ``gate_proj``
    then ``up_proj``: a fused ``[E, 2I, D]``), as transformers' checkpoint conversion
    (``MergeModulelist``, ``Concatenate``) builds them."""
    names = tuple(f"{prefix}.{e}.{proj}.weight" for proj in projections
                  for e in range(num_experts))

    def combine(*tensors: Tensor) -> Tensor:
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise CheckpointError(f"the experts' {', '.join(projections)} weights must be "
                                  f"matrices of one shape, got {sorted(shapes)}")
        per = [torch.stack(tensors[i * num_experts:(i + 1) * num_experts])
               for i in range(len(projections))]
        return per[0] if len(per) == 1 else torch.cat(per, dim=1)

    return names, combine
