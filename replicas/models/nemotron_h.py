"""Nemotron-H on paged KV, layer by layer as transformers' ``modeling_nemotron_h.py`` computes
it without the mamba-ssm / causal-conv1d kernels (its PyTorch path).

The layers are blocks of one mixer each, ``h + mixer(norm(h))``, the kind per layer from
``layers_block_type`` (or the older ``hybrid_override_pattern``: ``M`` mamba, ``*``
attention, ``-`` MLP, ``E`` MoE):

    linear_attention  Mamba-2: in_proj to (z, xBC, dt); a causal depthwise conv1d (with
                      bias, then silu) over xBC, whose state is its last ``conv_kernel - 1``
                      inputs; the selective scan with A = -exp(A_log) per head, dt =
                      softplus(dt + dt_bias) clamped below at ``time_step_min``, B and C
                      shared by ``n_groups`` groups of heads, the D skip; then the gated
                      RMSNorm per group, norm(y * silu(z)), and out_proj. State per sequence:
                      ``conv [conv_dim, conv_kernel - 1]`` and ``ssm [heads, head_dim,
                      ssm_state_size]`` (a RecurrentSpec).
    full_attention    softmax attention over every earlier token, with no positional
                      encoding at all (no RoPE: the Mamba layers carry position), no biases.
    mlp               up_proj, ``mlp_hidden_act`` (relu2), down_proj: no cache.
    moe               a sigmoid router with a score-correction bias and group-limited top-k,
                      non-gated experts (optionally through a latent projection), plus one
                      shared expert: no cache.

Module names follow the checkpoints (``backbone.layers.3.mixer.in_proj``: the names
transformers' ``save_pretrained`` writes and NVIDIA's checkpoints carry; transformers
renames them to ``model.``), but for the routed experts: stored one by one
(``mixer.experts.5.up_proj.weight``), they are stacked at load into ``mixer.experts.up_proj``
/ ``down_proj`` as transformers stacks them (``checkpoint_tensor``), and run in two grouped
matmuls (``moe.py``).

Where this departs from transformers, on purpose:

- dt is clamped at ``time_step_min`` for every token. transformers clamps in its chunked
  scan (prefill) but not in its one-token step (decode), so its own generate computes a
  token differently from a forward over the same tokens whenever softplus(dt + dt_bias) <
  time_step_min. Here a token's result does not depend on how the sequence was cut into
  steps (what reusing a cached prefix needs); it equals transformers' forward.
- ``tie_word_embeddings`` ties nothing: transformers' NemotronH never ties (its
  ``_tied_weights_keys`` is empty; ``save_pretrained`` writes ``lm_head.weight`` either way),
  so the stored ``lm_head.weight`` is always used.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionSpec, MixerContext, ModelSpec, RecurrentSpec, StateSpec
from .config import CheckpointError, _Fields
from .moe import routed_experts, stacked_sources

ARCHITECTURE = "NemotronHForCausalLM"
MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}  # hybrid_override_pattern
LEGACY_BLOCK_TYPES = {"mamba": MAMBA, "attention": ATTENTION}  # as transformers remaps them
DEFAULT_LAYERS = (MAMBA, MOE, ATTENTION, MLP)  # transformers' when the config names none
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {  # transformers' ACT2FN, these names
    "relu2": lambda x: torch.square(F.relu(x)),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
# transformers' NemotronHConfig takes these older names and lets them win.
_EXPERTS = re.compile(r"(backbone\.layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)")
ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv",
           "time_step_min": "mamba_dt_min", "time_step_limit": "mamba_dt_limit",
           "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size"}


@dataclass(frozen=True)
class NemotronHArgs:
    """What ``NemotronHForCausalLM`` needs from ``config.json``; ``layer_types[i]`` is one of
    transformers' block types (``linear_attention``, ``full_attention``, ``mlp``, ``moe``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    max_position_embeddings: int
    layer_norm_epsilon: float
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # MLP layers (and the experts' activation)
    intermediate_size: int
    mlp_hidden_act: str
    mlp_bias: bool
    # Mamba-2
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    chunk_size: int
    time_step_min: float
    mamba_hidden_act: str
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    tie_word_embeddings: bool = False  # never: see the module docstring
    dtype: str | None = None

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_inner + 2 * self.n_groups * self.ssm_state_size


# --------------------------------------------------------------------------- config.json

def parse_config(raw: dict[str, Any], source: str = "config.json") -> NemotronHArgs:
    """``NemotronHArgs`` of a parsed ``config.json``, with transformers' defaults and
    aliases; what these modules would not compute as transformers does is refused."""
    raw = _decode_special_floats(raw)
    archs = raw.get("architectures")
    if archs != [ARCHITECTURE]:
        raise CheckpointError(f"{source}: 'architectures' must be [{ARCHITECTURE!r}], got "
                              f"{archs!r}")
    raw = {**raw, **{name: raw[alias] for name, alias in ALIASES.items() if alias in raw}}
    fields = _Fields(raw, source)
    _refuse_unsupported(fields)
    layers = _layer_types(fields)
    heads = fields.int("num_attention_heads", 32)
    kv_heads = fields.int("num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
    mamba_heads, groups = fields.int("mamba_num_heads", 128), fields.int("n_groups", 8)
    if mamba_heads % groups:
        raise fields.error("n_groups", f"must divide mamba_num_heads ({mamba_heads})")
    if fields.int("conv_kernel", 4) < 2:
        raise fields.error("conv_kernel", "must be at least 2 (the state is its last "
                                          "conv_kernel - 1 inputs)")
    args = NemotronHArgs(
        architecture=ARCHITECTURE,
        vocab_size=fields.int("vocab_size", 131072),
        hidden_size=fields.int("hidden_size", 4096),
        layer_types=layers,
        max_position_embeddings=fields.int("max_position_embeddings", 4096),
        layer_norm_epsilon=fields.float("layer_norm_epsilon", 1e-5),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=fields.int("head_dim", 128),  # transformers' default, not hidden / heads
        intermediate_size=fields.int("intermediate_size", 21504),
        mlp_hidden_act=_activation(fields, "mlp_hidden_act", "relu2"),
        mlp_bias=fields.bool("mlp_bias", False),
        mamba_num_heads=mamba_heads,
        mamba_head_dim=fields.int("mamba_head_dim", 64),
        ssm_state_size=fields.int("ssm_state_size", 128),
        n_groups=groups,
        conv_kernel=fields.int("conv_kernel", 4),
        use_conv_bias=fields.bool("use_conv_bias", True),
        use_bias=fields.bool("use_bias", False),
        chunk_size=fields.int("chunk_size", 128),
        time_step_min=_non_negative(fields, "time_step_min", 0.001),
        mamba_hidden_act=_activation(fields, "mamba_hidden_act", "silu"),
        **_moe(fields, MOE in layers),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )
    if ATTENTION not in layers and MAMBA not in layers:
        raise fields.error("layers_block_type", "needs at least one linear_attention or "
                                                "full_attention layer (M or *)")
    return args


def _decode_special_floats(value: Any) -> Any:
    """transformers writes inf as ``{"__float__": "Infinity"}`` (``time_step_limit``)."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            special = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
            return special.get(value["__float__"], value)
        return {k: _decode_special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_special_floats(v) for v in value]
    return value


def _refuse_unsupported(fields: _Fields) -> None:
    """Fields that change the computation in ways this model does not follow. Some of them
    transformers' NemotronH reads nowhere: a value other than the default would there mean
    weights or math that transformers silently drops, so they are refused too."""
    if fields.raw.get("quantization_config") is not None:
        raise fields.error("quantization_config", "quantized checkpoints are not supported")
    ignored = "transformers' NemotronH ignores this field"
    fields.refuse_true("attention_bias", ARCHITECTURE,
                       f"{ignored}: its attention projections have no biases")
    fields.refuse_true("mamba_proj_bias", ARCHITECTURE,
                       f"{ignored}: in_proj/out_proj biases come from use_bias")
    fields.refuse_true("residual_in_fp32", ARCHITECTURE,
                       f"{ignored}: residuals stay in the model's dtype")
    if fields.raw.get("sliding_window") is not None:
        raise fields.error("sliding_window", f"{ignored}: its attention layers see every "
                                             "earlier token")
    limit = fields.raw.get("time_step_limit")
    if limit is not None and (not isinstance(limit, (list, tuple))
                              or list(limit) != [0.0, math.inf]):
        raise fields.error("time_step_limit", f"{ignored}: dt is clamped to (time_step_min, "
                                              "inf) whatever it says; only [0.0, inf] is "
                                              "accepted")


def _layer_types(fields: _Fields) -> tuple[str, ...]:
    """``layers_block_type`` (alias ``layer_types``; legacy ``mamba``/``attention`` names
    remapped), else ``hybrid_override_pattern``, else transformers' default four layers.
    ``num_hidden_layers`` is ignored, as transformers ignores it."""
    name = "layers_block_type" if "layers_block_type" in fields.raw else "layer_types"
    types = fields.raw.get(name)
    if types is None:
        pattern = fields.raw.get("hybrid_override_pattern")
        if pattern is None:
            return DEFAULT_LAYERS
        if not isinstance(pattern, str) or not pattern or any(c not in PATTERN for c in pattern):
            raise fields.error("hybrid_override_pattern",
                               f"must be a non-empty string of {''.join(PATTERN)}")
        return tuple(PATTERN[c] for c in pattern)
    valid = set(PATTERN.values())
    if not isinstance(types, list) or not types:
        raise fields.error(name, "must be a non-empty list")
    types = [LEGACY_BLOCK_TYPES.get(t, t) for t in types]
    if any(t not in valid for t in types):
        raise fields.error(name, f"entries must be one of {sorted(valid)}")
    return tuple(types)


def _non_negative(fields: _Fields, name: str, default: float) -> float:
    value = fields.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise fields.error(name, "must be a number >= 0")
    return float(value)


def _activation(fields: _Fields, name: str, default: str) -> str:
    value = fields.get(name, default)
    if value not in ACTIVATIONS:
        raise fields.error(name, f"supported: {', '.join(ACTIVATIONS)}")
    return value


def _moe(fields: _Fields, used: bool) -> dict:
    """The MoE fields, checked when a layer is ``moe``."""
    out = {
        "n_routed_experts": fields.int("n_routed_experts", 8),
        "num_experts_per_tok": fields.int("num_experts_per_tok", 2),
        "moe_intermediate_size": fields.int("moe_intermediate_size", 7688),
        "moe_shared_expert_intermediate_size": fields.int(
            "moe_shared_expert_intermediate_size", 7688),
        "moe_latent_size": fields.int("moe_latent_size", None),
        "routed_scaling_factor": fields.float("routed_scaling_factor", 1.0),
        "n_group": fields.int("n_group", 1),
        "topk_group": fields.int("topk_group", 1),
        "norm_topk_prob": fields.bool("norm_topk_prob", True),
    }
    if not used:
        return out
    experts, groups = out["n_routed_experts"], out["n_group"]
    if fields.get("n_shared_experts", 1) != 1:
        raise fields.error("n_shared_experts", "transformers' NemotronH builds exactly one "
                                               "shared expert whatever it says; only 1 is "
                                               "accepted")
    if experts % groups or experts // groups < 2:
        raise fields.error("n_group", f"must divide n_routed_experts ({experts}) into groups "
                                      "of at least 2 (a group scores by its top two)")
    if out["topk_group"] > groups:
        raise fields.error("topk_group", f"must be at most n_group ({groups})")
    if out["num_experts_per_tok"] > out["topk_group"] * (experts // groups):
        raise fields.error("num_experts_per_tok", "exceeds the experts of topk_group groups")
    return out


# --------------------------------------------------------------------------- modules

class NemotronHRMSNorm(nn.Module):
    """Normalised in float32 and, unlike Llama's, scaled in float32 too, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * h).to(x.dtype)


class NemotronHRMSNormGated(nn.Module):
    """RMSNorm of ``y * silu(z)`` over each group of ``group_size`` channels (float32),
    scaled in the input's dtype."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        h = y.to(torch.float32) * F.silu(z.to(torch.float32))
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(h.shape).to(y.dtype)


class NemotronHMamba2Mixer(nn.Module):
    """Mamba-2 over packed sequences, each from its own state: one-token sequences stepped
    together, longer ones each through the causal conv and the chunked scan."""

    def __init__(self, args: NemotronHArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim = args.mamba_num_heads, args.mamba_head_dim
        self.state_size, self.groups = args.ssm_state_size, args.n_groups
        self.inner, self.conv_dim, self.kernel = args.mamba_inner, args.conv_dim, args.conv_kernel
        self.chunk_size, self.dt_min = args.chunk_size, args.time_step_min
        self.act = ACTIVATIONS[args.mamba_hidden_act]
        self.in_proj = nn.Linear(args.hidden_size, self.inner + self.conv_dim + self.heads,
                                 bias=args.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                                bias=args.use_conv_bias, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = NemotronHRMSNormGated(self.inner, self.inner // self.groups,
                                          args.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.inner, args.hidden_size, bias=args.use_bias)

    @staticmethod
    def spec(args: NemotronHArgs) -> RecurrentSpec:
        return RecurrentSpec((
            StateSpec("conv", (args.conv_dim, args.conv_kernel - 1)),
            StateSpec("ssm", (args.mamba_num_heads, args.mamba_head_dim, args.ssm_state_size))))

    def forward(self, x: Tensor, ctx: MixerContext) -> Tensor:
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        states = ctx.read_states(self.layer)
        conv_states, ssm_states = states["conv"], states["ssm"]  # [B, C, K-1], [B, H, P, N]
        y = torch.empty(x.shape[0], self.heads, self.head_dim, dtype=torch.float32,
                        device=x.device)
        singles = [i for i, (a, e) in enumerate(ctx.bounds) if e - a == 1]
        if singles:
            rows = torch.tensor([ctx.bounds[i][0] for i in singles], device=x.device)
            index = torch.tensor(singles, device=x.device)
            y[rows], conv, ssm = self._step(xbc[rows], dt[rows], conv_states[index],
                                            ssm_states[index])
            conv_states[index], ssm_states[index] = conv, ssm
        for i, (a, e) in enumerate(ctx.bounds):
            if e - a > 1:
                y[a:e], conv_states[i], ssm_states[i] = self._scan(
                    xbc[a:e], dt[a:e], conv_states[i], ssm_states[i])
        ctx.write_states(self.layer, {"conv": conv_states, "ssm": ssm_states})
        out = self.norm(y.view(x.shape[0], self.inner), z)
        return self.out_proj(out.to(x.dtype))

    def _conv(self, history: Tensor, new: Tensor) -> tuple[Tensor, Tensor]:
        """The causal depthwise conv of ``new [B, C, L]`` after ``history [B, C, K-1]`` (its
        last inputs before): activated output ``[B, C, L]``, and the new history."""
        window = torch.cat([history.to(new.dtype), new], dim=-1)
        out = F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
        return self.act(out), window[..., -(self.kernel - 1):].float()

    def _ssm_inputs(self, xbc: Tensor, dt: Tensor) -> tuple[Tensor, ...]:
        """Split the conv's output ``[..., C]`` into x ``[..., H, P]`` and B, C ``[..., H, N]``
        (each group's B and C shared by its heads), all float32; dt ``[..., H]`` discretised:
        softplus(dt + dt_bias), at least ``time_step_min``."""
        x, b, c = xbc.split([self.inner, self.groups * self.state_size,
                             self.groups * self.state_size], dim=-1)
        per_group = self.heads // self.groups
        b, c = (t.float().unflatten(-1, (self.groups, self.state_size))
                .repeat_interleave(per_group, dim=-2) for t in (b, c))
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(min=self.dt_min).float()
        return x.float().unflatten(-1, (self.heads, self.head_dim)), b, c, dt

    def _step(self, xbc: Tensor, dt: Tensor, conv: Tensor, ssm: Tensor):
        """One token of each of B sequences: ``xbc [B, C]``, ``dt [B, H]`` -> y ``[B, H, P]``
        and the states after it. h = exp(dt A) h + dt x B^T; y = h C + D x."""
        out, conv = self._conv(conv, xbc[:, :, None])
        x, b, c, dt = self._ssm_inputs(out[:, :, 0], dt)
        a = -torch.exp(self.A_log.float())
        decay = torch.exp(dt * a)  # [B, H]
        ssm = ssm * decay[..., None, None] + (x * dt[..., None])[..., None] * b[:, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", ssm, c) + self.D.float()[:, None] * x
        return y, conv, ssm

    def _scan(self, xbc: Tensor, dt: Tensor, conv: Tensor, ssm: Tensor):
        """L > 1 tokens of one sequence from its states: y ``[L, H, P]`` and the states after
        the last token. The scan in chunks of ``chunk_size`` (Mamba-2's SSD): within a chunk
        the attention-like form, across chunks the state carried."""
        out, conv = self._conv(conv[None], xbc.T[None])
        x, b, c, dt = self._ssm_inputs(out[0].T, dt)
        y, ssm = chunked_scan(x, dt, -torch.exp(self.A_log.float()), b, c, ssm,
                              self.chunk_size)
        return y + self.D.float()[:, None] * x, conv[0], ssm


def chunked_scan(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor,
                 chunk: int) -> tuple[Tensor, Tensor]:
    """h_t = exp(dt_t a) h_{t-1} + dt_t x_t b_t^T, y_t = h_t c_t, from ``h0 [H, P, N]``;
    ``x [L, H, P]``, ``dt [L, H]``, ``a [H]``, ``b``, ``c [L, H, N]`` (float32). Returns y
    ``[L, H, P]`` and h_L. Positions past L pad the last chunk with no decay and no input."""
    length, pad = x.shape[0], -x.shape[0] % chunk
    xdt, log_decay = x * dt[..., None], dt * a  # [L, H, P], [L, H]
    xdt, log_decay, b, c = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).unflatten(0, (-1, chunk))
                            for t in (xdt, log_decay, b, c))  # [n, Q, ...]
    log_decay = log_decay.transpose(1, 2)  # [n, H, Q]
    cum = log_decay.cumsum(-1)
    # within a chunk: y_l = sum_{s <= l} (c_l . b_s) exp(sum_{s < j <= l} log_decay_j) xdt_s
    weights = torch.einsum("clhn,cshn->chls", c, b) * torch.exp(segment_sum(log_decay))
    y = torch.einsum("chls,cshp->clhp", weights, xdt)
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(cum[..., -1:] - cum)  # [n, H, Q]
    own = torch.einsum("clhn,chl,clhp->chpn", b, to_end, xdt)
    starts, h = [], h0
    for i in range(own.shape[0]):
        starts.append(h)
        h = h * torch.exp(cum[i, :, -1])[:, None, None] + own[i]
    # from the state at each chunk's start
    y = y + torch.einsum("clhn,chpn,chl->clhp", c, torch.stack(starts), torch.exp(cum))
    return y.flatten(0, 1)[:length], h


def segment_sum(v: Tensor) -> Tensor:
    """``[..., Q]`` -> ``[..., Q, Q]``: entry (l, s) is ``v[s+1] + .. + v[l]`` for s <= l
    (0 on the diagonal), -inf above it; summed by cumsum (not a difference of cumsums)."""
    q = v.shape[-1]
    lower = torch.ones(q, q, dtype=torch.bool, device=v.device).tril()
    sums = v[..., :, None].expand(*v.shape, q).masked_fill(~lower.tril(-1), 0).cumsum(-2)
    return sums.masked_fill(~lower, -math.inf)


class NemotronHAttention(nn.Module):
    """Grouped-query softmax attention without positional encoding or biases."""

    def __init__(self, args: NemotronHArgs, layer: int) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, args.head_dim
        q_dim = args.num_attention_heads * args.head_dim
        kv_dim = args.num_key_value_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=False)

    def forward(self, x: Tensor, ctx: MixerContext) -> Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, -1, self.head_dim)
        k = self.k_proj(x).view(t, -1, self.head_dim)
        v = self.v_proj(x).view(t, -1, self.head_dim)
        return self.o_proj(ctx.attend(self.layer, q, k, v).reshape(t, -1))


class NemotronHMLP(nn.Module):
    def __init__(self, args: NemotronHArgs, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or args.intermediate_size
        self.up_proj = nn.Linear(args.hidden_size, size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(size, args.hidden_size, bias=args.mlp_bias)
        self.act = ACTIVATIONS[args.mlp_hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHExperts(nn.Module):
    """The routed experts, non-gated (``down(act(up(x)))``), their weights stacked as
    transformers' ``NemotronHExperts`` holds them: ``up_proj [E, I, W]``, ``down_proj
    [E, W, I]`` (W: ``moe_latent_size`` or the hidden size), built at load from the
    checkpoint's per-expert ``experts.<e>.{up,down}_proj.weight``
    (``NemotronHForCausalLM.checkpoint_tensor``). Run with grouped matmuls
    (``moe.routed_experts``), as transformers' default ``grouped_mm`` experts."""

    def __init__(self, args: NemotronHArgs) -> None:
        super().__init__()
        e, width = args.n_routed_experts, args.moe_latent_size or args.hidden_size
        self.up_proj = nn.Parameter(torch.empty(e, args.moe_intermediate_size, width))
        self.down_proj = nn.Parameter(torch.empty(e, width, args.moe_intermediate_size))
        self.act = ACTIVATIONS[args.mlp_hidden_act]

    def forward(self, h: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """Each token's outputs weighted by its float32 weights and summed in float32 (as
        transformers), returned in ``h``'s dtype."""
        return routed_experts(h, experts, weights, self.up_proj, self.down_proj, self.act)


class NemotronHTopkRouter(nn.Module):
    """Sigmoid scores in float32; experts chosen by score + ``e_score_correction_bias``
    among the ``topk_group`` groups whose two best such scores sum highest; weighted by
    their plain scores (normalised to sum 1 with ``norm_topk_prob``) times
    ``routed_scaling_factor``. Both tensors load in float32 (``FLOAT32_PARAMETERS``)."""

    def __init__(self, args: NemotronHArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts))
        self.top_k, self.n_group, self.topk_group = (args.num_experts_per_tok, args.n_group,
                                                     args.topk_group)
        self.norm_topk_prob, self.scale = args.norm_topk_prob, args.routed_scaling_factor

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's experts ``[T, k]`` and their weights ``[T, k]`` (float32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(x.shape[0], self.n_group, -1)
        best_groups = grouped.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1,
                                                               sorted=False)[1]
        allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool)
        allowed.scatter_(1, best_groups, True)
        choice = choice.masked_fill(~allowed[..., None].expand_as(grouped).flatten(1),
                                    -math.inf)
        experts = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * self.scale


class NemotronHMoE(nn.Module):
    def __init__(self, args: NemotronHArgs) -> None:
        super().__init__()
        self.gate = NemotronHTopkRouter(args)
        self.experts = NemotronHExperts(args)
        self.shared_experts = NemotronHMLP(args, args.moe_shared_expert_intermediate_size)
        if args.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(args.hidden_size, args.moe_latent_size,
                                             bias=args.mlp_bias)
            self.fc2_latent_proj = nn.Linear(args.moe_latent_size, args.hidden_size,
                                             bias=args.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        experts, weights = self.gate(x)
        routed = self.experts(self.fc1_latent_proj(x), experts, weights)
        return self.fc2_latent_proj(routed) + self.shared_experts(x)


MIXERS = {MAMBA: NemotronHMamba2Mixer, ATTENTION: NemotronHAttention}


class NemotronHBlock(nn.Module):
    """``h + mixer(norm(h))``: one mixer per block, of the layer's type."""

    def __init__(self, args: NemotronHArgs, layer: int) -> None:
        super().__init__()
        self.block_type = args.layer_types[layer]
        self.norm = NemotronHRMSNorm(args.hidden_size, args.layer_norm_epsilon)
        if self.block_type in MIXERS:
            self.mixer = MIXERS[self.block_type](args, layer)
        else:
            self.mixer = NemotronHMLP(args) if self.block_type == MLP else NemotronHMoE(args)

    def forward(self, h: Tensor, ctx: MixerContext) -> Tensor:
        x = self.norm(h)
        if self.block_type in MIXERS:
            return h + self.mixer(x, ctx)
        return h + self.mixer(x)


class NemotronHModel(nn.Module):
    def __init__(self, args: NemotronHArgs) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(args, i) for i in range(args.num_hidden_layers))
        self.norm_f = NemotronHRMSNorm(args.hidden_size, args.layer_norm_epsilon)

    def forward(self, tokens: Tensor, ctx: MixerContext) -> Tensor:
        """Hidden states ``[T, D]`` before the final norm."""
        h = self.embeddings(tokens)
        for layer in self.layers:
            h = layer(h, ctx)
        return h


class NemotronHForCausalLM(nn.Module):
    """A ``PagedLM``: Mamba-2 layers in the recurrent pool, attention layers in the full
    pool, MLP and MoE layers with no cache. Positions are not used (no RoPE)."""

    # Stored by NemotronH checkpoints, unused by transformers too: multi-token prediction.
    IGNORED_TENSORS = (r"(backbone\.)?mtp\..*",)
    # transformers keeps these in float32 in any dtype (_keep_in_fp32_modules_strict).
    FLOAT32_PARAMETERS = (r"backbone\.layers\.\d+\.mixer\.gate\.(weight|e_score_correction_bias)",)
    parse_config = staticmethod(parse_config)

    def __init__(self, args: NemotronHArgs, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.args = args
        self.backbone = NemotronHModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        specs = {MAMBA: NemotronHMamba2Mixer.spec(args),
                 ATTENTION: AttentionSpec(args.num_key_value_heads, args.head_dim)}
        self.spec = ModelSpec(tuple(specs.get(kind) for kind in args.layer_types),
                              max_model_len=args.max_position_embeddings,
                              vocab_size=args.vocab_size, dtype=dtype)

    def checkpoint_tensor(self, name: str) -> tuple[tuple[str, ...], Any]:
        """The stacked experts' ``up_proj`` / ``down_proj``: from the per-expert
        ``experts.<e>.up_proj.weight`` / ``down_proj.weight``, stacked, as checkpoints (and
        transformers' ``save_pretrained``) store them."""
        match = _EXPERTS.fullmatch(name)
        if match is None:
            return (name,), None
        return stacked_sources(match[1], (match[2],), self.args.n_routed_experts)

    def tie_weights(self) -> None:
        """Nothing to tie: transformers' NemotronH keeps ``lm_head`` apart (see above)."""

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        return self.backbone(tokens, ctx)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.backbone.norm_f(hidden))
