"""TorchEngine: a real TinyLM (``replicas.model``) computing on the KV-cache manager's pages.

One pool per kind of layer the model has, in the order full, sliding, recurrent; a page
holds that kind's layers together (float32, on the engine's device)::

    full / sliding page:  [n_layers_of_kind, 2 (K, V), tokens_per_block, n_kv_heads, head_dim]
    recurrent page:       [n_recurrent_layers, d_model]   (a live state, or a snapshot)

Keys are stored after RoPE, at their absolute positions. A step has two halves:

1. On the event loop's thread (``_plan``): read each item's block tables and live state
   page into index tensors. This is the only contact with the manager, and it only reads.
2. In a worker thread (``_compute``): gather each sequence's earlier K/V from its pages (a
   sliding layer only the blocks its window reaches), run the model over the new tokens of
   all items packed together, write their K/V and the recurrent states into the pages,
   sample.

The scheduler owns ``resize`` (before a step) and ``commit`` (after): a snapshot taken at
commit copies the live state this engine wrote, and a reused prefix arrives with its
snapshot already restored into the live page.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcache import CacheConfig, FullAttention, PageLayout, Recurrent, SlidingWindow
from replicas.engines.base import Engine, SamplingParams, StepItem
from replicas.model import LAYER_KINDS, PRESETS, attention, build_model, linear_scan

# Prefill rate before any measurement: an assumed arithmetic rate over 2 FLOPs/parameter.
_ASSUMED_FLOPS = {"cpu": 1.5e10, "cuda": 2e12}
_EMA_WEIGHT = 0.2
_MIN_MEASURED_TOKENS = 64  # smaller prefill steps mostly measure per-step overhead


@dataclass
class _Seq:
    """One item of a step, as index data (no reference to the cache)."""

    start: int
    length: int
    past: dict[int, tuple[int, Tensor]]  # attention pool -> (first position read, pages)
    live_page: int | None


@dataclass
class _Batch:
    seqs: list[_Seq]
    tokens: Tensor  # [T] new tokens of all items, packed
    positions: Tensor  # [T]
    writes: dict[int, tuple[Tensor, Tensor]]  # attention pool -> (page, slot) per token
    prefill_tokens: int


class _PagedContext:
    """``MixerContext`` over the pages: history from pages, new K/V and states into them."""

    def __init__(self, engine: TorchEngine, batch: _Batch) -> None:
        self._engine, self._batch = engine, batch
        ends = list(itertools.accumulate(s.length for s in batch.seqs))
        self._bounds = list(zip([0, *ends[:-1]], ends))
        self._past = {pool: [self._gather(pool, s) for s in batch.seqs]
                      for pool in batch.writes}

    def _gather(self, pool: int, seq: _Seq) -> Tensor:
        """K/V of positions ``lo .. start-1`` for every layer of the pool: [L, 2, m, KV, hd]."""
        lo, pages = seq.past[pool]
        store, tpb = self._engine.storage[pool], self._engine.tokens_per_block
        kv = store[pages].permute(1, 2, 0, 3, 4, 5).flatten(2, 3)
        skip = lo % tpb  # the first page starts at block boundary (lo // tpb) * tpb
        return kv[:, :, skip:skip + seq.start - lo]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        pool, slot = self._engine.slots[layer]
        kind = self._engine.kinds[pool]
        window = self._engine.config.window if kind == "sliding" else None
        pages = self._engine.storage[pool][:, slot]
        page, offset = self._batch.writes[pool]
        pages[:, 0][page, offset] = k
        pages[:, 1][page, offset] = v
        positions, out = self._batch.positions, []
        for (a, e), seq, past in zip(self._bounds, self._batch.seqs, self._past[pool]):
            keys = torch.cat((past[slot, 0], k[a:e]))
            values = torch.cat((past[slot, 1], v[a:e]))
            k_pos = torch.arange(seq.start + seq.length - keys.shape[0], seq.start + seq.length,
                                 device=k.device)
            out.append(attention(q[a:e], keys, values, positions[a:e], k_pos, window))
        return torch.cat(out)

    def recur(self, layer: int, log_a: Tensor, b: Tensor) -> Tensor:
        pool, slot = self._engine.slots[layer]
        store, out = self._engine.storage[pool], []
        for (a, e), seq in zip(self._bounds, self._batch.seqs):
            states = linear_scan(log_a[a:e], b[a:e], store[seq.live_page, slot])
            store[seq.live_page, slot] = states[-1]
            out.append(states)
        return torch.cat(out)


class TorchEngine(Engine):
    """TinyLM on paged KV. ``overrides`` replace fields of the preset's ``ModelConfig``."""

    name = "torch"

    def __init__(self, preset: str = "default", device: str | torch.device | None = None,
                 seed: int = 0, **overrides) -> None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        self.preset, self.seed = preset, seed
        self.config = dataclasses.replace(PRESETS[preset], **overrides)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = build_model(self.config, seed, self.device)
        self.kinds = tuple(k for k in LAYER_KINDS if k in self.config.layers)  # pool order
        self.slots = {layer: (pool, self.config.layer_ids(kind).index(layer))
                      for pool, kind in enumerate(self.kinds)
                      for layer in self.config.layer_ids(kind)}
        self.tokens_per_block: int | None = None
        self.storage: dict[int, Tensor] | None = None
        flops = _ASSUMED_FLOPS.get(self.device.type, _ASSUMED_FLOPS["cpu"])
        self._rate = flops / (2 * self.model.num_parameters())
        self._measured_steps = 0

    # -- configuration ---------------------------------------------------------------

    def cache_config(self, num_pages: int, tokens_per_block: int,
                     enable_partial_reuse: bool) -> CacheConfig:
        life = {"full": FullAttention(), "sliding": SlidingWindow(window=self.config.window),
                "recurrent": Recurrent()}
        self.tokens_per_block = tokens_per_block
        return CacheConfig(tokens_per_block=tokens_per_block, num_pages=num_pages,
                           life_cycles=tuple(life[k] for k in self.kinds),
                           enable_partial_reuse=enable_partial_reuse)

    def page_layouts(self) -> list[PageLayout]:
        """One layout per pool; needs ``cache_config`` first (pages span a block)."""
        if self.tokens_per_block is None:
            raise RuntimeError("call cache_config() before page_layouts(): an attention "
                               "page's shape includes tokens_per_block")
        cfg, layouts = self.config, []
        for kind in self.kinds:
            n = len(cfg.layer_ids(kind))
            shape = ((n, cfg.d_model) if kind == "recurrent" else
                     (n, 2, self.tokens_per_block, cfg.n_kv_heads, cfg.head_dim))
            layouts.append(PageLayout(shape, "float32", str(self.device)))
        return layouts

    def bind(self, manager) -> None:
        """Use ``manager``'s pages (its tokens_per_block becomes this engine's)."""
        expected = self.cache_config(manager.config.num_pages, manager.config.tokens_per_block,
                                     manager.config.enable_partial_reuse)
        if manager.config != expected:
            raise ValueError(f"manager config {manager.config} does not match this model's "
                             f"{expected}; build it from engine.cache_config()")
        storage = {pool: manager.page_storage(pool) for pool in range(len(self.kinds))}
        if any(s is None for s in storage.values()):
            raise ValueError("manager has no page storage; pass layouts=engine.page_layouts()")
        self.manager, self.storage = manager, storage

    # -- the step --------------------------------------------------------------------

    async def step(self, items: list[StepItem]) -> list[int | None]:
        if not items:
            return []
        batch = self._plan(items)
        started = time.perf_counter()
        tokens = await asyncio.to_thread(self._compute_and_sample, batch, items)
        self._observe(batch, time.perf_counter() - started)
        return tokens

    def forward_logits(self, items: list[StepItem]) -> list[Tensor]:
        """Compute like ``step`` (pages written too) but return each item's last-position
        logits (float32, on the CPU) instead of sampling."""
        return list(self._compute(self._plan(items)).float().cpu())

    def _compute_and_sample(self, batch: _Batch, items: list[StepItem]) -> list[int | None]:
        logits = self._compute(batch).float().cpu()
        return [None if item.sample is None else sample_token(row, item.sample, item.state)
                for row, item in zip(logits, items)]

    def _compute(self, batch: _Batch) -> Tensor:
        """Last-position logits ``[len(items), V]``. Writes K/V and live states."""
        with torch.inference_mode():
            hidden = self.model(batch.tokens, batch.positions, _PagedContext(self, batch))
            last = torch.tensor([s.length for s in batch.seqs]).cumsum(0) - 1
            return self.model.logits(hidden[last.to(self.device)])

    def _plan(self, items: list[StepItem]) -> _Batch:
        if self.storage is None:
            raise RuntimeError("bind(manager) before stepping")
        writes: dict[int, list[tuple[Tensor, Tensor]]] = {
            pool: [] for pool, kind in enumerate(self.kinds) if kind != "recurrent"}
        seqs = [self._plan_seq(item, writes) for item in items]
        dev = self.device
        return _Batch(
            seqs=seqs,
            tokens=torch.tensor([t for item in items for t in item.tokens], device=dev),
            positions=torch.cat([torch.arange(s.start, s.start + s.length) for s in seqs]
                                ).to(dev),
            writes={pool: (torch.cat([p for p, _ in w]).to(dev),
                           torch.cat([o for _, o in w]).to(dev)) for pool, w in writes.items()},
            prefill_tokens=sum(len(item.tokens) for item in items if item.is_prefill),
        )

    def _plan_seq(self, item: StepItem, writes: dict) -> _Seq:
        """Read ``item``'s pages; append its per-token (page, slot) writes to ``writes``."""
        _check_item(item, self.config.max_model_len)
        start, n, tpb = item.start, len(item.tokens), self.tokens_per_block
        positions = torch.arange(start, start + n)
        past: dict[int, tuple[int, Tensor]] = {}
        for pool in writes:
            table = item.cache.block_table(pool)
            lo = max(0, start + 1 - self.config.window) if self.kinds[pool] == "sliding" else 0
            read = table[lo // tpb: -(-start // tpb)]
            new = table[start // tpb: (start + n - 1) // tpb + 1]
            if None in read or None in new:
                raise RuntimeError(f"{item.seq_id}: a page this step needs is gone (pool "
                                   f"{pool}, positions {lo}..{start + n - 1})")
            past[pool] = (lo, torch.tensor(read, dtype=torch.long).to(self.device))
            page = torch.tensor(new, dtype=torch.long)[positions // tpb - start // tpb]
            writes[pool].append((page, positions % tpb))
        live = None
        if "recurrent" in self.kinds:
            live = item.cache.live_state_page(self.kinds.index("recurrent"))
            if live is None:
                raise RuntimeError(f"{item.seq_id}: no live state page; resize() first")
        return _Seq(start, n, past, live)

    # -- what the router and operators see --------------------------------------------

    def _observe(self, batch: _Batch, seconds: float) -> None:
        """Fold a prefill step's tokens/s into the moving average. The first measured step
        pays one-off warm-up (allocator, kernels) and is skipped."""
        if batch.prefill_tokens < _MIN_MEASURED_TOKENS or seconds <= 0:
            return
        self._measured_steps += 1
        if self._measured_steps > 1:
            rate = int(batch.tokens.numel()) / seconds
            self._rate += _EMA_WEIGHT * (rate - self._rate)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._rate

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def describe(self) -> dict:
        cfg = self.config
        return {"engine": self.name, "preset": self.preset, "seed": self.seed,
                "parameters": self.model.num_parameters(), "device": str(self.device),
                "dtype": "float32", "layers": list(cfg.layers), "d_model": cfg.d_model,
                "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "window": cfg.window,
                "max_model_len": cfg.max_model_len}


def _check_item(item: StepItem, max_model_len: int) -> None:
    end = item.start + len(item.tokens)
    if not item.tokens:
        raise ValueError(f"{item.seq_id}: a step item needs at least one token")
    if item.start != item.cache.num_committed_tokens:
        raise ValueError(f"{item.seq_id}: start {item.start} != the cache's "
                         f"{item.cache.num_committed_tokens} committed tokens")
    if end > item.cache.capacity or end > max_model_len:
        raise ValueError(f"{item.seq_id}: positions up to {end} exceed the cache capacity "
                         f"{item.cache.capacity} (resize first) or max_model_len {max_model_len}")
    if item.sample is not None and (item.sample.temperature < 0
                                    or not 0 < item.sample.top_p <= 1):
        raise ValueError(f"{item.seq_id}: need temperature >= 0 and 0 < top_p <= 1")


def sample_token(logits: Tensor, params: SamplingParams, state: dict) -> int:
    """Greedy at temperature 0; else temperature + top-p (nucleus) sampling from a CPU
    generator kept in ``state`` (seeded from ``params.seed``, or at random without one)."""
    if params.temperature == 0:
        return int(logits.argmax())
    gen = state.get("generator")
    if gen is None:
        gen = torch.Generator()
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(params.seed)
        state["generator"] = gen
    probs, order = torch.softmax(logits / params.temperature, -1).sort(descending=True,
                                                                        stable=True)
    if params.top_p < 1:
        probs = probs * (probs.cumsum(0) - probs < params.top_p)  # smallest set reaching top_p
    return int(order[torch.multinomial(probs, 1, generator=gen)])
