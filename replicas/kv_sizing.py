"""How many KV pages a replica reserves in each pool: ``--kv-pages``, or a share of memory.

A model has a pool per life cycle (full attention, each sliding window, recurrent), each
with pages of its own size: an attention page holds one block of K/V of the pool's layers,
a recurrent page one sequence's states of every recurrent layer (a live state or a
snapshot), which can weigh as much as dozens of blocks. So each pool gets its own count:

- ``--kv-pages N``: N pages in every pool; ``--kv-pages 4096,512,64``: one count per pool,
  in the order the start-up log names them (full, sliding windows smallest first,
  recurrent);
- unset, from a byte budget: on CUDA, as vLLM's ``gpu_memory_utilization``, the replica may
  use ``kv_memory_fraction`` (default 0.9) of the device's total memory; what is in use
  once the weights are loaded is subtracted, and the rest, less a reserve for activations,
  goes to the pools. On the CPU only when ``--kv-memory-fraction`` is given (a share of
  ``MemAvailable``); otherwise ``DEFAULT_PAGES`` in every pool (a CPU replica is usually a
  test or a demo next to other processes). The budget is split so that every attention
  pool has the same number of pages (a cached block keeps a page in each), and the
  recurrent pool, when there is one beside them, ``RECURRENT_SHARE`` of the bytes (at least
  ``2 * max_num_seqs`` pages: a live state per running sequence, and as many snapshots);
- ``--kv-cache-bytes B``: that budget, split as above, for any engine; for the sim engine
  of a model (``--engine sim --model DIR``, no storage) from the sizes its pages would
  have on a torch replica, so a sim replica's pools are a real replica's;
- engines without page storage (``sim``): ``DEFAULT_PAGES`` (or ``--kv-pages``) per pool.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger("replicas.kv")

DEFAULT_PAGES = 256
DEFAULT_CUDA_FRACTION = 0.9
ACTIVATION_RESERVE_BYTES = 1 << 30  # left free on CUDA for activations and the allocator
RECURRENT_SHARE = 0.25  # of the KV budget, for live states and snapshots beside attention


@dataclass(frozen=True)
class KVPlan:
    num_pages: int | tuple[int, ...]  # every pool's, or one per pool
    bytes_per_page: int  # one page of every pool (0: bookkeeping only)
    source: str  # how num_pages was chosen, for the log
    pool_bytes: tuple[int, ...] = ()  # one page of each pool

    def pages(self, num_pools: int) -> tuple[int, ...]:
        if isinstance(self.num_pages, tuple):
            return self.num_pages
        return (self.num_pages,) * num_pools

    def describe(self, tokens_per_block: int, num_pools: int,
                 names: list[str] | None = None) -> str:
        pages = self.pages(num_pools)
        if self.pool_bytes:
            total = sum(n * b for n, b in zip(pages, self.pool_bytes))
        else:
            total = pages[0] * self.bytes_per_page if len(set(pages)) == 1 else 0
        if isinstance(self.num_pages, int):
            what = (f"{self.num_pages} pages in each of {num_pools} pools "
                    f"({self.num_pages * tokens_per_block} tokens per pool")
        else:
            names = names or [f"pool {i}" for i in range(num_pools)]
            what = ", ".join(f"{name} {n}" for name, n in zip(names, pages)) + " pages ("
            what += f"{tokens_per_block} tokens per attention page"
        return f"KV cache: {what}, {total / 2**20:.1f} MiB reserved; {self.source})"


def page_bytes(layouts) -> int:
    """Bytes of one page of every pool (``PageLayout`` list from the engine)."""
    return sum(_layout_bytes(layout) for layout in layouts)


def _layout_bytes(layout) -> int:
    import torch

    dtype = getattr(torch, layout.dtype) if isinstance(layout.dtype, str) else layout.dtype
    return math.prod(layout.shape) * torch.empty((), dtype=dtype).element_size()


def plan_kv_pages(settings, engine) -> KVPlan:
    """The pages of each pool to reserve for ``engine`` under ``settings``."""
    layouts = _layouts(settings, engine)
    sizes = tuple(_layout_bytes(layout) for layout in layouts) if layouts else ()
    if not sizes:  # no storage: the sizes a torch replica's pages would have, if known
        sizes = tuple(getattr(engine, "pool_page_bytes", lambda: None)() or ())
    per_page = sum(sizes)
    kinds = list(getattr(engine, "kinds", ())) or ["full"] * len(sizes)
    if settings.kv_pages is not None:
        return KVPlan(_explicit(settings.kv_pages), per_page, "--kv-pages", sizes)
    if settings.kv_cache_bytes is not None:
        if not per_page:
            raise ValueError("--kv-cache-bytes needs a model whose page sizes are known "
                             "(--engine torch, or --engine sim --model DIR); give --kv-pages")
        source = f"--kv-cache-bytes {settings.kv_cache_bytes}"
        return KVPlan(_split(settings.kv_cache_bytes, sizes, kinds, settings.max_num_seqs,
                             source), per_page, source, sizes)
    device = getattr(engine, "device", None)
    fraction = settings.kv_memory_fraction
    if not layouts or device is None:
        return KVPlan(DEFAULT_PAGES, per_page, "default for this engine", sizes)
    if device.type == "cuda":
        budget = _cuda_budget(device, fraction or DEFAULT_CUDA_FRACTION)
        source = f"{fraction or DEFAULT_CUDA_FRACTION:.2f} of the GPU's memory"
    elif fraction is not None:
        budget = int(_available_host_bytes() * fraction)
        source = f"{fraction:.2f} of the available host memory"
    else:
        return KVPlan(DEFAULT_PAGES, per_page, "default on the CPU; set --kv-pages or "
                      "--kv-memory-fraction for more", sizes)
    return KVPlan(_split(budget, sizes, kinds, settings.max_num_seqs, source), per_page,
                  source, sizes)


def _explicit(kv_pages: int | tuple[int, ...]) -> int | tuple[int, ...]:
    return kv_pages if isinstance(kv_pages, int) else tuple(kv_pages)


def _split(budget: int, sizes: tuple[int, ...], kinds: list[str], max_num_seqs: int,
           source: str) -> int | tuple[int, ...]:
    """Pages per pool from ``budget`` bytes: attention pools alike, the recurrent pool its
    share (see the module's docstring)."""
    attention = sum(size for size, kind in zip(sizes, kinds) if kind != "recurrent")
    recurrent = sum(size for size, kind in zip(sizes, kinds) if kind == "recurrent")
    states = 0
    if recurrent:
        share = budget * RECURRENT_SHARE if attention else budget
        states = max(2 * max_num_seqs, int(share // recurrent))
    pages = (budget - states * recurrent) // attention if attention else states
    if pages < 1 or (recurrent and budget < states * recurrent + attention):
        raise ValueError(f"no memory left for the KV cache: {budget / 2**20:.0f} MiB for "
                         f"pages of {sum(sizes) / 2**20:.2f} MiB ({source}); raise "
                         "--kv-memory-fraction or give --kv-pages")
    if not recurrent:
        return int(pages)
    return tuple(states if kind == "recurrent" else int(pages) for kind in kinds)


def _layouts(settings, engine):
    """The engine's page layouts, which need tokens_per_block (a throwaway cache_config)."""
    engine.cache_config(1, settings.tokens_per_block, settings.enable_partial_reuse)
    return engine.page_layouts()


def _cuda_budget(device, fraction: float) -> int:
    import torch

    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    return int(total * fraction) - in_use - ACTIVATION_RESERVE_BYTES


def _available_host_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("cannot read MemAvailable from /proc/meminfo; give --kv-pages")
