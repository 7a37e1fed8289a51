"""Reuse matching: walk the tree, extend into a partial block, prune per life cycle.

The rules are written out in docs/kvcache.md ("Matching"). Matching reads the tree and
changes nothing, so ``probe_reuse`` and ``create_kv_cache`` share it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .config import CacheConfig, ReuseScope
from .tokens import TOKEN_BYTES
from .tree import Block, BlockTree

if TYPE_CHECKING:
    from .manager import PoolLayout


class ReuseProbe(NamedTuple):
    """How many leading tokens of a lookup could be reused right now.

    ``num_tokens``: reusable now, after every life cycle's rule.
    ``num_tokens_before_hybrid_pruning``: what the attention life cycles alone support.
    (A named tuple: probes are made by the million in simulations.)
    """

    num_tokens: int
    num_tokens_before_hybrid_pruning: int


@dataclass(slots=True)
class Match:
    """A match and the blocks behind it (internal to the package)."""

    path: list[Block]  # fully matched blocks within num_tokens
    partial: Block | None  # block whose first partial_tokens tokens extend the match
    partial_tokens: int
    probe: ReuseProbe


class Matcher:
    """Pure lookups over a BlockTree for one CacheConfig."""

    def __init__(self, config: CacheConfig, tree: BlockTree, layout: PoolLayout) -> None:
        self._tpb = config.tokens_per_block
        self._partial = config.enable_partial_reuse
        self._tree = tree
        self._windows = layout.windows
        self._attention = layout.attention
        self._recurrent = layout.recurrent
        self._prunes = bool(self._windows) or self._recurrent is not None

    def probe(self, tokens: array, scope: ReuseScope) -> ReuseProbe:
        """``match(...).probe`` without building the match (the probe hot path)."""
        if self._prunes:
            return self.match(tokens, scope).probe
        root = self._tree.roots.get(scope)
        if root is None or not tokens:
            return ReuseProbe(0, 0)
        data = tokens.tobytes()
        path = self._walk(root, data)
        matched = len(path) * self._tpb
        if self._partial and matched < len(tokens):
            matched += self._best_partial(path[-1] if path else root,
                                          data[matched * TOKEN_BYTES:])[1]
        return ReuseProbe(matched, matched)

    def match(self, tokens: array, scope: ReuseScope) -> Match:
        root = self._tree.roots.get(scope)
        if root is None or not tokens:
            return Match([], None, 0, ReuseProbe(0, 0))
        data = tokens.tobytes()
        path = self._walk(root, data)
        partial, p = None, 0
        matched = len(path) * self._tpb
        if self._partial and matched < len(tokens):
            parent = path[-1] if path else root
            partial, p = self._best_partial(parent, data[matched * TOKEN_BYTES:])
        raw = matched + p
        attention = self._prune(raw, path, partial, with_recurrent=False)
        final = attention
        if self._recurrent is not None:
            final = self._prune(attention, path, partial, with_recurrent=True)
        full = final // self._tpb
        keep_partial = partial if final % self._tpb else None
        return Match(
            path[:full], keep_partial, final % self._tpb, ReuseProbe(final, attention)
        )

    # -- steps -----------------------------------------------------------------------

    def _walk(self, node: Block, data: bytes) -> list[Block]:
        step = self._tpb * TOKEN_BYTES
        if len(data) < step:
            return []
        first = node.children.get(data[:step])
        if first is None:
            return []  # the common miss: one lookup, no splitting
        path = [first]
        node = first
        for chunk in [data[i:i + step] for i in range(step, len(data) - step + 1, step)]:
            node = node.children.get(chunk)  # type: ignore[assignment]
            if node is None:
                break
            path.append(node)
        return path

    def _best_partial(self, parent: Block, rest: bytes) -> tuple[Block | None, int]:
        return parent.longest_common_child(rest[: self._tpb * TOKEN_BYTES], self._attention)

    def _prune(self, length: int, path: list[Block], partial: Block | None,
               with_recurrent: bool) -> int:
        while True:
            cut = length
            for pool, window, sinks in self._windows:
                cut = self._window_cut(cut, path, partial, pool, window, sinks)
            if with_recurrent:
                cut = self._snapshot_cut(cut, path)
            if cut == length:
                return length
            length = cut

    def _window_cut(self, length: int, path: list[Block], partial: Block | None,
                    pool: int, window: int, sinks: int) -> int:
        tpb = self._tpb
        while length > 0:
            last = (length - 1) // tpb
            first = max(0, (length + 1 - window) // tpb)
            missing = None
            for j in range(last, first - 1, -1):
                block = path[j] if j < len(path) else partial
                if block is None or block.pages[pool] is None:
                    missing = j
                    break
            if missing is None:
                for j in range(min(sinks, first) - 1, -1, -1):
                    if path[j].pages[pool] is None:
                        missing = j
                        break
            if missing is None:
                return length
            length = missing * tpb
        return 0

    def _snapshot_cut(self, length: int, path: list[Block]) -> int:
        pool = self._recurrent
        for blocks in range(length // self._tpb, 0, -1):
            if path[blocks - 1].pages[pool] is not None:
                return blocks * self._tpb
        return 0
