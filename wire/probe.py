"""What a replica answers to ``POST /probe_reuse``: one type for the replica that writes it,
the router that reads it, the policies that weigh it and the simulator that models it.

``LoadSnapshot`` is also the ``load`` of a replica's ``/stats``. Both are plain dataclasses
(slots): orjson writes them as they are, FastAPI documents them as response models, and
``from_wire`` reads an answer without model validation (the probe runs once per replica for
every routed request). A field a replica does not send (an older one) reads as its default.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class LoadSnapshot:
    """A replica's load when it answered."""

    running: int = 0  # sequences being prefilled or decoded
    waiting: int = 0  # admitted, not yet running
    queued_prefill_tokens: int = 0  # prompt tokens still to prefill, running and waiting
    free_pages: int = 0
    total_pages: int = 0
    cached_pages: int = 0  # unheld, reusable, evictable
    prefill_tokens_per_s: float = 0.0  # the engine's own estimate
    max_num_seqs: int = 0
    draining: bool = False

    @classmethod
    def from_wire(cls, data: dict) -> LoadSnapshot:
        get = data.get
        return cls(get("running", 0), get("waiting", 0), get("queued_prefill_tokens", 0),
                   get("free_pages", 0), get("total_pages", 0), get("cached_pages", 0),
                   get("prefill_tokens_per_s", 0.0), get("max_num_seqs", 0),
                   get("draining", False))


@dataclass(slots=True)
class ProbeAnswer:
    """How much of a prompt the replica could reuse right now, and its load."""

    num_tokens: int  # reusable prompt tokens (after hybrid pruning)
    num_tokens_before_hybrid_pruning: int  # what the attention layers alone could reuse
    num_prompt_tokens: int
    load: LoadSnapshot

    @classmethod
    def from_wire(cls, data: dict) -> ProbeAnswer:
        """KeyError or TypeError for an answer without the reuse fields."""
        return cls(data["num_tokens"], data["num_tokens_before_hybrid_pruning"],
                   data.get("num_prompt_tokens", 0),
                   LoadSnapshot.from_wire(data.get("load") or {}))


WIRE_FIELDS = {cls.__name__: tuple(f.name for f in fields(cls))
               for cls in (LoadSnapshot, ProbeAnswer)}
