"""Each replica's KV pools as its ``GET /stats`` reports them, for ``/stats`` and the dashboard.

Off the request path: a task of its own asks every healthy replica for its ``/stats`` at
once, every ``kv_pools_interval_s``, and keeps the latest ``kv_cache.pools`` on the
``Replica`` (``kv_pools``, ``kv_pools_at``). Probes carry only what routing needs; these
figures are for people. Our back end only: ``--backend openai`` servers have no such
resource, and the router does not ask them.

A fetch that fails keeps the last figures (``/stats`` shows their age) and is no verdict on
the replica: health checks and the circuit breaker judge replicas, this only reports.

    watcher = PoolWatcher(registry, upstream, settings)
    watcher.start()   # first round at once, then every interval
    watcher.stop()
"""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import TypeAdapter, ValidationError


from wire.schemas import PoolStatsOut

from .registry import Health, Registry, Replica
from .settings import RouterSettings
from .upstream import Upstream

log = logging.getLogger("router")
_POOLS = TypeAdapter(tuple[PoolStatsOut, ...])


class PoolWatcher:
    def __init__(self, registry: Registry, upstream: Upstream,
                 settings: RouterSettings) -> None:
        self.registry = registry
        self.upstream = upstream
        self.interval_s = settings.kv_pools_interval_s
        self.timeout_s = settings.health_timeout_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="kv-pools")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def refresh(self) -> None:
        """One round: every healthy replica, concurrently."""
        replicas = [r for r in self.registry.replicas.values() if r.health is Health.HEALTHY]
        await asyncio.gather(*(self.fetch(r) for r in replicas))

    async def fetch(self, replica: Replica) -> None:
        """Ask one replica; keep its pools if it answered them."""
        try:
            status, body = await self.upstream.get_json(replica.url + "/stats",
                                                        self.timeout_s)
        except (TimeoutError, OSError, ValueError) as exc:
            log.debug("replica %s: GET /stats failed: %s: %s", replica.url,
                      type(exc).__name__, exc)
            return
        if status != 200 or not isinstance(body, dict):
            log.debug("replica %s: GET /stats answered %s", replica.url, status)
            return
        try:
            kv = body.get("kv_cache")
            pools = _POOLS.validate_python(kv.get("pools") if isinstance(kv, dict) else None)
        except ValidationError as exc:
            log.debug("replica %s: no KV pools in its /stats: %s", replica.url, exc)
            return
        replica.kv_pools, replica.kv_pools_at = pools, time.monotonic()

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)
