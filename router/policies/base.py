"""The routing-policy interface: pure objects that score candidates and pick one.

The live router and the simulator (loadtest) run the same policy code. A policy sees a
``RouteRequest`` (what is being routed) and ``Candidate`` records (what is known of each
eligible replica right now: probed reuse, load, what this router sent there and has not
seen reflected yet) and returns a ``Decision``. It does no I/O; the caller probes, forwards
and then reports back through ``on_routed`` / ``on_finished``.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field

from wire.probe import LoadSnapshot

from .keys import chain_keys


@dataclass(slots=True)
class RouteRequest:
    """What is being routed (read-only by convention; not frozen, for speed).

    ``keys`` are chained prefix keys of the prompt: per block of token ids when the router
    tokenized it (our replicas), per chunk of text for back ends it cannot tokenize for
    (``approx_prefix`` works on either). Policies read them through ``prefix_keys()``: the
    router gives their source (``keys_from``: the arguments of ``chain_keys``) and they are
    computed on first use, so a request that no policy step compares with another (one
    at a time, full fan-out) never pays for them. ``session_key`` comes from a header or
    ``user``.
    """

    request_id: str
    num_tokens: int
    keys: tuple[int, ...] = ()  # chained prefix keys (policies.keys), one per block/chunk
    unit_tokens: int = 32  # tokens one key stands for (tokens_per_block, or an estimate)
    session_key: str | None = None
    keys_from: tuple[bytes, int, str] | None = None  # (data, step, scope) for chain_keys

    def prefix_keys(self) -> tuple[int, ...]:
        """``keys``, computed from ``keys_from`` the first time they are asked for."""
        if self.keys_from is not None:
            self.keys, self.keys_from = chain_keys(*self.keys_from), None
        return self.keys


@dataclass(slots=True)
class Candidate:
    """One eligible replica, as known at decision time."""

    name: str  # the replica's base URL, exactly as configured
    reuse: int | None = None  # probed reusable tokens; None: no probe answer in time
    reuse_before_pruning: int | None = None
    load: LoadSnapshot | None = None  # from the probe, or the last known snapshot
    in_flight: int = 0  # requests this router has open on it
    pending_tokens: int = 0  # uncached tokens routed here that the replica has not queued yet
    pending_reuse: int = 0  # prefix of this request that an unfinished routed prefill covers
    score: float | None = None  # filled by the policy (lower is better)
    tie: float = 0.0  # scores closer than this to the best count as ties
    estimate: tuple = ()  # the policy's terms behind the score (prefix: TTFT, reuse, queued)
    # prompt tokens the policy expects this replica to reuse (prefix: what the probe said,
    # or an unfinished prefill covers; approx_prefix: what its tree says was sent there);
    # None: the policy has no such expectation
    expected_reuse: int | None = None
    note: str = ""


@dataclass(slots=True)
class Decision:
    """The choice, the reason, and every candidate as scored (for /stats and logs)."""

    chosen: str
    reason: str
    candidates: tuple[Candidate, ...] = field(default_factory=tuple)
    cached_tokens: int | None = None  # what the chosen replica reused (its answer's usage)

    @property
    def expected_reuse(self) -> int | None:
        """What the policy expected the chosen replica to reuse."""
        return next((c.expected_reuse for c in self.candidates if c.name == self.chosen), None)

    def ranked(self) -> list[str]:
        """Candidates best first: the order to retry in."""
        scored = sorted(self.candidates, key=lambda c: (c.name != self.chosen,
                                                         c.score if c.score is not None
                                                         else float("inf")))
        return [c.name for c in scored]


class Policy(abc.ABC):
    """Base of all policies. ``needs_probe``: the router probes candidates before choosing."""

    name: str = ""
    needs_probe: bool = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    @abc.abstractmethod
    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        """Pick one of ``candidates`` (never empty)."""

    def on_routed(self, request: RouteRequest, replica: str) -> None:
        """The request was sent to ``replica`` (after retries, the one that answered)."""

    def on_prefill_done(self, request: RouteRequest, replica: str) -> None:
        """``replica`` produced the first token: the request's prompt is now in its cache."""

    def on_finished(self, request: RouteRequest, replica: str) -> None:
        """The request finished (or failed) on ``replica``."""

    def forget(self, replica: str) -> None:
        """``replica`` left the pool: drop any state kept about it."""

    def probe_targets(self, request: RouteRequest, replicas: list[str], k: int) -> list[str]:
        """Which ``k`` of ``replicas`` to probe (all when ``k >= len``): at random here;
        policies that remember where prefixes went put those replicas first."""
        if k >= len(replicas):
            return list(replicas)
        return self.rng.sample(replicas, k)

    def _pick_lowest(self, candidates: list[Candidate], reason: str) -> Decision:
        """Lowest score wins; ties broken at random."""
        best = min(c.score for c in candidates)
        tied = [c for c in candidates if c.score == best]
        chosen = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        return Decision(chosen.name, reason, tuple(candidates))
