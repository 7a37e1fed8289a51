"""Replicas the router knows: checks at admission, health, circuit breakers, draining.

A replica is *eligible* for new requests when it passed its admission check (our back end:
tokenizer fingerprint and block size equal the router's), its last health check passed,
it is not draining, and its circuit breaker lets a request through.

Circuit breaker per replica: ``failure_threshold`` consecutive failures (connect errors,
5xx, timeouts) open it for ``open_seconds``; then one trial request may pass (half-open);
its success closes the circuit, its failure opens it again.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field


from wire.probe import LoadSnapshot
from wire.schemas import PoolStatsOut



class Circuit(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not checked yet
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    REFUSED = "refused"  # failed the admission check; never routed to


@dataclass
class ReplicaStats:
    requests: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    probed_tokens: int = 0  # num_tokens of the chosen replica's probes
    probed_tokens_before_pruning: int = 0
    # the policy's expected reuse of the requests answered here (policies that have one),
    # and by how much it exceeded what the replica reused, summed over requests
    expected_tokens: int = 0
    over_predicted_tokens: int = 0
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=2000))


@dataclass
class Replica:
    url: str
    model: str | None = None
    health: Health = Health.UNKNOWN
    draining: bool = False
    problem: str = ""  # why it is refused or unhealthy, for operators
    circuit: Circuit = Circuit.CLOSED
    consecutive_failures: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False
    in_flight: int = 0
    unqueued_tokens: int = 0  # routed here, response headers not back yet
    load: LoadSnapshot | None = None
    load_at: float = 0.0
    kv_pools: tuple[PoolStatsOut, ...] | None = None  # router.pools; None: not known
    kv_pools_at: float = 0.0
    stats: ReplicaStats = field(default_factory=ReplicaStats)

    def eligible(self, now: float, open_seconds: float) -> bool:
        if self.health is not Health.HEALTHY or self.draining:
            return False
        if self.circuit is Circuit.OPEN and now - self.opened_at >= open_seconds:
            self.circuit = Circuit.HALF_OPEN
            self.trial_in_flight = False
        if self.circuit is Circuit.HALF_OPEN:
            return not self.trial_in_flight
        return self.circuit is Circuit.CLOSED


class Registry:
    def __init__(self, failure_threshold: int, open_seconds: float) -> None:
        self.failure_threshold = failure_threshold
        self.open_seconds = open_seconds
        self.replicas: dict[str, Replica] = {}

    def add(self, url: str) -> Replica:
        if url in self.replicas:
            raise ValueError(f"replica {url} is already registered")
        replica = self.replicas[url] = Replica(url)
        return replica

    def remove(self, url: str) -> Replica:
        return self.replicas.pop(url)

    def get(self, url: str) -> Replica | None:
        return self.replicas.get(url)

    def models(self) -> set[str]:
        return {r.model for r in self.replicas.values()
                if r.model is not None and r.health is not Health.REFUSED}

    def eligible(self, model: str | None) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.replicas.values()
                if (model is None or r.model == model) and r.eligible(now, self.open_seconds)]

    # -- passive failure tracking ------------------------------------------------------

    def started(self, replica: Replica) -> None:
        if replica.circuit is Circuit.HALF_OPEN:
            replica.trial_in_flight = True

    def succeeded(self, replica: Replica) -> None:
        replica.consecutive_failures = 0
        replica.circuit = Circuit.CLOSED
        replica.trial_in_flight = False

    def failed(self, replica: Replica, why: str) -> None:
        replica.stats.failures += 1
        replica.consecutive_failures += 1
        replica.problem = why
        if (replica.circuit is Circuit.HALF_OPEN
                or replica.consecutive_failures >= self.failure_threshold):
            replica.circuit = Circuit.OPEN
            replica.opened_at = time.monotonic()
            replica.trial_in_flight = False
