"""The ``sim`` engine: a timing model over the real KVCacheManager.

Allocation, reuse and eviction are real (the scheduler drives the manager as for any
engine); only the model's compute is replaced by sleeping for the time it would take:

    step_time = (step_overhead_s
                 + prefill_tokens / prefill_tokens_per_s           # uncached tokens computed
                 + prefill_seqs * per_seq_prefill_s
                 + decode_seqs * decode_per_seq_s) / speedup

``prefill_tokens`` counts only the tokens actually computed, so reuse shortens the step:
that is the effect the router exploits. ``speedup`` scales every cost (load tests run
faster than real time). Sampled tokens are lowercase letters and spaces from a per-sequence
generator (seeded by ``seed`` when given), so outputs are valid text and reproducible: the
ids of those characters under the replica's tokenizer (``text_alphabet``), byte-level
unless ``--tokenizer`` names another.

With a model's layer specs (``--engine sim --model DIR``: the checkpoint's config, never its
weights) the sim replica has that model's pools and reuse rules (``pools.PoolPlan``: the
torch engine's) and charges each layer kind its own cost per computed token: every layer
one unit (projections, MLP), an attention layer also one unit per ``KEYS_PER_UNIT`` keys it
attends to (all earlier tokens, or its window), a recurrent layer nothing more (its state
is of fixed size). ``prefill_tokens_per_s`` is then the rate of short prompts (keys cost
nothing yet), and a decode step's per-sequence cost grows likewise with what it attends.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache import CacheConfig, FullAttention

from .base import Engine, StepItem

if TYPE_CHECKING:
    from ..models.base import ModelSpec
    from text import Tokenizer
    from .pools import PoolPlan

KEYS_PER_UNIT = 4096  # an attention layer attending to this many keys costs one unit more

CHARACTERS = "abcdefghijklmnopqrstuvwxyz "
_BYTE_ALPHABET = [ord(c) for c in CHARACTERS]  # the byte-level tokenizer's ids


def text_alphabet(tokenizer: Tokenizer) -> list[int]:
    """For each of ``CHARACTERS`` that one token of ``tokenizer`` decodes to on its own, the
    lowest such id that is no eos id, in ``CHARACTERS``' order (the byte-level tokenizer's
    are the characters' bytes). ValueError when there is none at all."""
    found: dict[str, int] = {}
    eos = tokenizer.eos_token_ids
    for i in range(tokenizer.vocab_size):
        if i in eos:
            continue
        text = tokenizer.decode([i])
        if text in CHARACTERS and len(text) == 1 and text not in found:
            found[text] = i
            if len(found) == len(CHARACTERS):
                break
    if not found:
        raise ValueError(f"no token of tokenizer {tokenizer.name!r} decodes to a lowercase "
                         "letter or a space: the sim engine cannot write text with it")
    return [found[c] for c in CHARACTERS if c in found]


@dataclass(frozen=True)
class SimTiming:
    prefill_tokens_per_s: float = 20_000.0
    step_overhead_s: float = 0.002
    per_seq_prefill_s: float = 0.0005
    decode_per_seq_s: float = 0.0004
    speedup: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "speedup"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sim timing {name} must be > 0, got {getattr(self, name)}")
        for name in ("step_overhead_s", "per_seq_prefill_s", "decode_per_seq_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"sim timing {name} must be >= 0, got {getattr(self, name)}")

    def step_seconds(self, prefill_tokens: int, prefill_seqs: int, decode_seqs: int) -> float:
        cost = (self.step_overhead_s + prefill_tokens / self.prefill_tokens_per_s
                + prefill_seqs * self.per_seq_prefill_s + decode_seqs * self.decode_per_seq_s)
        return cost / self.speedup


class SimEngine(Engine):
    """Sleeps for the modelled step time; samples letters."""

    name = "sim"

    def __init__(self, timing: SimTiming | None = None, max_model_len: int = 32768,
                 alphabet: list[int] | None = None, spec: ModelSpec | None = None,
                 info: dict | None = None) -> None:
        """``alphabet``: the token ids it samples (``text_alphabet`` of the replica's
        tokenizer); default the byte-level tokenizer's. ``spec``: a model's layers (its
        pools, reuse rules and per-layer costs); None: one full-attention pool."""
        self.timing = timing or SimTiming()
        self._max_model_len = max_model_len
        self.alphabet = list(alphabet) if alphabet is not None else _BYTE_ALPHABET
        self.spec, self.info = spec, dict(info or {})
        self.pools: PoolPlan | None = None
        self._tpb = 1
        if spec is not None:
            from .pools import PoolPlan

            self.pools = PoolPlan.of(spec)
            self.kinds, self.windows = self.pools.kinds, self.pools.windows
            self.pool_layers = self.pools.layers
            self._windows = [layer.window for layer in spec.layers
                             if layer is not None and layer.kind != "recurrent"]
            self._max_model_len = min(max_model_len, spec.max_model_len)

    def cache_config(self, num_pages: int, tokens_per_block: int,
                     enable_partial_reuse: bool) -> CacheConfig:
        self._tpb = tokens_per_block
        if self.pools is not None:
            return self.pools.cache_config(num_pages, tokens_per_block, enable_partial_reuse)
        return CacheConfig(tokens_per_block=tokens_per_block, num_pages=num_pages,
                           life_cycles=(FullAttention(),),
                           enable_partial_reuse=enable_partial_reuse)

    def pool_names(self) -> list[str]:
        return self.pools.names() if self.pools is not None else ["full"]

    def pool_page_bytes(self) -> tuple[int, ...] | None:
        """What one page of each pool would take on a torch replica of the model (the sim
        allocates none): the sizes its pools are planned from (``--kv-cache-bytes``)."""
        if self.pools is None:
            return None
        dtype = str(self.spec.dtype).removeprefix("torch.")
        return self.pools.page_bytes(self._tpb, dtype)

    def _cost(self, item: StepItem) -> float:
        """The item's work in token-units, relative to one token of a model whose layers
        attend to nothing (``spec`` None: its tokens)."""
        n = len(item.tokens)
        if self.spec is None:
            return float(n)
        keys = sum(_visible_keys(item.start, n, window) for window in self._windows)
        return n + keys / (KEYS_PER_UNIT * len(self.spec.layers))

    async def step(self, items: list[StepItem]) -> list[int | None]:
        prefill = [it for it in items if it.is_prefill]
        decode = [it for it in items if not it.is_prefill]
        weight = (sum(self._cost(it) for it in decode) / len(decode)) if decode else 1.0
        seconds = self.timing.step_seconds(
            prefill_tokens=sum(self._cost(it) for it in prefill),
            prefill_seqs=len(prefill),
            decode_seqs=len(decode) * weight,
        )
        await asyncio.sleep(seconds)
        return [self._sample(it) if it.sample is not None else None for it in items]

    def _sample(self, item: StepItem) -> int:
        rng = item.state.get("rng")
        if rng is None:
            seed = item.sample.seed if item.sample.seed is not None else item.seq_id
            rng = item.state["rng"] = random.Random(seed)
        return rng.choice(self.alphabet)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.timing.prefill_tokens_per_s * self.timing.speedup

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def describe(self) -> dict:
        t = self.timing
        out = {"engine": self.name, **self.info, "prefill_tokens_per_s": t.prefill_tokens_per_s,
               "step_overhead_s": t.step_overhead_s, "decode_per_seq_s": t.decode_per_seq_s,
               "speedup": t.speedup}
        if self.spec is not None:
            out.update(layers=list(self.spec.kinds), pools=self.pool_names(),
                       windows=sorted({w for w in self.windows if w is not None}),
                       max_model_len=self._max_model_len)
        return out


def _visible_keys(start: int, n: int, window: int | None) -> int:
    """Keys the tokens at positions ``start .. start+n-1`` attend to, together: position
    p sees p + 1 keys, or ``window`` once p + 1 exceeds it."""
    end = start + n
    if window is None or window >= end:
        return (start + 1 + end) * n // 2
    ramp_end = max(start, min(end, window))  # positions below window - 1 see p + 1 keys
    ramp = (start + 1 + ramp_end) * (ramp_end - start) // 2
    return ramp + (end - ramp_end) * window
