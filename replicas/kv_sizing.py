"""How many KV pages a replica reserves: ``--kv-pages``, or a share of the device's memory.

Every life cycle's pool has the same number of pages (``CacheConfig.num_pages``), so one
"page index" costs the sum of one page of every pool. With ``--kv-pages`` unset:

- on CUDA, as vLLM's ``gpu_memory_utilization``: the replica may use ``kv_memory_fraction``
  (default 0.9) of the device's total memory; what is in use once the weights are loaded
  (weights, the CUDA context, anything else on the device) is subtracted, and the rest,
  less a reserve for activations, goes to the KV pools;
- on the CPU, only when ``--kv-memory-fraction`` is given: that share of the memory the
  kernel reports available (``MemAvailable``); otherwise ``DEFAULT_PAGES`` (a CPU replica
  is usually a test or a demo next to other processes);
- engines without page storage (``sim``): ``DEFAULT_PAGES``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger("replicas.kv")

DEFAULT_PAGES = 256
DEFAULT_CUDA_FRACTION = 0.9
ACTIVATION_RESERVE_BYTES = 1 << 30  # left free on CUDA for activations and the allocator


@dataclass(frozen=True)
class KVPlan:
    num_pages: int
    bytes_per_page: int  # one page of every pool (0: bookkeeping only)
    source: str  # how num_pages was chosen, for the log

    def describe(self, tokens_per_block: int, num_pools: int) -> str:
        total = self.num_pages * self.bytes_per_page
        return (f"KV cache: {self.num_pages} pages in each of {num_pools} pools "
                f"({self.num_pages * tokens_per_block} tokens per pool, {total / 2**20:.1f} "
                f"MiB reserved; {self.source})")


def page_bytes(layouts) -> int:
    """Bytes of one page of every pool (``PageLayout`` list from the engine)."""
    import torch

    total = 0
    for layout in layouts:
        dtype = getattr(torch, layout.dtype) if isinstance(layout.dtype, str) else layout.dtype
        total += math.prod(layout.shape) * torch.empty((), dtype=dtype).element_size()
    return total


def plan_kv_pages(settings, engine) -> KVPlan:
    """The pages per pool to reserve for ``engine`` under ``settings``."""
    layouts = _layouts(settings, engine)
    per_page = page_bytes(layouts) if layouts else 0
    if settings.kv_pages is not None:
        return KVPlan(settings.kv_pages, per_page, "--kv-pages")
    device = getattr(engine, "device", None)
    fraction = settings.kv_memory_fraction
    if not per_page or device is None:
        return KVPlan(DEFAULT_PAGES, per_page, "default for this engine")
    if device.type == "cuda":
        budget = _cuda_budget(device, fraction or DEFAULT_CUDA_FRACTION)
        source = f"{fraction or DEFAULT_CUDA_FRACTION:.2f} of the GPU's memory"
    elif fraction is not None:
        budget = int(_available_host_bytes() * fraction)
        source = f"{fraction:.2f} of the available host memory"
    else:
        return KVPlan(DEFAULT_PAGES, per_page, "default on the CPU; set --kv-pages or "
                      "--kv-memory-fraction for more")
    pages = budget // per_page
    if pages < 1:
        raise ValueError(f"no memory left for the KV cache: {budget / 2**20:.0f} MiB for "
                         f"pages of {per_page / 2**20:.2f} MiB ({source}); raise "
                         "--kv-memory-fraction or give --kv-pages")
    return KVPlan(int(pages), per_page, source)


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
