"""KVCache: one sequence's hold on the tree and its own pages.

A cache is made by ``KVCacheManager.create_kv_cache``. It keeps, per attention pool, a
block table (one page per block; ``None`` where a window page is not needed: out of the
window), the tree blocks it holds (``path``: one per committed full block), a live
recurrent page, and what its first ``resize`` must copy (a partial source, a recurrent
snapshot). It references (``PagePool.refs``) exactly the pages it needs; every other page
on a block it holds is cached. Every rule here is spelled out in docs/kvcache.md ("A
cache's life").
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from .config import ReuseScope
from .match import Match
from .tokens import TOKEN_BYTES, as_token_array
from .tree import Block

if TYPE_CHECKING:
    from .manager import KVCacheManager


class KVCache:
    """Pages and reuse state of one sequence. Use ``close()`` (or ``with``) when done."""

    def __init__(self, manager: KVCacheManager, scope: ReuseScope, tokens: array,
                 match: Match) -> None:
        layout = manager.layout
        self._mgr = manager
        self._tree = manager._tree
        self._pools = manager._pools
        self._tpb = manager.config.tokens_per_block
        self._recurrent = layout.recurrent
        self.scope = scope
        self.num_reused_tokens = match.probe.num_tokens
        self.num_tokens_before_hybrid_pruning = match.probe.num_tokens_before_hybrid_pruning
        self._tokens = tokens[: self.num_reused_tokens]
        self._capacity = self.num_reused_tokens
        self._closed = False
        self._path: list[Block] = list(match.path)
        self._num_blocks = len(self._path)  # blocks with attention pages
        self._tables: dict[int, list[int | None]] = {i: [] for i in layout.attention}
        self._released_upto = {pool: 0 for pool, _, _ in layout.windows}
        self._live_page: int | None = None
        self._live_valid = True
        self._partial_source: Block | None = match.partial
        self._restore_from: Block | None = match.restore
        self._hold_reused()

    # -- read-only views -------------------------------------------------------------

    @property
    def num_committed_tokens(self) -> int:
        return len(self._tokens)

    @property
    def capacity(self) -> int:
        """Tokens that pages are allocated for (see ``resize``)."""
        return self._capacity

    @property
    def closed(self) -> bool:
        return self._closed

    def committed_tokens(self) -> list[int]:
        return self._tokens.tolist()

    def block_table(self, pool: int) -> list[int | None]:
        """Page per block for attention pool ``pool``; ``None`` where a block's window page
        is not this cache's to read (it left the window, or was out of the window when the
        prefix was reused)."""
        if pool not in self._tables:
            raise ValueError(f"pool {pool} is not an attention life cycle")
        return list(self._tables[pool])

    def live_state_page(self, pool: int) -> int | None:
        """The recurrent pool's page holding this sequence's live state (after ``resize``)."""
        if pool != self._recurrent:
            raise ValueError(f"pool {pool} is not the Recurrent life cycle")
        return self._live_page

    def held_blocks(self) -> list[Block]:
        """Tree blocks this cache holds (internal: for the manager's self-check)."""
        held = list(self._path)
        for block in (self._partial_source, self._restore_from):
            if block is not None:
                held.append(block)
        return held

    # -- life ------------------------------------------------------------------------

    def resize(self, total_tokens: int) -> bool:
        """Make room for ``total_tokens`` tokens.

        Returns False, changing nothing, when the pages cannot be found (free or
        evictable). Raises ValueError below the committed length.
        """
        self._check_open()
        if not isinstance(total_tokens, int) or total_tokens < self.num_committed_tokens:
            raise ValueError(
                f"resize({total_tokens!r}): must be an int >= the {self.num_committed_tokens} "
                "tokens already committed"
            )
        need_blocks = -(-max(total_tokens, self.num_reused_tokens) // self._tpb)
        if need_blocks < self._num_blocks:
            self._shrink(need_blocks)
        needs = {pool: need_blocks - self._num_blocks for pool in self._tables}
        recurrent = self._recurrent
        if recurrent is not None and self._live_page is None:
            needs[recurrent] = 1
        for pool, count in needs.items():
            if count > self._pools[pool].num_free + self._tree.reclaimable[pool]:
                return False
        for pool in sorted(needs):  # pools take their pages in pool order
            for _ in range(needs[pool]):
                page = self._take(pool)
                if pool == recurrent:
                    self._live_page = page
                else:
                    self._tables[pool].append(page)
        self._num_blocks = max(self._num_blocks, need_blocks)
        self._copy_reused_state(new_live_page=recurrent in needs)
        self._capacity = total_tokens
        return True

    def commit(self, new_tokens) -> None:
        """Mark ``new_tokens``, the next tokens of the sequence, as computed (their K/V and
        the live recurrent state written by the engine)."""
        self._check_open()
        new = as_token_array(new_tokens)
        if self.num_committed_tokens + len(new) > self._capacity:
            raise ValueError(
                f"commit of {len(new)} tokens exceeds capacity {self._capacity} with "
                f"{self.num_committed_tokens} committed; call resize() first"
            )
        if not new:
            return
        tick = self._mgr._next_tick()
        first_new_block = len(self._path)
        self._tokens.extend(new)
        for index in range(first_new_block, len(self._tokens) // self._tpb):
            self._insert_block(index)
        self._release_window_pages(tick)
        if self._recurrent is not None and len(self._tokens) % self._tpb == 0:
            self._keep_snapshot(tick)

    def invalidate_live_state(self) -> None:
        """Say that the live recurrent state no longer matches the committed tokens (an
        engine step failed midway): no snapshot is taken from it any more, at a commit or
        at ``close``."""
        self._live_valid = False

    def close(self) -> None:
        """Release everything; committed blocks stay cached. Idempotent."""
        if self._closed:
            return
        self._closed = True
        tick = self._mgr._next_tick()
        held = self.held_blocks()
        tail = self._store_tail()
        if tail is not None:
            held.append(tail)
        tree, full = self._tree, self._mgr.layout.full
        for pool, table in self._tables.items():
            if pool == full:  # its pages are cached with their blocks (release_all below)
                p = self._pools[pool]
                refs, block_of = p.refs, p.block_of
                for page in table:
                    refs[page] -= 1
                    if not refs[page] and block_of[page] is None:
                        p.give_back(page)  # private: nobody else can want it
                continue
            for page in table:
                if page is not None:
                    tree.unref(pool, page, tick)
        if self._live_page is not None:
            tree.unref(self._recurrent, self._live_page, tick)
        self._unref_reused_state(tick)
        tree.release_all(held, tick)
        self._mgr._forget(self)

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"KVCache(reused={self.num_reused_tokens}, committed={self.num_committed_tokens}, "
            f"capacity={self._capacity}, closed={self._closed})"
        )

    # -- internals -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KVCache is closed")

    def _hold_reused(self) -> None:
        """Hold the reused blocks and reference the pages this sequence will read: every
        full-attention page, the window pages its end point needs (and the sinks'), the
        partial source's pages and the snapshot it restores from."""
        tree = self._tree
        tree.hold_all(self._path)
        reused = self.num_reused_tokens
        for pool, table in self._tables.items():
            first, sinks = 0, 0
            for window_pool, window, sink_blocks in self._mgr.layout.windows:
                if window_pool == pool:
                    first, sinks = max(0, (reused + 1 - window) // self._tpb), sink_blocks
                    self._released_upto[pool] = first
            pages = [block.pages[pool] for block in self._path]
            for index in range(sinks, min(first, len(pages))):
                pages[index] = None  # out of the window at the reuse point: not read
            if pool == self._mgr.layout.full:  # needed while held: no cached-state change
                refs = self._pools[pool].refs
                for page in pages:
                    refs[page] += 1
            else:
                for page in pages:
                    if page is not None:
                        tree.ref(pool, page)
            table.extend(pages)
        source = self._partial_source
        if source is not None:
            tree.hold(source)
            for pool in self._tables:
                tree.ref(pool, source.pages[pool])
        restore = self._restore_from
        if restore is not None:
            tree.hold(restore)
            tree.ref(self._recurrent, restore.pages[self._recurrent])

    def _take(self, pool: int) -> int:
        self._tree.evict_until_free(pool, 1)
        return self._pools[pool].take()

    def _shrink(self, need_blocks: int) -> None:
        tick = self._mgr._next_tick()
        for pool, table in self._tables.items():
            while len(table) > need_blocks:
                self._tree.unref(pool, table.pop(), tick)
        self._num_blocks = need_blocks

    def _copy_reused_state(self, new_live_page: bool) -> None:
        """First resize: copy the partial source and the recurrent snapshot into own pages
        (a fresh live state starts at zero), then let go of both."""
        source, restore = self._partial_source, self._restore_from
        if source is not None:
            index = len(self._path)
            for pool, table in self._tables.items():
                self._pools[pool].copy(source.pages[pool], table[index])
        if new_live_page:
            pool = self._pools[self._recurrent]
            if restore is not None:
                pool.copy(restore.pages[self._recurrent], self._live_page)
            elif pool.storage is not None:
                pool.storage[self._live_page].zero_()
        if source is not None or restore is not None:
            self._unref_reused_state(self._mgr._next_tick())

    def _unref_reused_state(self, tick: int) -> None:
        """Drop the references and holds on the partial source and the restore snapshot
        (at the first resize, or at close if there was none)."""
        tree, released = self._tree, []
        source, restore = self._partial_source, self._restore_from
        if source is not None:
            for pool in self._tables:
                tree.unref(pool, source.pages[pool], tick)
            released.append(source)
            self._partial_source = None
        if restore is not None:
            tree.unref(self._recurrent, restore.pages[self._recurrent], tick)
            released.append(restore)
            self._restore_from = None
        if released and not self._closed:
            tree.release_all(released, tick)

    def _insert_block(self, index: int) -> None:
        parent = self._path[index - 1] if index else self._tree.root(self.scope)
        key = self._tokens[index * self._tpb:(index + 1) * self._tpb].tobytes()
        block = parent.children.get(key)
        if block is None:
            block = self._tree.insert(parent, key)
        self._tree.hold(block)
        self._attach_missing(block, index)
        self._path.append(block)

    def _attach_missing(self, block: Block, index: int) -> None:
        """Give ``block`` this cache's own page of block ``index`` in every attention pool
        where it has none (elsewhere the cache's page stays private)."""
        for pool, table in self._tables.items():
            if block.pages[pool] is None and table[index] is not None:
                self._tree.attach(block, pool, table[index])

    def _release_window_pages(self, tick: int) -> None:
        """Blocks that left the window: this cache stops referencing their window pages
        (a page on a block stays cached there; a private one is freed)."""
        committed = len(self._tokens)
        for pool, window, sinks in self._mgr.layout.windows:
            limit = max(0, (committed + 1 - window) // self._tpb)
            table = self._tables[pool]
            for index in range(max(self._released_upto[pool], sinks), limit):
                page = table[index]
                if page is not None:
                    table[index] = None
                    self._tree.unref(pool, page, tick)
            self._released_upto[pool] = max(self._released_upto[pool], limit)

    def _keep_snapshot(self, tick: int) -> None:
        pool = self._recurrent
        block = self._path[-1]
        if block.pages[pool] is not None or not self._live_valid:
            return
        if self._pools[pool].num_free + self._tree.reclaimable[pool] == 0:
            return  # snapshots are best effort: no page, no end point here
        page = self._take(pool)
        self._pools[pool].copy(self._live_page, page)
        self._tree.attach(block, pool, page)
        self._tree.unref(pool, page, tick)  # nobody needs it: cached at once

    def _store_tail(self) -> Block | None:
        """On close (partial reuse on): keep the live state as a snapshot where the history
        ends, and the last partial block as a reusable leaf (docs/kvcache.md)."""
        if not self._mgr.config.enable_partial_reuse:
            return None
        full, rest = divmod(len(self._tokens), self._tpb)
        snapshot = self._live_page is not None and self._live_valid
        if not rest:
            if snapshot and full and self._path[-1].pages[self._recurrent] is None:
                self._tree.attach(self._path[-1], self._recurrent, self._live_page)
            return None
        if not self._tables or self._num_blocks <= full or self._partial_source is not None:
            return None  # never resized: the block's tokens live only in the source
        parent = self._path[-1] if self._path else self._tree.root(self.scope)
        key = self._tokens[full * self._tpb:].tobytes()
        block, stored = parent.children.get(key), None
        if block is None:
            if parent.child_starting_with(key) is not None and not snapshot:
                return None  # a sibling already covers these tokens
            block = stored = self._tree.insert(parent, key)
            self._tree.hold(block)
        self._attach_missing(block, full)  # the same partial block may lack some pages
        if snapshot and block.pages[self._recurrent] is None:
            self._tree.attach(block, self._recurrent, self._live_page)
        return stored

assert TOKEN_BYTES == array("I").itemsize, "array('I') must hold 4-byte token ids"
