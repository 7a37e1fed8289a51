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

    holders: Counter[int] = Counter()
    refs = [Counter() for _ in pools]
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
        if cache._live_page is not None:
            refs[layout.recurrent][cache._live_page] += 1
    assert tree.num_blocks == len(blocks), (tree.num_blocks, len(blocks))

    attached = [dict() for _ in pools]
    reclaimable = [0] * len(pools)
    for block in blocks:
        assert block.alive
        assert block.holders == holders[id(block)], "block holder count is off"
        assert len(block.key) == (len(block.key) // 4) * 4
        if len(block.key) < 4 * mgr.config.tokens_per_block:
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
                reclaimable[pool] += 1
                assert refs[pool][page] == 0, "a cached page is referenced"
        for pool in layout.attention:
            if pool not in {w for w, _, _ in layout.windows}:
                assert block.pages[pool] is not None, "a block lacks its full-attention page"
    assert reclaimable == tree.reclaimable, (reclaimable, tree.reclaimable)

    for i, pool in enumerate(pools):
        free = pool.free_pages()
        assert len(set(free)) == len(free), f"pool {i}: a page is free twice"
        for page in range(pool.num_pages):
            assert pool.refs[page] == refs[i][page], f"pool {i} page {page}: refs off"
            in_use = refs[i][page] > 0 or page in attached[i]
            assert in_use != (page in set(free)), f"pool {i} page {page}: leaked or double-used"
            if page not in attached[i]:
                assert pool.block_of[page] is None


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
