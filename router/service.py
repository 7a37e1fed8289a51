"""RouterService: admission and health of replicas, routing decisions.

Per request: prepare (validate, tokenize once, derive the salt) -> decide (probe the
eligible replicas of the request's model under a deadline, let the policy choose) ->
forward to the best replica, retrying on the next best while nothing has reached the client
(``router.forward``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from dataclasses import dataclass

from text import ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_from_wire

from wire import jsonwire
from wire import tracing as otel
from wire.errors import APIError

from .api_keys import load_api_keys
from .forward import RetryBudget
from .policies import Candidate, Decision, make_policy
from .pools import PoolWatcher
from .registry import Health, Registry, Replica
from .requests import Prepared, RequestBuilder
from .settings import RouterSettings
from .tenants import Tenants
from .upstream import ProbeResult, Upstream

log = logging.getLogger("router")
decision_log = logging.getLogger("router.decisions")

TOKENIZER_TIMEOUT_S = 60.0  # GET /tokenizer: a large vocabulary is megabytes of JSON


@dataclass
class Routed:
    """A decision with what the router knew when it made it (for /stats and logs)."""

    at: float
    request_id: str
    model: str | None
    prompt_tokens: int
    decision: Decision
    probe_ms: float


def _why(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer within the deadline"
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


class RouterService:
    def __init__(self, settings: RouterSettings, tracer_provider=None) -> None:
        """``tracer_provider``: an OpenTelemetry TracerProvider to trace with instead of
        what the settings and the OTEL_* environment say (tests inject one)."""
        self.settings = settings
        self.tracing = _tracing(settings, tracer_provider)  # None: off (the usual case)
        # --tokenizer's, else the first replica's (GET /tokenizer); --backend openai: none
        # needed (bodies go through unchanged)
        self.tokenizer: Tokenizer | None = (
            load_tokenizer(settings.tokenizer) if settings.tokenizer is not None
            else ByteTokenizer() if settings.backend == "openai" else None)
        self._tokenizer_lock = asyncio.Lock()
        # --api-keys: tenants and their limits (a bad file: ValueError, a start-up error)
        self.tenants = (Tenants(load_api_keys(settings.api_keys), settings.tenant_secret)
                        if settings.api_keys else None)
        self.builder = RequestBuilder(settings, self.tokenizer, self.tenants)
        self.policy = make_policy(settings.policy, seed=settings.seed)
        if self.policy.needs_probe and settings.backend == "openai":
            raise ValueError(f"policy {settings.policy!r} probes replicas, which --backend "
                             "openai servers cannot answer; use approx_prefix or a probe-free "
                             "policy")
        self.registry = Registry(settings.failure_threshold, settings.open_seconds)
        self.upstream = Upstream(settings)
        self.retries = RetryBudget(settings.retry_budget_ratio)
        self.decisions: deque[Routed] = deque(maxlen=settings.decisions_kept)
        self.metrics = None  # set by the app (router.metrics.RouterMetrics)
        self._health_task: asyncio.Task | None = None
        self._discover_task: asyncio.Task | None = None
        self._discovered: set[str] = set()
        # replicas' KV pools for /stats, off the request path (our replicas only)
        self.pools = (PoolWatcher(self.registry, self.upstream, settings)
                      if settings.backend == "ours" else None)

    # -- life --------------------------------------------------------------------------

    async def start(self) -> None:
        for url in self.settings.replicas:
            self.registry.add(url)
        for replica in list(self.registry.replicas.values()):  # the first ready one's
            if self.tokenizer is not None:
                break
            if (await self.upstream.is_ready(replica.url))[0]:
                problem, _ = await self._load_tokenizer(replica)
                if problem:
                    log.warning("replica %s: %s", replica.url, problem)
        await asyncio.gather(*(self.check(r) for r in self.registry.replicas.values()))
        self._health_task = asyncio.create_task(self._health_loop(), name="health")
        if self.pools is not None:
            self.pools.start()
        if self.settings.discover_dns:
            await self.discover_once()
            self._discover_task = asyncio.create_task(self._discover_loop(), name="discover")

    async def stop(self) -> None:
        for task in (self._health_task, self._discover_task):
            if task is not None:
                task.cancel()
        if self.pools is not None:
            self.pools.stop()
        await self.upstream.close()
        if self.tracing is not None:  # the spans still batched go out now
            await asyncio.to_thread(self.tracing.shutdown)

    async def add_replica(self, url: str) -> Replica:
        """Admin: add a replica; it must pass the same checks as at start-up."""
        replica = self.registry.add(url)
        await self.check(replica)
        if replica.health is not Health.HEALTHY:
            self.registry.remove(url)
            raise APIError(400, f"replica {url} not added: {replica.problem}", param="url")
        return replica

    def remove_replica(self, url: str) -> None:
        self.registry.remove(url)
        self.policy.forget(url)

    # -- DNS discovery -----------------------------------------------------------------

    async def resolve(self, host: str, port: int) -> set[str]:
        """Base URLs of every address ``host`` resolves to (A and AAAA records)."""
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
        urls = set()
        for family, _, _, _, addr in infos:
            ip = addr[0]
            urls.add(f"http://[{ip}]:{port}" if family == socket.AF_INET6 else
                     f"http://{ip}:{port}")
        return urls

    async def discover_once(self) -> None:
        """Add replicas that appeared under the DNS name, drop those that vanished.
        A failed lookup changes nothing (a DNS hiccup must not empty the pool)."""
        host, _, port = self.settings.discover_dns.rpartition(":")
        try:
            found = await self.resolve(host, int(port))
        except OSError as exc:
            log.warning("DNS discovery of %s failed: %s", self.settings.discover_dns, exc)
            return
        for url in sorted(found - self._discovered):
            if self.registry.get(url) is None:
                replica = self.registry.add(url)
                await self.check(replica)
                log.info("discovered replica %s (%s)", url, replica.health.value)
        for url in sorted(self._discovered - found):
            if self.registry.get(url) is not None:
                self.remove_replica(url)
                log.info("replica %s left %s: removed", url, self.settings.discover_dns)
        self._discovered = found

    async def _discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.discover_interval_s)
            await self.discover_once()

    # -- admission and health ----------------------------------------------------------

    async def check(self, replica: Replica) -> None:
        """Health check; the first successful one also runs the admission check."""
        ok, why = await self.upstream.is_ready(replica.url)
        if not ok:
            if replica.health is not Health.REFUSED:
                if replica.health is not Health.UNHEALTHY:
                    log.warning("replica %s is unhealthy: %s", replica.url, why)
                replica.health, replica.problem = Health.UNHEALTHY, why
            return
        if replica.model is None:
            problem, final = (await self._load_tokenizer(replica) if self.tokenizer is None
                              else ("", False))
            if not problem:
                problem, final = await self._admission_problem(replica)
            if problem and final:
                replica.health, replica.problem = Health.REFUSED, problem
                log.error("refusing replica %s: %s", replica.url, problem)
                return
            if problem:  # could not ask (timeout, error): not a verdict, ask again later
                log.warning("replica %s: admission check postponed: %s", replica.url, problem)
                replica.health, replica.problem = Health.UNHEALTHY, problem
                return
        if replica.health is not Health.HEALTHY:
            level = logging.WARNING if replica.health is Health.UNHEALTHY else logging.INFO
            log.log(level, "replica %s is healthy (model %s)", replica.url, replica.model)
        replica.health, replica.problem = Health.HEALTHY, ""
        await self.upstream.warm(replica.url)

    async def _load_tokenizer(self, replica: Replica) -> tuple[str, bool]:
        """Take the replica's tokenizer as the router's (none known yet). Returns
        ``_admission_problem``'s (problem, final): a broken answer refuses the replica; one
        that could not be had leaves it for the next check."""
        async with self._tokenizer_lock:  # checks run concurrently: one load
            if self.tokenizer is not None:
                return "", False
            try:
                status, body = await self.upstream.get_json(replica.url + "/tokenizer",
                                                            TOKENIZER_TIMEOUT_S)
            except (TimeoutError, OSError, ValueError) as exc:
                return f"GET /tokenizer failed: {type(exc).__name__}: {exc}", False
            if status == 404:  # a replica from before GET /tokenizer: byte-level
                tokenizer: Tokenizer = ByteTokenizer()
            elif status != 200 or not isinstance(body, dict):
                return f"GET /tokenizer answered {status}", status < 500
            else:
                try:
                    tokenizer = tokenizer_from_wire(body)
                except ValueError as exc:
                    return f"GET /tokenizer: {exc}", True
            self.tokenizer = self.builder.tokenizer = tokenizer
            log.info("tokenizer from %s: %s, fingerprint %s", replica.url, tokenizer.name,
                     tokenizer.fingerprint)
            return "", False

    async def _admission_problem(self, replica: Replica) -> tuple[str, bool]:
        """(problem, final): final problems refuse the replica for good; others (it could
        not be asked) leave it unhealthy until the next check."""
        try:
            status, body = await self.upstream.get_json(replica.url + "/v1/models",
                                                        self.settings.health_timeout_s)
        except (TimeoutError, OSError, ValueError) as exc:
            return f"GET /v1/models failed: {type(exc).__name__}: {exc}", False
        cards = (body or {}).get("data") or []
        if status != 200 or not cards:
            return f"GET /v1/models answered {status} without models", status < 500
        card = cards[0]
        if self.settings.backend == "ours":
            mine = self.tokenizer.fingerprint
            if card.get("tokenizer_fingerprint") != mine:
                return (f"tokenizer fingerprint {card.get('tokenizer_fingerprint')!r} differs "
                        f"from the router's {mine!r}: it would read token ids differently",
                        True)
            if card.get("tokens_per_block") != self.settings.tokens_per_block:
                return (f"tokens_per_block {card.get('tokens_per_block')} differs from the "
                        f"router's {self.settings.tokens_per_block} (--tokens-per-block)", True)
        replica.model = card.get("id")
        return "", False

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            replicas = [r for r in self.registry.replicas.values()
                        if r.health is not Health.REFUSED]
            await asyncio.gather(*(self.check(r) for r in replicas), return_exceptions=True)

    # -- routing -----------------------------------------------------------------------

    def models(self) -> set[str]:
        return self.registry.models()

    async def decide(self, p: Prepared) -> Decision:
        models = self.models()
        if p.model is not None and p.model not in models:
            raise APIError(404, f"model {p.model!r} is not served here; models: "
                           f"{', '.join(sorted(models)) or 'none yet'}", param="model",
                           code="model_not_found")
        eligible = self.registry.eligible(p.model)
        if not eligible:
            raise APIError(503, f"no healthy replica for model {p.model or 'any'}",
                           type="server_error", code="no_replica",
                           headers={"Retry-After": "1"})
        probes: dict[str, ProbeResult | Exception] = {}
        t0 = time.perf_counter()
        k = self.settings.probe_k
        if self.policy.needs_probe and k != 0:
            urls = [r.url for r in eligible]
            targets = self.policy.probe_targets(p.route, urls, len(urls) if k is None else k)
            if len(targets) < len(urls):  # bounded fan-out: choose among the probed
                chosen = set(targets)
                eligible = [r for r in eligible if r.url in chosen]
            traced = None if p.trace is None else p.trace.probing(targets)
            probes = await self.upstream.probe_all(targets, p.probe_body, traced)
            if p.trace is not None:
                p.trace.probed(probes)
        probe_ms = (time.perf_counter() - t0) * 1e3
        now = time.monotonic()
        candidates = [self._candidate(r, probes.get(r.url), now) for r in eligible]
        decision = self.policy.choose(p.route, candidates)
        if p.trace is not None:
            p.trace.chose(self.policy.name, decision, t0 + probe_ms / 1e3)
        self._record(p, decision, probe_ms)
        return decision

    def _candidate(self, replica: Replica, probe: ProbeResult | Exception | None,
                   now: float) -> Candidate:
        reuse = before = None
        note = ""
        if isinstance(probe, ProbeResult):
            answer = probe.answer
            reuse, before = answer.num_tokens, answer.num_tokens_before_hybrid_pruning
            replica.load, replica.load_at = answer.load, now
        elif probe is not None:
            note = f"probe failed: {_why(probe)}; reuse unknown"
        if self.metrics is not None and probe is not None:
            self.metrics.probe(replica.url, probe)
        candidate = Candidate(replica.url, reuse, before, replica.load, replica.in_flight,
                              replica.unqueued_tokens)
        candidate.note = note
        return candidate

    def _record(self, p: Prepared, decision: Decision, probe_ms: float) -> None:
        self.decisions.append(Routed(time.time(), p.request_id, p.model, p.route.num_tokens,
                                     decision, probe_ms))
        if decision_log.isEnabledFor(logging.INFO):
            entry = {
                "event": "route", "request_id": p.request_id, "model": p.model,
                "prompt_tokens": p.route.num_tokens, "chosen": decision.chosen,
                "reason": decision.reason, "probe_ms": round(probe_ms, 2),
                "candidates": [{"replica": c.name, "reuse": c.reuse,
                                "reuse_before_hybrid_pruning": c.reuse_before_pruning,
                                "expected_reuse": c.expected_reuse, "score": c.score,
                                "in_flight": c.in_flight, "note": c.note}
                               for c in decision.candidates]}
            if p.trace is not None and p.trace.trace_id is not None:
                entry["trace_id"] = p.trace.trace_id  # the request's trace, when traced
            decision_log.info(jsonwire.dumps(entry).decode())


def _tracing(settings: RouterSettings, provider):
    """``RouterTracing`` when tracing is on, else None (then nothing imports opentelemetry's
    SDK, and router.tracing is never imported)."""
    tracing = otel.setup(settings.otel_endpoint, "router", "router", provider)
    if tracing is None:
        return None
    from .tracing import RouterTracing
    return RouterTracing(tracing)
