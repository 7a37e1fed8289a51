"""``prefix``: the lowest expected time to first token, from probed reuse and load.

For each candidate replica::

    reuse     = max(probed reusable tokens, prefix covered by prefills this router sent
                    there that have not produced a token yet)
    queued    = replica's queued prefill tokens + tokens routed there not yet queued
    uncached  = prompt_tokens - reuse
    ttft_est  = (queued + uncached) / replica's prefill tokens per second
    score     = ttft_est + new_work_weight * uncached / prefill tokens per second

and the lowest score wins. Near-ties (scores within ``tie_share`` (5%) of the best, or one
block of prefill at the best replica's rate if that is more) go, on a hybrid model, to the
replica whose attention layers hold the longest prefix its recurrent snapshots do not
cover (``_pruned_affinity``: serving it there leaves a snapshot at that branch point for
the next request from the same history), then to
the replica with fewer outstanding requests, then to the one this router gave the least
prefill work lately (uncached tokens routed, decaying by ``work_decay`` per routed
request), then at random: new prefixes (no reuse anywhere, empty queues) then spread over
replicas evenly instead of by chance, so that no replica ends up owning too few or too
many prefixes. (Without the 5%, a short preamble that every prompt shares, reused in part
on every busy replica, keeps a cold replica from ever winning a new prefix.) The second
term charges a request for the work
it adds, which delays everything queued behind it: without it, a burst of requests sharing
a new prefix scatters (each one's own TTFT is a hair better on an idle replica that
computes the prefix again). With it, the burst follows the first request's replica (whose
pending prefill the router counts) until that queue is about ``1 + new_work_weight``
prefixes longer than elsewhere, then spills over: neither scattered nor piled onto one.

With bounded fan-out (probing ``k`` of ``n`` replicas and choosing among them), up to
``k - 1`` replicas this router sent the longest shared prefix to (an LRU record of prefix
keys per replica, as in ``approx_prefix``) are probed first, and the rest of the ``k`` are
drawn at random, so that a prefix cached somewhere unexpected is still found now and then
and load spreads (power of k choices). With ``k = 1`` the best affinity replica alone.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from operator import attrgetter

from .base import Candidate, Decision, Policy, RouteRequest
from .keys import remember, shared_units
from .simple import outstanding

DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
_score = attrgetter("score")


class PrefixAware(Policy):
    name = "prefix"
    needs_probe = True

    def __init__(self, rng=None, new_work_weight: float = 1.0, tie_share: float = 0.05,
                 work_decay: float = 0.995, max_keys_per_replica: int = 200_000) -> None:
        super().__init__(rng)
        self.new_work_weight = new_work_weight
        self.tie_share = tie_share
        self.work_decay = work_decay
        self._routed = 0  # requests routed so far: the clock of the work decay
        self._work: dict[str, tuple[float, int]] = {}  # replica -> (work, at _routed)
        # request -> (replica, uncached) between choose() and on_routed(); bounded in case a
        # chosen request is never sent
        self._uncached: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self.max_keys = max_keys_per_replica
        self._sent: dict[str, OrderedDict[int, None]] = {}  # for choosing probe targets
        self._track_sent = False
        # Unfinished prefills this router sent, per replica: request id -> request. Their
        # keys are counted (replica -> key -> prefills; a Counter: update() counts in C)
        # only once a later request is compared with them, so traffic that never overlaps
        # never computes or counts keys.
        self._unfinished: dict[str, dict[str, RouteRequest]] = {}
        self._pending: dict[str, Counter[int]] = {}
        self._counted: dict[str, set[str]] = {}  # replica -> requests whose keys are counted
        self._where: dict[str, str] = {}  # request id -> replica, while unfinished

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        num_tokens, unit, weight = request.num_tokens, request.unit_tokens, self.new_work_weight
        unfinished = self._unfinished
        for c in candidates:
            if unfinished.get(c.name):
                keys = request.prefix_keys()
                if keys:
                    shared = shared_units(keys, self._pending_keys(c.name)) * unit
                    c.pending_reuse = min(shared, max(0, num_tokens - 1))
            reuse = max(c.reuse or 0, c.pending_reuse)
            c.expected_reuse = reuse
            load = c.load
            if load is not None:
                rate = load.prefill_tokens_per_s
                if rate <= 0:
                    rate = DEFAULT_PREFILL_TOKENS_PER_S
                queued = load.queued_prefill_tokens + c.pending_tokens
            else:
                rate, queued = DEFAULT_PREFILL_TOKENS_PER_S, c.pending_tokens
            uncached = max(0, num_tokens - reuse)
            ttft = (queued + uncached) / rate
            c.score = ttft + weight * uncached / rate
            c.tie = unit / rate
            c.estimate = (ttft, reuse, queued)
        best = min(candidates, key=_score)
        top = best.score + max(best.tie, best.score * self.tie_share)
        near = [c for c in candidates if c.score <= top]
        if len(near) > 1:
            near = _pruned_affinity(near, unit)
        if len(near) > 1:
            busy = [outstanding(c) for c in near]
            fewest = min(busy)
            near = [c for c, b in zip(near, busy) if b == fewest]
        if len(near) > 1:
            work = [self._recent_work(c.name) for c in near]
            least = min(work) + 1.0
            near = [c for c, w in zip(near, work) if w <= least]
        best = near[0] if len(near) == 1 else self.rng.choice(near)
        uncached = num_tokens - max(best.reuse or 0, best.pending_reuse)
        self._uncached[request.request_id] = (best.name, uncached)
        if len(self._uncached) > 4096:
            self._uncached.popitem(last=False)
        ttft, reuse, queued = best.estimate
        return Decision(best.name, f"lowest expected TTFT (est. TTFT {ttft * 1e3:.1f} ms: "
                        f"reuse {reuse}, queued {queued} of {num_tokens} tokens)",
                        tuple(candidates))

    def probe_targets(self, request: RouteRequest, replicas: list[str], k: int) -> list[str]:
        if k >= len(replicas):
            return list(replicas)
        self._track_sent = True  # bounded fan-out: remember where prefixes went from now on
        keys = request.prefix_keys()
        affinity = sorted(((shared_units(keys, self._sent.get(r, ())), r) for r in replicas),
                          reverse=True)
        # k - 1 slots for the replicas sent the longest shared prefix, at least one draw at
        # random (so a prefix cached somewhere unexpected is found); k = 1: affinity only.
        chosen = [r for shared, r in affinity[: max(1, k - 1)] if shared > 0]
        rest = [r for r in replicas if r not in chosen]
        return chosen + self.rng.sample(rest, k - len(chosen))

    def _recent_work(self, replica: str) -> float:
        work, at = self._work.get(replica, (0.0, self._routed))
        return work * self.work_decay ** (self._routed - at)

    def on_routed(self, request: RouteRequest, replica: str) -> None:
        chosen, uncached = self._uncached.pop(request.request_id, (replica, request.num_tokens))
        self._routed += 1
        self._work[replica] = (self._recent_work(replica) + uncached, self._routed)
        if request.request_id in self._where:  # ids come from clients: one may be reused
            self.on_prefill_done(request, replica)  # while its first request is unfinished
        self._unfinished.setdefault(replica, {})[request.request_id] = request
        self._where[request.request_id] = replica
        if not self._track_sent:
            return
        remember(self._sent.setdefault(replica, OrderedDict()), request.prefix_keys(),
                 self.max_keys)

    def _pending_keys(self, replica: str) -> Counter[int]:
        """The keys of ``replica``'s unfinished prefills, counting any not counted yet."""
        pending = self._pending.get(replica)
        if pending is None:
            pending = self._pending[replica] = Counter()
        counted = self._counted.setdefault(replica, set())
        unfinished = self._unfinished[replica]
        if len(counted) < len(unfinished):
            for rid, req in unfinished.items():
                if rid not in counted:
                    pending.update(req.prefix_keys())
                    counted.add(rid)
        return pending

    def on_prefill_done(self, request: RouteRequest, replica: str) -> None:
        rid = request.request_id
        where = self._where.pop(rid, None)
        if where is None:
            return
        sent = self._unfinished[where].pop(rid)  # the request as routed
        counted = self._counted.get(where)
        if not counted or rid not in counted:
            return
        counted.discard(rid)
        pending = self._pending[where]
        if not counted:
            pending.clear()
            return
        for k in sent.keys:
            left = pending[k] - 1
            if left:
                pending[k] = left
            else:
                dict.__delitem__(pending, k)  # Counter's own __delitem__ is Python

    on_finished = on_prefill_done

    def forget(self, replica: str) -> None:
        self._pending.pop(replica, None)
        self._counted.pop(replica, None)
        self._sent.pop(replica, None)
        self._work.pop(replica, None)
        for rid in self._unfinished.pop(replica, {}):
            self._where.pop(rid, None)

    def pending_requests(self) -> int:
        return len(self._where)


def _pruned_affinity(near: list[Candidate], unit: int) -> list[Candidate]:
    """Among near-ties, the replicas whose attention layers hold the longest prefix of this
    prompt that their recurrent snapshots do not cover (a block or more): serving it there
    leaves a snapshot at that branch point (the scheduler stops a prefill there), so the
    next request branching from the same history reuses it; elsewhere it would be
    computed again. Unchanged when no candidate has such a prefix (attention-only models
    never do)."""
    held = [(c.reuse_before_pruning or 0) if (c.reuse_before_pruning or 0) - (c.reuse or 0)
            >= unit else 0 for c in near]
    most = max(held)
    return [c for c, h in zip(near, held) if h == most] if most else near
