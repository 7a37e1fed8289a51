"""A discrete-event simulation of a routed cluster: no HTTP, real policies, real caches.

Each simulated replica owns a real ``KVCacheManager`` (bookkeeping mode) and the sim
engine's timing model (``replicas.engines.sim.SimTiming``); requests are routed by the
same policy objects the live router runs, probing replicas with ``probe_reuse``. What is
modelled rather than run (so that 10^5 requests finish in seconds):

- Prefill is served first come first served, one request at a time per replica, taking
  ``ceil(uncached / max_batched_tokens)`` steps of ``step_overhead + decode_per_seq *
  running`` plus ``uncached / prefill_tokens_per_s + per_seq_prefill`` (the sim engine's
  costs, with the decode batch running alongside).
- Decode of a request takes ``output_tokens * (step_overhead + decode_per_seq * running)``
  with ``running`` counted when its decode starts.
- KV pages for prompt and output are taken when a request's prefill starts (it waits at
  the head of the queue while they cannot be found) and released when it finishes; the
  prompt's blocks become reusable when its prefill ends, the output's at the end.

Bounds (BENCHMARKS.md, "Definitions"): the *pooled* bound replays the same requests, in
arrival order,
through one cache holding every replica's pages; the *infinite* bound through a cache that
never evicts.
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcache import CacheConfig, FullAttention, KVCacheManager, ReuseScope
from replicas.engines.sim import SimTiming
from text import ByteTokenizer, ChatMessage
from router.policies import Candidate, Policy, RouteRequest, block_keys, make_policy
from wire.probe import LoadSnapshot

from .workloads import Request

_OUTPUT_TOKEN = 97  # what simulated replicas "generate": its KV is committed like any token


@dataclass
class SimRequest:
    tokens: array  # prompt token ids, array('I')
    output_tokens: int
    arrival_s: float
    request_id: str = ""
    session: str | None = None
    scope: str = ""
    keys: tuple[int, ...] | None = None  # prefix keys (router.policies.keys); None: on arrival


@dataclass
class SimConfig:
    replicas: int = 8
    kv_pages: int = 512
    tokens_per_block: int = 32
    max_batched_tokens: int = 2048
    timing: SimTiming = field(default_factory=SimTiming)
    probe_k: int | None = None  # probe (and choose among) k replicas; None: all
    seed: int = 0


@dataclass
class _Running:
    req: SimRequest
    cache: object = None
    reused: int = 0
    expected_reuse: int = 0
    start_s: float = 0.0
    first_token_s: float = 0.0
    route: RouteRequest | None = None


class SimReplica:
    def __init__(self, name: str, cfg: SimConfig) -> None:
        self.name = name
        self.cfg = cfg
        self.mgr = KVCacheManager(CacheConfig(tokens_per_block=cfg.tokens_per_block,
                                              num_pages=cfg.kv_pages,
                                              life_cycles=(FullAttention(),)))
        self.queue: deque[_Running] = deque()
        self.prefilling: _Running | None = None
        self.running = 0
        self.queued_tokens = 0
        self.prefill_tokens = 0  # computed (uncached) prompt tokens
        self.requests = 0
        self.reported = LoadSnapshot(total_pages=cfg.kv_pages,
                                     prefill_tokens_per_s=cfg.timing.prefill_tokens_per_s)

    def load(self) -> LoadSnapshot:
        """The replica's load now: one object per replica, refreshed in place (no
        allocation per probe; the simulator keeps no decision after it is made)."""
        info = self.reported
        left = 0
        if self.prefilling is not None:
            left = len(self.prefilling.req.tokens) - self.prefilling.reused
        info.running = self.running
        info.waiting = len(self.queue)
        info.queued_prefill_tokens = self.queued_tokens + left
        return info


@dataclass
class SimResult:
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: list[float]
    e2e_s: list[float]
    prefill_tokens_per_replica: list[int]
    requests_per_replica: list[int]
    wall_s: float
    sim_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        mean = sum(self.prefill_tokens_per_replica) / len(self.prefill_tokens_per_replica)
        return max(self.prefill_tokens_per_replica) / mean if mean else 1.0


class Simulation:
    """Feed ``requests`` (sorted by arrival) through ``cfg.replicas`` replicas."""

    def __init__(self, cfg: SimConfig, policy: Policy) -> None:
        self.cfg = cfg
        self.policy = policy
        self.replicas = [SimReplica(f"replica-{i}", cfg) for i in range(cfg.replicas)]
        self._names = [r.name for r in self.replicas]
        self._by_name = {r.name: r for r in self.replicas}
        self._events: list = []
        self._seq = 0
        self.now = 0.0
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.cached = self.prompt = 0
        self._session_busy: dict[str, deque[SimRequest]] = {}  # session -> turns held back

    def run(self, requests: Sequence[SimRequest],
            progress: Callable[[int, int], None] | None = None) -> SimResult:
        t0 = time.perf_counter()
        for i, req in enumerate(requests):
            self._push(req.arrival_s, self._arrive, req)
        done = 0
        while self._events:
            at, _, fn, arg = heapq.heappop(self._events)
            self.now = at
            if fn(arg) and progress is not None:
                done += 1
                if done % 5000 == 0:
                    progress(done, len(requests))
        return SimResult(self.policy.name, len(requests), self.prompt, self.cached,
                         self.ttft, self.e2e, [r.prefill_tokens for r in self.replicas],
                         [r.requests for r in self.replicas], time.perf_counter() - t0,
                         self.now)

    # -- events ------------------------------------------------------------------------

    def _push(self, at: float, fn, arg) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, fn, arg))

    def _arrive(self, req: SimRequest) -> bool:
        if req.session is not None:
            held = self._session_busy.get(req.session)
            if held is not None:  # the previous turn has not finished: wait for it
                held.append(req)
                return False
            self._session_busy[req.session] = deque()
        keys = req.keys
        if keys is None:
            keys = block_keys(req.tokens, self.cfg.tokens_per_block, req.scope)
        route = RouteRequest(req.request_id, len(req.tokens), keys, self.cfg.tokens_per_block,
                             req.session)
        names = self._names
        k = self.cfg.probe_k
        if self.policy.needs_probe:
            targets = self.policy.probe_targets(route, names, len(names) if k is None else k)
        else:
            targets = names
        by_name = self._by_name
        scope = ReuseScope(salt=req.scope) if req.scope else None
        candidates = []
        lookup = req.tokens[:-1]
        for name in targets:
            rep = by_name[name]
            reuse = before = None
            if self.policy.needs_probe:
                probe = rep.mgr.probe_reuse(lookup, scope=scope)
                reuse, before = probe.num_tokens, probe.num_tokens_before_hybrid_pruning
            candidates.append(Candidate(name, reuse, before, rep.load(),
                                        rep.running + len(rep.queue)))
        decision = self.policy.choose(route, candidates)
        chosen = by_name[decision.chosen]
        self.policy.on_routed(route, chosen.name)
        expected = next(c.reuse or 0 for c in candidates if c.name == chosen.name)
        item = _Running(req, expected_reuse=expected, route=route)
        chosen.queue.append(item)
        chosen.queued_tokens += len(req.tokens) - expected
        chosen.requests += 1
        self._start_prefill(chosen)
        return False

    def _start_prefill(self, rep: SimReplica) -> None:
        if rep.prefilling is not None or not rep.queue:
            return
        item = rep.queue[0]
        req = item.req
        scope = ReuseScope(salt=req.scope) if req.scope else None
        cache = rep.mgr.create_kv_cache(req.tokens[:-1], scope=scope)
        if not cache.resize(len(req.tokens) + req.output_tokens):
            cache.close()
            return  # waits for pages: a finishing request starts it again
        rep.queue.popleft()
        rep.queued_tokens -= len(req.tokens) - item.expected_reuse
        item.cache, item.reused, item.start_s = cache, cache.num_reused_tokens, self.now
        rep.prefilling = item
        uncached = len(req.tokens) - item.reused
        t = self.cfg.timing
        steps = max(1, math.ceil(uncached / self.cfg.max_batched_tokens))
        seconds = (steps * (t.step_overhead_s + t.decode_per_seq_s * rep.running)
                   + uncached / t.prefill_tokens_per_s + t.per_seq_prefill_s) / t.speedup
        self._push(self.now + seconds, self._prefill_done, rep)

    def _prefill_done(self, rep: SimReplica) -> bool:
        item = rep.prefilling
        rep.prefilling = None
        req = item.req
        item.cache.commit(req.tokens[item.reused:])
        item.first_token_s = self.now
        self.ttft.append(self.now - req.arrival_s)
        self.prompt += len(req.tokens)
        self.cached += item.reused
        rep.prefill_tokens += len(req.tokens) - item.reused
        self.policy.on_prefill_done(item.route, rep.name)
        rep.running += 1
        t = self.cfg.timing
        seconds = req.output_tokens * (t.step_overhead_s + t.decode_per_seq_s * rep.running)
        self._push(self.now + seconds / t.speedup, self._finish, (rep, item))
        self._start_prefill(rep)
        return False

    def _finish(self, arg) -> bool:
        rep, item = arg
        if item.req.output_tokens > 1:
            item.cache.commit([_OUTPUT_TOKEN] * (item.req.output_tokens - 1))
        item.cache.close()
        rep.running -= 1
        self.e2e.append(self.now - item.req.arrival_s)
        self.policy.on_finished(item.route, rep.name)
        self._start_prefill(rep)
        session = item.req.session
        if session is not None:
            held = self._session_busy.pop(session)
            if held:
                nxt = held.popleft()
                self._session_busy[session] = held
                self._push(self.now, self._resume_turn, nxt)
        return True

    def _resume_turn(self, req: SimRequest) -> bool:
        req.arrival_s = self.now  # a client sends its next turn when the last one ended
        held = self._session_busy.pop(req.session)
        self._arrive(req)
        self._session_busy[req.session].extend(held)
        return False



def bound_hit_rate(requests: Sequence[SimRequest], num_pages: int | None,
                   tokens_per_block: int) -> float:
    """Token hit rate of one LRU cache of ``num_pages`` (None: never evicts) fed the
    requests one after another in arrival order."""
    total = sum(len(r.tokens) + r.output_tokens for r in requests)
    pages = num_pages or (total // tokens_per_block + len(requests) + 1)
    mgr = KVCacheManager(CacheConfig(tokens_per_block=tokens_per_block, num_pages=pages))
    hit = prompt = 0
    for req in sorted(requests, key=lambda r: r.arrival_s):
        scope = ReuseScope(salt=req.scope) if req.scope else None
        cache = mgr.create_kv_cache(req.tokens[:-1], scope=scope)
        if not cache.resize(len(req.tokens) + req.output_tokens):
            cache.close()
            continue
        cache.commit(req.tokens[cache.num_reused_tokens:])
        if req.output_tokens > 1:
            cache.commit([_OUTPUT_TOKEN] * (req.output_tokens - 1))
        cache.close()
        hit += cache.num_reused_tokens
        prompt += len(req.tokens)
    return hit / prompt if prompt else 0.0


def simulate(requests: Sequence[SimRequest], policy: str, cfg: SimConfig,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    return Simulation(cfg, make_policy(policy, seed=cfg.seed)).run(requests, progress)


def to_sim_requests(requests: Sequence[Request], offsets: Sequence[float | None],
                    tokens_per_block: int | None = None) -> list[SimRequest]:
    """Workload requests as token ids (the replicas' tokenizer and template), with arrival
    times; requests of one session keep their order (a later turn never arrives first).
    With ``tokens_per_block``, each request's prefix keys are computed here, once, instead
    of on every simulated arrival."""
    tok = ByteTokenizer()
    out = []
    last_in_session: dict[str, float] = {}
    for req, at in zip(requests, offsets):
        if req.prompt is not None:
            ids = tok.encode(req.prompt)
        else:
            ids = tok.render_chat([ChatMessage(m["role"], m["content"]) for m in req.messages])
        at = at if at is not None else 0.0
        if req.session is not None:
            at = max(at, last_in_session.get(req.session, 0.0))
            last_in_session[req.session] = at
        tokens = array("I", ids)
        keys = block_keys(tokens, tokens_per_block) if tokens_per_block else None
        out.append(SimRequest(tokens, req.max_tokens, at, req.request_id, req.session,
                              keys=keys))
    out.sort(key=lambda r: r.arrival_s)
    return out
