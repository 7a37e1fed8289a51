"""A small decoder-only transformer with full, sliding-window and recurrent layers.

The model owns the weights and the per-token math (embedding, RMSNorm, projections, RoPE,
SwiGLU MLP, head). Where a layer's earlier keys/values or recurrent state come from is
the caller's business: ``TinyLM.forward`` hands each mixer's new-token tensors to a
``MixerContext``. ``DenseContext`` computes one sequence from scratch and is the reference
that the paged engine (``replicas.engines.torch_engine``) must match.

Weights are drawn from a CPU ``torch.Generator`` seeded once, in a fixed order, so the same
preset and seed give the same model on every machine and device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replicas.models.base import (AttentionSpec, MixerContext, ModelSpec, RecurrentSpec,
                                  StateSpec)
from text import VOCAB_SIZE


TINY_LAYER_KINDS = ("full", "sliding", "recurrent")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a TinyLM. ``layers`` names each layer's kind, bottom first.

    A ``sliding`` layer at position p attends to positions ``p-window+1 .. p``. A
    ``recurrent`` layer keeps a state of ``d_model`` floats per sequence.
    """

    layers: tuple[str, ...] = ("full",) * 4
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_dim: int = 1024
    window: int = 512
    max_model_len: int = 8192
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        bad = [k for k in self.layers if k not in TINY_LAYER_KINDS]
        if not self.layers or bad:
            raise ValueError(f"layers must be a non-empty tuple of {TINY_LAYER_KINDS}, got {bad}")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("d_model must divide by n_heads, and n_heads by n_kv_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.window < 1 or self.max_model_len < 1:
            raise ValueError("window and max_model_len must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def layer_ids(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of ``kind``, bottom first."""
        return tuple(i for i, k in enumerate(self.layers) if k == kind)

    def spec(self) -> ModelSpec:
        """Attention layers cache K/V (a window for ``sliding``); a recurrent layer keeps
        its state ``h`` of ``d_model`` floats."""
        def layer(kind: str):
            if kind == "recurrent":
                return RecurrentSpec((StateSpec("h", (self.d_model,)),))
            return AttentionSpec(self.n_kv_heads, self.head_dim,
                                 window=self.window if kind == "sliding" else None)
        return ModelSpec(tuple(map(layer, self.layers)), self.max_model_len, self.vocab_size)


PRESETS: dict[str, ModelConfig] = {
    # 4.33M parameters: a 2k-token prefill is ~26 GFLOP, far above Python overhead.
    "default": ModelConfig(),
    # 6.43M parameters: two full, two sliding-window (512), two recurrent layers.
    "hybrid": ModelConfig(layers=("full", "sliding", "recurrent",
                                  "sliding", "recurrent", "full")),
    # ~0.1M parameters, for tests.
    "tiny": ModelConfig(layers=("full", "full"), d_model=64, n_heads=4, n_kv_heads=2,
                        ffn_dim=128, max_model_len=2048),
    "tiny-hybrid": ModelConfig(layers=("full", "sliding", "recurrent"), d_model=64,
                               n_heads=4, n_kv_heads=2, ffn_dim=128, window=24,
                               max_model_len=2048),
}


# --------------------------------------------------------------------------- pure math

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding of ``x [T, heads, hd]`` at absolute ``positions [T]``."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor,
              window: int | None) -> Tensor:
    """Causal (optionally windowed) attention of one sequence.

    q ``[n, H, hd]`` at ``q_pos``; k/v ``[m, KV, hd]`` at ``k_pos``. Key j is visible to
    query p when ``j <= p`` and, with a window, ``j > p - window``.
    """
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def linear_scan(log_a: Tensor, b: Tensor, h0: Tensor, chunk: int = 64) -> Tensor:
    """All states of ``h_t = a_t * h_{t-1} + b_t`` from ``h0``; inputs ``[n, D]``.

    Exact within float rounding: each chunk sums ``prod(a_{s+1..t}) * b_s`` in closed form
    (decays as differences of cumulative log-gates, never above 1), then carries on.
    """
    out, h = [], h0
    for s in range(0, b.shape[0], chunk):
        la, bb = log_a[s:s + chunk], b[s:s + chunk]
        cum = la.cumsum(0)
        c = cum.shape[0]
        causal = torch.ones(c, c, dtype=torch.bool, device=b.device).tril()[..., None]
        decay = torch.where(causal, cum[:, None, :] - cum[None, :, :], -math.inf).exp()
        states = torch.einsum("tsd,sd->td", decay, bb) + cum.exp() * h
        out.append(states)
        h = states[-1]
    return torch.cat(out) if out else b.new_zeros(b.shape)


# --------------------------------------------------------------------------- modules

class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        cfg, t = self.cfg, x.shape[0]
        q = self.wq(x).view(t, cfg.n_heads, cfg.head_dim)
        k = self.wk(x).view(t, cfg.n_kv_heads, cfg.head_dim)
        v = self.wv(x).view(t, cfg.n_kv_heads, cfg.head_dim)
        q = apply_rope(q, positions, cfg.rope_theta)
        k = apply_rope(k, positions, cfg.rope_theta)
        return self.wo(ctx.attend(self.layer, q, k, v).reshape(t, cfg.d_model))


class Recurrence(nn.Module):
    """Gated linear recurrence: ``h_t = a_t h_{t-1} + (1 - a_t) W_u x_t``,
    ``a_t = sigmoid(W_a x_t + bias)``; output ``W_o (h_t * silu(W_g x_t))``."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        d = cfg.d_model
        self.w_a = nn.Linear(d, d, bias=True)
        self.w_u = nn.Linear(d, d, bias=False)
        self.w_g = nn.Linear(d, d, bias=False)
        self.w_o = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        z = self.w_a(x)
        log_a, b = F.logsigmoid(z), torch.sigmoid(-z) * self.w_u(x)
        h0 = ctx.read_states(self.layer)["h"]
        states = [linear_scan(log_a[a:e], b[a:e], h0[i]) for i, (a, e) in enumerate(ctx.bounds)]
        ctx.write_states(self.layer, {"h": torch.stack([s[-1] for s in states])})
        return self.w_o(torch.cat(states) * F.silu(self.w_g(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.eps = cfg.norm_eps
        self.norm1 = nn.Parameter(torch.ones(cfg.d_model))
        self.norm2 = nn.Parameter(torch.ones(cfg.d_model))
        mixer = Recurrence if cfg.layers[layer] == "recurrent" else Attention
        self.mixer = mixer(cfg, layer)
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, h: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        h = h + self.mixer(rms_norm(h, self.norm1, self.eps), positions, ctx)
        x = rms_norm(h, self.norm2, self.eps)
        return h + self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class TinyLM(nn.Module):
    """Decoder-only LM over packed tokens; history comes from a ``MixerContext``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg, self.spec = cfg, cfg.spec()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(len(cfg.layers)))
        self.norm = nn.Parameter(torch.ones(cfg.d_model))
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def init_weights(self, seed: int) -> None:
        """N(0, 1/fan_in) projections (residual outputs scaled down by depth), unit
        embeddings, unit norms, gate bias 2 (a ~ 0.88: a few tokens of memory)."""
        gen = torch.Generator().manual_seed(seed)
        depth_scale = 1.0 / math.sqrt(2 * len(self.cfg.layers))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.startswith("norm") or ".norm" in name:
                    p.fill_(1.0)
                elif name.endswith("w_a.bias"):
                    p.fill_(2.0)
                else:
                    std = 1.0 if name.startswith("embed") else p.shape[-1] ** -0.5
                    if name.endswith(("wo.weight", "w_o.weight", "w_down.weight")):
                        std *= depth_scale
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: Tensor, positions: Tensor, ctx: MixerContext) -> Tensor:
        """Hidden states ``[T, D]`` of the packed ``tokens`` at ``positions``."""
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, positions, ctx)
        return h

    def logits(self, hidden: Tensor) -> Tensor:
        return self.head(rms_norm(hidden, self.norm, self.cfg.norm_eps))


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> TinyLM:
    """A TinyLM with seeded weights on ``device``, in eval mode, without gradients.

    Built on the meta device first, so torch's default initialisation neither runs nor
    draws from the global random generator.
    """
    with torch.device("meta"):
        model = TinyLM(cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model.eval().requires_grad_(False)


class DenseContext:
    """One sequence computed from position 0 with no cache: the reference forward."""

    def __init__(self, cfg: ModelConfig, positions: Tensor) -> None:
        self.cfg, self.positions = cfg, positions
        self.bounds = [(0, len(positions))]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, sinks=None) -> Tensor:
        window = self.cfg.window if self.cfg.layers[layer] == "sliding" else None
        return attention(q, k, v, self.positions, self.positions, window)

    def read_states(self, layer: int) -> dict[str, Tensor]:
        return {"h": torch.zeros(1, self.cfg.d_model, device=self.positions.device)}

    def write_states(self, layer: int, states: dict[str, Tensor]) -> None:
        pass  # one sequence from scratch: nothing to carry


@torch.inference_mode()
def reference_logits(model: TinyLM, tokens: list[int]) -> Tensor:
    """Logits ``[len(tokens), V]`` of a whole sequence computed from scratch."""
    device = model.head.weight.device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    positions = torch.arange(len(tokens), device=device)
    return model.logits(model(ids, positions, DenseContext(model.cfg, positions)))
