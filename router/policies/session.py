"""Session affinity by rendezvous (highest random weight) hashing.

Each (session key, replica) pair gets a stable pseudo-random weight; the highest wins. When
a replica joins or leaves, only the sessions it wins or held move. Requests without a key
fall back to round robin.
"""

from __future__ import annotations

import hashlib

from .base import Candidate, Decision, Policy, RouteRequest
from .simple import RoundRobin


def _weight(key: str, replica: str) -> int:
    data = f"{key}\x00{replica}".encode("utf-8", "surrogatepass")  # any str, even unpaired
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Session(Policy):
    name = "session"

    def __init__(self, rng=None) -> None:
        super().__init__(rng)
        self._fallback = RoundRobin(self.rng)

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> Decision:
        if not request.session_key:
            d = self._fallback.choose(request, candidates)
            return Decision(d.chosen, "no session key: round robin", d.candidates)
        for c in candidates:
            c.score = -float(_weight(request.session_key, c.name))
        best = min(candidates, key=lambda c: c.score)
        return Decision(best.name, "session affinity", tuple(candidates))
