"""Probe-free policies: round robin, random, least loaded, power of two choices."""

from __future__ import annotations

from .base import Candidate, Decision, Policy, RouteRequest


def outstanding(c: Candidate) -> int:
    """Requests a replica is busy with, as far as this router knows."""
    load = c.load
    reported = (load.running + load.waiting) if load is not None else 0
    return max(reported, c.in_flight)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, rng=None) -> None:
        super().__init__(rng)
        # Each router starts its rotation at a replica of its own (drawn from --seed when
        # set): routers that all started at the first replica would move in step, a burst
        # landing on one replica at a time.
        self._next = self.rng.randrange(1 << 30)

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.name)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(chosen.name, "round robin", tuple(candidates))


class Random(Policy):
    name = "random"

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        return Decision(self.rng.choice(candidates).name, "random", tuple(candidates))


class LeastLoaded(Policy):
    name = "least_loaded"

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        for c in candidates:
            c.score = float(outstanding(c))
        return self._pick_lowest(candidates, "fewest outstanding requests")


class PowerOfTwo(Policy):
    name = "power_of_two"

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        pair = candidates if len(candidates) <= 2 else self.rng.sample(candidates, 2)
        for c in pair:
            c.score = float(outstanding(c))
        return self._pick_lowest(pair, "less loaded of two random replicas")
