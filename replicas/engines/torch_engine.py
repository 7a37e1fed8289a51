"""TorchEngine: a transformer computing on the KV-cache manager's pages.

The model is a ``PagedLM`` (``replicas.models.base``) that declares its layers as specs: a
seeded preset (``replicas.model``,
``TorchEngine.from_preset``) or a Hugging Face checkpoint (``replicas.models``,
``TorchEngine.from_checkpoint``). One pool per kind of layer the model has, in the order
full, sliding (one pool per window size), recurrent (MLP-only layers have none); a page holds
that pool's layers together, on the model's device::

    full / sliding page:  [n_layers_of_pool, 2 (K, V), tokens_per_block, n_kv_heads, head_dim]
                          or, where keys and values differ in width (``v_head_dim``, e.g.
                          MLA's latent and shared key part), side by side:
                          [n_layers_of_pool, tokens_per_block, n_kv_heads, head_dim + v_head_dim]
    recurrent page:       [n_recurrent_layers, sum of the layer's state sizes] float32
                          (a live state, or a snapshot; each StateSpec a slice of the row)

Keys are stored after RoPE, at their absolute positions. A step has two halves:

1. On the event loop's thread (``_plan``): read each item's block tables and live state
   page into index tensors, copied to the device at once. This is the only contact with the
   manager, and it only reads.
2. On the engine's one compute thread (``_compute``): run the model once over the new
   tokens of all items packed together (prefill chunks and decodes alike). Each attention
   layer writes its new K/V into the pages, then reads each sequence's keys back from the
   blocks its window reaches; recurrent layers carry the live state page. Then sample:
   greedy on the device.

Every model call runs on that one thread (``run_on_compute_thread``), never on a pool's
next free worker: torch's CPU kernels parallelise through an OpenMP team per calling
thread, and a second team still spin-waiting for work (the default wait policy) takes the
cores from the one computing. On 2 cores that cost decode ~30% (``bench.hf_engine``).

The scheduler owns ``resize`` (before a step) and ``commit`` (after): a snapshot taken at
commit copies the live state this engine wrote, and a reused prefix arrives with its
snapshot already restored into the live page.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time
from pathlib import Path

import torch
from torch import Tensor

from kvcache import CacheConfig, PageLayout
from replicas.engines.base import Engine, SamplingParams, StepItem
from replicas.engines.paged import Batch, PagedContext, plan_batch
from replicas.engines.pools import PoolPlan
from replicas.models.base import AttentionSpec, PagedLM

# Prefill rate before any measurement: an assumed arithmetic rate over 2 FLOPs/parameter.
_ASSUMED_FLOPS = {"cpu": 1.5e10, "cuda": 2e12}
_EMA_WEIGHT = 0.2
_MIN_MEASURED_TOKENS = 64  # smaller prefill steps mostly measure per-step overhead


class TorchEngine(Engine):
    """``model`` on paged KV; ``info`` says what it is (in ``describe()``)."""

    name = "torch"

    def __init__(self, model: PagedLM, info: dict | None = None) -> None:
        self.model, self.info = model, dict(info or {})
        self.spec = model.spec
        self.device = next(model.parameters()).device
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.pools = PoolPlan.of(self.spec)
        self.kinds = self.pools.kinds  # per pool
        self.windows = self.pools.windows  # per pool: None unless sliding
        self.pool_layers = self.pools.layers
        self.slots = self.pools.slots
        self.pool_specs = self.pools.specs
        self.tokens_per_block: int | None = None
        self.storage: dict[int, Tensor] | None = None
        flops = _ASSUMED_FLOPS.get(self.device.type, _ASSUMED_FLOPS["cpu"])
        self._rate = flops / (2 * self.num_parameters)
        self._measured_steps = 0
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def from_preset(cls, preset: str = "default", device: str | torch.device | None = None,
                    seed: int = 0, **overrides) -> TorchEngine:
        """A seeded TinyLM preset; ``overrides`` replace fields of its ``ModelConfig``."""
        from replicas.model import PRESETS, build_model

        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        config = dataclasses.replace(PRESETS[preset], **overrides)
        model = build_model(config, seed, _device(device))
        return cls(model, {"preset": preset, "seed": seed, "d_model": config.d_model,
                           "n_heads": config.n_heads, "window": config.window})

    @classmethod
    def from_checkpoint(cls, directory: str | Path, dtype: str | None = None,
                        device: str | torch.device | None = None) -> TorchEngine:
        """A Hugging Face checkpoint directory; raises ``CheckpointError``."""
        from replicas.checkpoint import load_checkpoint

        model = load_checkpoint(directory, dtype, _device(device))
        return cls(model, {"model": str(directory), "architecture": model.args.architecture})

    # -- configuration ---------------------------------------------------------------

    def cache_config(self, num_pages: int, tokens_per_block: int,
                     enable_partial_reuse: bool) -> CacheConfig:
        config = self.pools.cache_config(num_pages, tokens_per_block, enable_partial_reuse)
        self.tokens_per_block = tokens_per_block
        # a page's rows in its pool's storage viewed as [rows, KV, hd] (paged.py's writes;
        # [rows, KV, hd + vd] where keys and values sit side by side)
        self.page_rows = tuple(None if kind == "recurrent"
                               else len(layers) * self.layer_rows(pool) * tokens_per_block
                               for pool, (kind, layers) in enumerate(zip(self.kinds,
                                                                         self.pool_layers)))
        return config

    def page_layouts(self) -> list[PageLayout]:
        """One layout per pool; needs ``cache_config`` first (pages span a block)."""
        if self.tokens_per_block is None:
            raise RuntimeError("call cache_config() before page_layouts(): an attention "
                               "page's shape includes tokens_per_block")
        return self.pools.page_layouts(self.tokens_per_block, _dtype_name(self.spec.dtype),
                                       str(self.device))

    def layer_rows(self, pool: int) -> int:
        """Blocks of ``tokens_per_block`` rows one layer has in an attention page: 2 (its
        keys, then its values), or 1 where they sit side by side in one row."""
        return 2 if self.pool_specs[pool].split_kv else 1

    def pool_names(self) -> list[str]:
        """``full``, ``sliding(W)``, ``recurrent`` per pool, for messages and statistics."""
        return self.pools.names()

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
        tokens = await self.run_on_compute_thread(self._compute_and_sample, batch, items)
        self._observe(batch, time.perf_counter() - started)
        return tokens

    async def run_on_compute_thread(self, fn, /, *args):
        """``fn(*args)`` on the engine's one compute thread (started on first use)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.compute_thread, functools.partial(fn, *args))

    @property
    def compute_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The single-worker executor every step's model call runs on."""
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="torch-engine")
        return self._thread

    def close(self) -> None:
        """Let the compute thread end after the step it may be running (not waited for);
        a later step starts another."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None

    def forward_logits(self, items: list[StepItem]) -> list[Tensor]:
        """Compute like ``step`` (pages written too) but return each item's last-position
        logits (float32, on the CPU) instead of sampling."""
        return list(self._compute(self._plan(items)).float().cpu())

    def _compute_and_sample(self, batch: Batch, items: list[StepItem]) -> list[int | None]:
        """Every pick on the device, greedy or drawn from the sequence's own seeded
        generator (kept on the device too); one copy of the picks back to the host."""
        logits = self._compute(batch)
        picks = logits.argmax(-1)
        drawn = [i for i, item in enumerate(items)
                 if item.sample is not None and item.sample.temperature > 0]
        if drawn:
            picks[drawn] = torch.cat([draw(logits[i].float(), items[i].sample, items[i].state)
                                      for i in drawn])
        return [None if item.sample is None else pick
                for pick, item in zip(picks.tolist(), items)]

    def _compute(self, batch: Batch) -> Tensor:
        """Last-position logits ``[len(items), V]``. Writes K/V and live states."""
        with torch.inference_mode():
            hidden = self.model(batch.tokens, batch.positions, PagedContext(self, batch))
            return self.model.logits(hidden[batch.last])

    def _plan(self, items: list[StepItem]) -> Batch:
        if self.storage is None:
            raise RuntimeError("bind(manager) before stepping")
        for item in items:
            _check_item(item, self.spec.max_model_len)
        return plan_batch(self, items)

    # -- what the router and operators see --------------------------------------------

    def _observe(self, batch: Batch, seconds: float) -> None:
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
        return self.spec.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def describe(self) -> dict:
        s = self.spec
        attention = [p for p in self.pool_specs if isinstance(p, AttentionSpec)]
        return {"engine": self.name, **self.info, "parameters": self.num_parameters,
                "device": str(self.device), "dtype": _dtype_name(s.dtype),
                "layers": list(s.kinds),
                "n_kv_heads": attention[0].n_kv_heads if attention else 0,
                "head_dim": attention[0].head_dim if attention else 0,
                "windows": sorted({w for w in self.windows if w is not None}),
                "pools": self.pool_names(),
                "vocab_size": s.vocab_size, "max_model_len": s.max_model_len}


def _device(device: str | torch.device | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    """Greedy at temperature 0; else ``draw``'s pick, as an int."""
    if params.temperature == 0:
        return int(logits.argmax())
    return int(draw(logits, params, state))


def draw(logits: Tensor, params: SamplingParams, state: dict) -> Tensor:
    """Temperature + top-p (nucleus) sampling on ``logits``' device from a generator kept
    in ``state`` (seeded from ``params.seed``, or at random without one): a 1-element
    tensor, read by nobody until the step's picks go back to the host together."""
    gen = state.get("generator")
    if gen is None:
        gen = torch.Generator(device=logits.device)
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(params.seed)
        state["generator"] = gen
    probs, order = torch.softmax(logits / params.temperature, -1).sort(descending=True,
                                                                        stable=True)
    if params.top_p < 1:
        probs = probs * (probs.cumsum(0) - probs < params.top_p)  # smallest set reaching top_p
    return order[torch.multinomial(probs, 1, generator=gen)]
