"""Routing policies by name (``--policy``); see each module for its rule."""

from __future__ import annotations

import random

from .approx import ApproxPrefix
from .base import Candidate, Decision, Policy, RouteRequest
from .keys import block_keys, chain_keys, text_keys
from .prefix import PrefixAware
from .session import Session
from .simple import LeastLoaded, PowerOfTwo, Random, RoundRobin

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (PrefixAware, ApproxPrefix, RoundRobin, Random, LeastLoaded, PowerOfTwo,
                        Session)
}

__all__ = ["POLICIES", "ApproxPrefix", "Candidate", "Decision", "Policy",
           "PrefixAware", "RouteRequest", "block_keys", "chain_keys", "make_policy",
           "text_keys"]


def make_policy(name: str, seed: int | None = None, **options) -> Policy:
    """A policy by name; ValueError listing the names when it is unknown."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return cls(rng=random.Random(seed), **options)
