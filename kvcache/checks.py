"""A slow self-check of a KVCacheManager: every counter recomputed from scratch."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manager import KVCacheManager
    from .tree import Block


def check_manager(mgr: KVCacheManager) -> None:
    tree, pools, layout = mgr._tree, mgr._pools, mgr.layout
    blocks = _all_blocks(mgr)
    caches = list(mgr._open.values())
    holders, refs = _needs(mgr, caches)
    assert tree.num_blocks == len(blocks), (tree.num_blocks, len(blocks))

    attached = [dict() for _ in pools]
    reclaimable = [0] * len(pools)
    tpb_bytes = 4 * mgr.config.tokens_per_block
    for block in blocks:
        assert block.alive
        assert block.holders == holders[id(block)], "block holder count is off"
        assert len(block.key) % 4 == 0
        if len(block.key) < tpb_bytes:
            assert not block.children, "a partial block has children"
        if not block.holders and not block.children:
            assert block.has_pages(), "an unheld empty leaf was kept"
        for pool, page in enumerate(block.pages):
            if page is None:
                continue
            assert page not in attached[pool], f"page {page} of pool {pool} attached twice"
            attached[pool][page] = block
            assert pools[pool].block_of[page] is block
            if not block.holders:
                assert refs[pool][page] == 0, "a page of an unheld block is referenced"
            cached = not block.holders if pool == layout.full else refs[pool][page] == 0
            reclaimable[pool] += cached
        if layout.full is not None:
            assert block.pages[layout.full] is not None, "a block lacks its full-attention page"
        _check_snapshot_lengths(mgr, block)
    assert reclaimable == tree.reclaimable, (reclaimable, tree.reclaimable)
    for root in tree.roots.values():
        _check_snapshot_lengths(mgr, root)

    assert [len(pages) for pages in attached] == tree.attached, (attached, tree.attached)
    for i, pool in enumerate(pools):
        free = set(pool.free_pages())
        assert len(free) == pool.num_free, f"pool {i}: a page is free twice"
        for page in range(pool.num_pages):
            assert pool.refs[page] == refs[i][page], f"pool {i} page {page}: refs off"
            in_use = refs[i][page] > 0 or page in attached[i]
            assert in_use != (page in free), f"pool {i} page {page}: leaked or double-used"
            if page not in attached[i]:
                assert pool.block_of[page] is None
    for cache in caches:
        _check_window_tables(mgr, cache)


def _needs(mgr: KVCacheManager, caches) -> tuple[Counter, list[Counter]]:
    """Holders per block and references per page, from the open caches alone."""
    layout = mgr.layout
    holders: Counter[int] = Counter()
    refs = [Counter() for _ in mgr._pools]
    for cache in caches:
        for block in cache.held_blocks():
            holders[id(block)] += 1
        for pool, table in cache._tables.items():
            for page in table:
                if page is not None:
                    refs[pool][page] += 1
        if cache._partial_source is not None:
            for pool in layout.attention:
                refs[pool][cache._partial_source.pages[pool]] += 1
        if cache._restore_from is not None:
            refs[layout.recurrent][cache._restore_from.pages[layout.recurrent]] += 1
        if cache._live_page is not None:
            refs[layout.recurrent][cache._live_page] += 1
    return holders, refs


def _check_window_tables(mgr: KVCacheManager, cache) -> None:
    """A cache references no window page its end point does not need."""
    tpb, committed = mgr.config.tokens_per_block, cache.num_committed_tokens
    for pool, window, sinks in mgr.layout.windows:
        first = max(0, (committed + 1 - window) // tpb)
        for index, page in enumerate(cache._tables[pool]):
            if sinks <= index < first:
                assert page is None, (
                    f"pool {pool}: block {index} is out of the window at {committed} "
                    "tokens but the cache still references its page")


def _check_snapshot_lengths(mgr: KVCacheManager, node: Block) -> None:
    rec = mgr.layout.recurrent
    want: Counter[int] = Counter()
    if rec is not None:
        for child in node.children.values():
            if len(child.key) < 4 * mgr.config.tokens_per_block and child.pages[rec] is not None:
                want[len(child.key) // 4] += 1
    assert dict(want) == (node.snapshot_lengths or {}), "snapshot lengths of a node are off"


def _all_blocks(mgr: KVCacheManager) -> list[Block]:
    out = []
    stack = [root for root in mgr._tree.roots.values()]
    for root in stack:
        assert root.children, "an empty root was kept"
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.key == key and child.parent is node
            out.append(child)
            stack.append(child)
        assert node.sorted_keys == sorted(node.children), "sorted child keys are off"
    return out
