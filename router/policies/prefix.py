"""``prefix``: the lowest estimated time to first token, from probed reuse and load.

For each candidate replica::

    reuse     = max(probed reusable tokens, prefix covered by prefills this router sent
                    there that have not produced a token yet)
    queued    = replica's queued prefill tokens + tokens routed there not yet queued
    ttft_est  = (queued + prompt_tokens - reuse) / replica's prefill tokens per second

and the lowest estimate wins, ties at random. Counting the pending prefills is what keeps a
burst of requests sharing a new prefix together: the first goes anywhere, the next ones see
that replica about to hold the prefix (and its queue growing), so they follow it until the
queue costs more than recomputing the prefix elsewhere.
"""

from __future__ import annotations

from collections import Counter

from .base import Candidate, Decision, Policy, RouteRequest
from .keys import shared_units

DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0


class PrefixAware(Policy):
    name = "prefix"
    needs_probe = True

    def __init__(self, rng=None) -> None:
        super().__init__(rng)
        self._pending: dict[str, Counter] = {}  # replica -> block key -> unfinished prefills
        self._by_request: dict[str, tuple[str, tuple[int, ...]]] = {}

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        keys = request.keys
        for c in candidates:
            pending = self._pending.get(c.name)
            if pending and keys:
                shared = shared_units(keys, pending) * request.unit_tokens
                c.pending_reuse = min(shared, max(0, request.num_tokens - 1))
            reuse = max(c.reuse or 0, c.pending_reuse)
            load = c.load
            rate = load.prefill_tokens_per_s if load and load.prefill_tokens_per_s > 0 \
                else DEFAULT_PREFILL_TOKENS_PER_S
            queued = (load.queued_prefill_tokens if load else 0) + c.pending_tokens
            c.score = (queued + max(0, request.num_tokens - reuse)) / rate
            c.note = f"reuse {reuse}, queued {queued}"
        decision = self._pick_lowest(candidates, "")
        best = next(c for c in candidates if c.name == decision.chosen)
        return Decision(best.name, f"lowest estimated TTFT {best.score * 1e3:.1f} ms "
                        f"({best.note} of {request.num_tokens} tokens)", decision.candidates)

    def on_routed(self, request: RouteRequest, replica: str) -> None:
        keys = request.keys
        if not keys:
            return
        self._pending.setdefault(replica, Counter()).update(keys)
        self._by_request[request.request_id] = (replica, keys)

    def on_prefill_done(self, request: RouteRequest, replica: str) -> None:
        entry = self._by_request.pop(request.request_id, None)
        if entry is None:
            return
        pending = self._pending.get(entry[0])
        if pending is not None:
            pending.subtract(entry[1])
            for k in entry[1]:
                if pending[k] <= 0:
                    del pending[k]

    on_finished = on_prefill_done

    def forget(self, replica: str) -> None:
        self._pending.pop(replica, None)
        for rid in [r for r, (name, _) in self._by_request.items() if name == replica]:
            del self._by_request[rid]

    def pending_requests(self) -> int:
        return len(self._by_request)
