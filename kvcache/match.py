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
    restore: Block | None = None  # block carrying the recurrent snapshot at num_tokens


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
        ends = _Ends(path, partial, root, data)
        attention = self._prune(matched + p, ends, with_recurrent=False)
        if self._recurrent is None:
            final, restore = attention, None
        else:
            final = self._prune(attention, ends, with_recurrent=True)
            restore = self._snapshot_block(final, ends)
        full, rest = divmod(final, self._tpb)
        # Inside block `full` the match reads the block the walk used there: the next full
        # block if the walk went on, else the partial extension.
        source = (path[full] if full < len(path) else partial) if rest else None
        return Match(path[:full], source, rest, ReuseProbe(final, attention), restore)

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

    def _prune(self, length: int, ends: _Ends, with_recurrent: bool) -> int:
        while True:
            cut = length
            for pool, window, sinks in self._windows:
                cut = self._window_cut(cut, ends.path, ends.partial, pool, window, sinks)
            if with_recurrent:
                cut = self._snapshot_cut(cut, ends)
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

    def _snapshot_cut(self, length: int, ends: _Ends) -> int:
        """The largest end point <= ``length`` that carries a recurrent snapshot: the end
        of a matched full block, or the end of a partial block whose every token the
        lookup matches (a child of a matched block, or of the root)."""
        pool, tpb, path = self._recurrent, self._tpb, ends.path
        depth, room = divmod(length, tpb)
        while depth >= 0:
            parent = path[depth - 1] if depth else ends.root
            if room and parent.snapshot_lengths:
                base = depth * tpb * TOKEN_BYTES
                for n in sorted(parent.snapshot_lengths, reverse=True):
                    if n <= room:
                        child = parent.children.get(ends.data[base:base + n * TOKEN_BYTES])
                        if child is not None and child.pages[pool] is not None:
                            return depth * tpb + n
            if depth and path[depth - 1].pages[pool] is not None:
                return depth * tpb
            depth, room = depth - 1, tpb - 1
        return 0

    def _snapshot_block(self, length: int, ends: _Ends) -> Block | None:
        """The block carrying the snapshot at ``length`` (an end ``_snapshot_cut`` found)."""
        if length == 0:
            return None
        depth, rest = divmod(length, self._tpb)
        if not rest:
            return ends.path[depth - 1]
        parent = ends.path[depth - 1] if depth else ends.root
        start = depth * self._tpb * TOKEN_BYTES
        return parent.children[ends.data[start:length * TOKEN_BYTES]]


class _Ends(NamedTuple):
    """What pruning looks at: the walked path, the partial extension, the scope's root and
    the lookup's bytes."""

    path: list[Block]
    partial: Block | None
    root: Block
    data: bytes
