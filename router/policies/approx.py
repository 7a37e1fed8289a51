"""``approx_prefix``: route by what this router sent where, for back ends without probes.

Each replica gets an LRU set of the prefix keys (policies.keys) of prompts routed to it,
capped at ``max_keys_per_replica`` (least recently sent evicted first): a router-side
approximation of its cache, in the spirit of SGLang's cache-aware gateway. For a request:

- if load is out of balance (the busiest replica has more than ``balance_abs`` outstanding
  requests over the idlest and more than ``balance_rel`` times as many), the least loaded
  replica wins;
- else, if some replica was sent at least ``threshold`` of this prompt's prefix, the one
  with the longest such prefix wins (ties: fewer outstanding, then random);
- else the least loaded wins.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import Candidate, Decision, Policy, RouteRequest
from .keys import remember, shared_units
from .simple import outstanding


class ApproxPrefix(Policy):
    name = "approx_prefix"

    def __init__(self, rng=None, threshold: float = 0.3, balance_abs: int = 32,
                 balance_rel: float = 1.5, max_keys_per_replica: int = 200_000) -> None:
        super().__init__(rng)
        self.threshold = threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_keys = max_keys_per_replica
        self._seen: dict[str, OrderedDict[int, None]] = {}

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        loads = {c.name: outstanding(c) for c in candidates}
        lo, hi = min(loads.values()), max(loads.values())
        keys = request.prefix_keys()
        shared = {c.name: shared_units(keys, self._seen.get(c.name, ())) for c in candidates}
        for c in candidates:  # what the tree says each could reuse (prompt[:-1] at most)
            c.expected_reuse = min(shared[c.name] * request.unit_tokens,
                                   max(0, request.num_tokens - 1))
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return self._least_loaded(candidates, loads, "load out of balance: least loaded")
        best = max(shared.values()) if keys else 0
        if keys and best / len(keys) >= self.threshold:
            for c in candidates:  # longest shared prefix first, then fewer outstanding
                c.score = -shared[c.name] + loads[c.name] / (hi + 1)
                c.note = f"sent {shared[c.name]}/{len(keys)} blocks before"
            return self._pick_lowest(candidates, f"longest prefix sent before "
                                                 f"({best}/{len(keys)} blocks)")
        return self._least_loaded(candidates, loads, "no prefix sent before: least loaded")

    def on_routed(self, request: RouteRequest, replica: str) -> None:
        remember(self._seen.setdefault(replica, OrderedDict()), request.prefix_keys(),
                 self.max_keys)

    def forget(self, replica: str) -> None:
        self._seen.pop(replica, None)

    def _least_loaded(self, candidates: list[Candidate], loads: dict[str, int],
                      reason: str) -> Decision:
        for c in candidates:
            c.score = float(loads[c.name])
        return self._pick_lowest(candidates, reason)
