"""KVCache: one sequence's hold on the tree and its own pages.

A cache is made by ``KVCacheManager.create_kv_cache``. It keeps, per attention pool, a
block table (one page per block; ``None`` once a window page was given back), the tree
blocks it holds (``path``: one per committed full block), a live recurrent page, and what
its first ``resize`` must copy (a partial source, a recurrent snapshot). Every rule here
is spelled out in docs/kvcache.md ("A cache's life").
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
        self._partial_source: Block | None = match.partial
        self._restore_from: Block | None = None
        if layout.recurrent is not None and self._path:
            self._restore_from = self._path[-1]
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
        was given back (or never needed: it was out of the window when reused)."""
        if pool not in self._tables:
            raise ValueError(f"pool {pool} is not an attention life cycle")
        return list(self._tables[pool])

    def live_state_page(self, pool: int) -> int | None:
        """The recurrent pool's page holding this sequence's live state (after ``resize``)."""
        if pool != self._mgr.layout.recurrent:
            raise ValueError(f"pool {pool} is not the Recurrent life cycle")
        return self._live_page

    def held_blocks(self) -> list[Block]:
        """Tree blocks this cache holds (internal: for the manager's self-check)."""
        held = list(self._path)
        if self._partial_source is not None:
            held.append(self._partial_source)
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
        recurrent = self._mgr.layout.recurrent
        if recurrent is not None and self._live_page is None:
            needs[recurrent] = 1
        for pool, count in needs.items():
            if count > self._pools[pool].num_free + self._tree.reclaimable[pool]:
                return False
        for pool, count in needs.items():
            for _ in range(count):
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
        """Mark ``new_tokens``, the next tokens of the sequence, as computed."""
        self._check_open()
        new = as_token_array(new_tokens)
        if self.num_committed_tokens + len(new) > self._capacity:
            raise ValueError(
                f"commit of {len(new)} tokens exceeds capacity {self._capacity} with "
                f"{self.num_committed_tokens} committed; call resize() first"
            )
        if not new:
            return
        first_new_block = len(self._path)
        self._tokens.extend(new)
        for index in range(first_new_block, len(self._tokens) // self._tpb):
            self._insert_block(index)
        self._release_window_pages()
        if self._mgr.layout.recurrent is not None and len(self._tokens) % self._tpb == 0:
            self._keep_snapshot()

    def close(self) -> None:
        """Release everything; committed full blocks stay cached. Idempotent."""
        if self._closed:
            return
        self._closed = True
        held = self.held_blocks()
        tail = self._store_tail()
        if tail is not None:
            held.append(tail)
        for pool, table in self._tables.items():
            p = self._pools[pool]
            refs, block_of = p.refs, p.block_of
            for page in table:
                if page is None:
                    continue
                refs[page] -= 1
                if not refs[page] and block_of[page] is None:
                    p.give_back(page)  # private: nobody else can want it
        if self._live_page is not None:
            self._unref(self._mgr.layout.recurrent, self._live_page, keep_attached=True)
        if self._partial_source is not None:
            self._unref_attention_pages(self._partial_source)
        self._tree.release_all(held, self._mgr._next_tick())
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
        """Hold the reused blocks and reference the pages this sequence will read."""
        self._tree.hold_all(self._path)
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
            refs = self._pools[pool].refs
            for page in pages:
                if page is not None:
                    refs[page] += 1
            table.extend(pages)
        if self._partial_source is not None:
            self._tree.hold(self._partial_source)
            for pool in self._tables:
                self._pools[pool].refs[self._partial_source.pages[pool]] += 1

    def _take(self, pool: int) -> int:
        self._tree.evict_until_free(pool, 1)
        return self._pools[pool].take()

    def _unref(self, pool: int, page: int, keep_attached: bool) -> None:
        """Drop this cache's reference; a page nobody references is freed unless it is
        attached to a tree block and ``keep_attached`` (then it stays cached)."""
        p = self._pools[pool]
        p.refs[page] -= 1
        if p.refs[page]:
            return
        block = p.block_of[page]
        if block is not None:
            if keep_attached:
                return
            self._tree.detach(block, pool)
        p.give_back(page)

    def _unref_attention_pages(self, block: Block) -> None:
        for pool in self._tables:
            self._unref(pool, block.pages[pool], keep_attached=True)

    def _shrink(self, need_blocks: int) -> None:
        for pool, table in self._tables.items():
            while len(table) > need_blocks:
                self._unref(pool, table.pop(), keep_attached=False)
        self._num_blocks = need_blocks

    def _copy_reused_state(self, new_live_page: bool) -> None:
        """First resize: copy the partial source and the recurrent snapshot into own pages
        (a fresh live state starts at zero)."""
        source = self._partial_source
        if source is not None:
            index = len(self._path)
            for pool, table in self._tables.items():
                self._pools[pool].copy(source.pages[pool], table[index])
            self._unref_attention_pages(source)
            self._partial_source = None
            self._tree.release(source, self._mgr._next_tick())
        recurrent = self._mgr.layout.recurrent
        if not new_live_page:
            return
        if self._restore_from is not None:
            self._pools[recurrent].copy(self._restore_from.pages[recurrent], self._live_page)
            self._restore_from = None
        elif self._pools[recurrent].storage is not None:
            self._pools[recurrent].storage[self._live_page].zero_()

    def _insert_block(self, index: int) -> None:
        parent = self._path[index - 1] if index else self._tree.root(self.scope)
        key = self._tokens[index * self._tpb:(index + 1) * self._tpb].tobytes()
        block = parent.children.get(key)
        if block is None:
            block = self._tree.insert(parent, key)
        self._tree.hold(block)
        for pool, table in self._tables.items():
            if block.pages[pool] is None and table[index] is not None:
                self._tree.attach(block, pool, table[index])
        self._path.append(block)

    def _release_window_pages(self) -> None:
        committed = len(self._tokens)
        for pool, window, sinks in self._mgr.layout.windows:
            limit = max(0, (committed + 1 - window) // self._tpb)
            table = self._tables[pool]
            for index in range(max(self._released_upto[pool], sinks), limit):
                page = table[index]
                if page is not None:
                    table[index] = None
                    self._unref(pool, page, keep_attached=False)
            self._released_upto[pool] = max(self._released_upto[pool], limit)

    def _keep_snapshot(self) -> None:
        pool = self._mgr.layout.recurrent
        block = self._path[-1]
        if block.pages[pool] is not None:
            return
        if self._pools[pool].num_free + self._tree.reclaimable[pool] == 0:
            return  # snapshots are best effort: no page, no end point here
        page = self._take(pool)
        self._pools[pool].copy(self._live_page, page)
        self._pools[pool].refs[page] = 0
        self._tree.attach(block, pool, page)

    def _store_tail(self) -> Block | None:
        """On close: keep the last partial block as a reusable leaf (docs/kvcache.md)."""
        full, rest = divmod(len(self._tokens), self._tpb)
        if not (rest and self._tables and self._mgr.config.enable_partial_reuse):
            return None
        if self._num_blocks <= full or self._partial_source is not None:
            return None  # never resized: the block's tokens live only in the source
        parent = self._path[-1] if self._path else self._tree.root(self.scope)
        key = self._tokens[full * self._tpb:].tobytes()
        if parent.child_starting_with(key) is not None:
            return None
        block = self._tree.insert(parent, key)
        self._tree.hold(block)
        for pool, table in self._tables.items():
            self._tree.attach(block, pool, table[full])
        return block


assert TOKEN_BYTES == array("I").itemsize, "array('I') must hold 4-byte token ids"
