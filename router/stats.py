"""``/stats``: per-replica reuse, latency, health, load and KV pools, the latest
decisions, and (``--api-keys``) the tenants.

The pydantic models at the end are the declared response schema (OpenAPI)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Optional

from pydantic import BaseModel


from wire.probe import LoadSnapshot
from wire.schemas import PoolStatsOut



def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def replica_view(rep) -> dict:
    s = rep.stats
    ttft = list(s.ttft_s)
    load = dataclasses.asdict(rep.load) if rep.load is not None else None
    return {
        "url": rep.url, "model": rep.model, "health": rep.health.value,
        "circuit": rep.circuit.value, "draining": rep.draining, "problem": rep.problem,
        "in_flight": rep.in_flight, "requests": s.requests, "failures": s.failures,
        "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
        "hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        "probed_tokens": s.probed_tokens,
        "probed_tokens_before_hybrid_pruning": s.probed_tokens_before_pruning,
        "expected_tokens": s.expected_tokens,
        "over_predicted_tokens": s.over_predicted_tokens,
        "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "load": load,
        "load_age_s": (time.monotonic() - rep.load_at) if rep.load is not None else None,
        "kv_pools": ([p.model_dump() for p in rep.kv_pools]
                     if rep.kv_pools is not None else None),
        "kv_pools_age_s": ((time.monotonic() - rep.kv_pools_at)
                           if rep.kv_pools is not None else None),
    }


def decision_view(routed) -> dict:
    d = routed.decision
    return {
        "at": routed.at, "request_id": routed.request_id, "model": routed.model,
        "prompt_tokens": routed.prompt_tokens, "chosen": d.chosen, "reason": d.reason,
        "probe_ms": round(routed.probe_ms, 3),
        "expected_reuse": d.expected_reuse, "cached_tokens": d.cached_tokens,
        "candidates": [{
            "replica": c.name, "reuse": c.reuse,
            "reuse_before_hybrid_pruning": c.reuse_before_pruning,
            "pending_reuse": c.pending_reuse,
            "queued_prefill_tokens": c.load.queued_prefill_tokens if c.load else None,
            "running": c.load.running if c.load else None,
            "waiting": c.load.waiting if c.load else None,
            "in_flight": c.in_flight, "score": c.score, "note": c.note,
            "expected_reuse": c.expected_reuse,
        } for c in d.candidates],
    }


def stats_view(svc) -> dict:
    replicas = [replica_view(r) for r in svc.registry.replicas.values()]
    prompt = sum(r["prompt_tokens"] for r in replicas)
    cached = sum(r["cached_tokens"] for r in replicas)
    return {
        "policy": svc.policy.name,
        "backend": svc.settings.backend,
        "totals": {"requests": sum(r["requests"] for r in replicas), "prompt_tokens": prompt,
                   "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0},
        "replicas": replicas,
        "decisions": [decision_view(d) for d in reversed(svc.decisions)],
        "tenants": tenants_view(svc.tenants) if svc.tenants is not None else None,
    }


def tenants_view(tenants) -> dict:
    """Every tenant, most requests first (then by name)."""
    rows = []
    for t in sorted(tenants.by_name.values(), key=lambda t: (-t.requests, t.name)):
        window_requests, window_tokens = t.window_usage()
        rows.append({
            "name": t.name, "requests": t.requests, "rejected": sum(t.refused.values()),
            "rejected_by": dict(t.refused), "prompt_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens,
            "hit_rate": t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0,
            "in_flight": t.in_flight, "limits": t.limits.model_dump(),
            "requests_last_minute": window_requests,
            "prompt_tokens_last_minute": window_tokens,
        })
    default = tenants.default.name if tenants.default is not None else "reject"
    return {"default": default, "unauthenticated": tenants.unauthenticated, "tenants": rows}


# -- the response schema -----------------------------------------------------------------

class ReplicaView(BaseModel):
    url: str
    model: Optional[str]
    health: str
    circuit: str
    draining: bool
    problem: str
    in_flight: int
    requests: int
    failures: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    probed_tokens: int
    probed_tokens_before_hybrid_pruning: int
    # the policy's expected reuse of the requests answered here, and how far it exceeded
    # the replica's cached_tokens, summed over requests (policies with an expectation)
    expected_tokens: int
    over_predicted_tokens: int
    ttft_p50_s: Optional[float]
    ttft_p99_s: Optional[float]
    ttft_mean_s: Optional[float]
    load: Optional[LoadSnapshot]  # as the replica last reported it
    load_age_s: Optional[float]
    # the replica's KV pools (one per life cycle), from its GET /stats every
    # kv_pools_interval_s; None for --backend openai and until first fetched
    kv_pools: Optional[list[PoolStatsOut]]
    kv_pools_age_s: Optional[float]


class CandidateView(BaseModel):
    replica: str
    reuse: Optional[int]
    reuse_before_hybrid_pruning: Optional[int]
    pending_reuse: int
    queued_prefill_tokens: Optional[int]
    running: Optional[int]
    waiting: Optional[int]
    in_flight: int
    score: Optional[float]
    note: str
    expected_reuse: Optional[int]  # what the policy expected this replica to reuse


class DecisionView(BaseModel):
    at: float
    request_id: str
    model: Optional[str]
    prompt_tokens: int
    chosen: str
    reason: str
    probe_ms: float
    expected_reuse: Optional[int]  # the policy's expectation of the chosen replica's reuse
    cached_tokens: Optional[int]  # what it reused (None until its answer's usage came)
    candidates: list[CandidateView]


class Totals(BaseModel):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float


class TenantLimitsView(BaseModel):
    requests_per_minute: Optional[int]  # None: no such limit
    prompt_tokens_per_minute: Optional[int]
    concurrent_requests: Optional[int]


class TenantView(BaseModel):
    name: str
    requests: int  # admitted
    rejected: int  # refused by a limit (429, or 400 for a prompt over the token limit)
    rejected_by: dict[str, int]  # by reason: the error code of the refusal
    prompt_tokens: int  # of the answered requests, from usage (as the hit rate's)
    cached_tokens: int
    hit_rate: float
    in_flight: int
    limits: TenantLimitsView
    requests_last_minute: Optional[int]  # what the windows hold now; None: no such limit
    prompt_tokens_last_minute: Optional[int]


class TenantsView(BaseModel):
    default: str  # "reject", or the tenant unknown and missing keys get
    unauthenticated: int  # requests refused 401
    tenants: list[TenantView]  # most requests first


class RouterStats(BaseModel):
    """The router's ``/stats``."""

    policy: str
    backend: str
    totals: Totals
    replicas: list[ReplicaView]
    decisions: list[DecisionView]
    tenants: Optional[TenantsView] = None  # with --api-keys only


class ReplicaList(BaseModel):
    replicas: list[ReplicaView]


class AdminResult(BaseModel):
    """What an admin call did (the fields that apply)."""

    added: Optional[str] = None
    model: Optional[str] = None
    draining: Optional[str] = None
    in_flight: Optional[int] = None
    removed: Optional[str] = None
