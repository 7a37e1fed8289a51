"""A pool of fixed-size pages for one life cycle.

The pool knows which pages are free and how many open caches reference each page. Which
tree block a page is attached to is the tree's business (``Block.pages``); the pool keeps
the back pointer, and the tick at which a window or snapshot page last became cached (the
tree's eviction order checks its queued entries against it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import PageLayout

if TYPE_CHECKING:
    import torch

    from .tree import Block


class PagePool:
    """Pages ``0..num_pages-1``; optional torch storage ``[num_pages, *layout.shape]``."""

    def __init__(self, num_pages: int, layout: PageLayout | None = None) -> None:
        self.num_pages = num_pages
        # Hand out low page ids first: pop() takes from the end.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.refs: list[int] = [0] * num_pages
        self.block_of: list[Block | None] = [None] * num_pages
        self.cached_at: list[int] = [0] * num_pages
        self.storage: torch.Tensor | None = None
        if layout is not None:
            import torch

            dtype = getattr(torch, layout.dtype) if isinstance(layout.dtype, str) else layout.dtype
            self.storage = torch.zeros(
                (num_pages, *layout.shape), dtype=dtype, device=layout.device
            )

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free page with one reference. The caller checked that one is free."""
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def give_back(self, page: int) -> None:
        """Return an unreferenced, unattached page to the free list."""
        self.refs[page] = 0
        self.block_of[page] = None
        self._free.append(page)

    def copy(self, src: int, dst: int) -> None:
        """Copy page contents (no-op for a bookkeeping-only pool)."""
        if self.storage is not None:
            self.storage[dst].copy_(self.storage[src])

    def free_pages(self) -> list[int]:
        return list(self._free)
