"""Page allocator: integers only, no tensors (vLLM's block pool habit).

The store (store.py) owns the tensors; this class only decides which page ids are
free. Pages are handed out lowest id first so a fresh step fills the pool from the
front, which keeps the pages of one chunk contiguous in memory when nothing else is
allocated (the common case: a step starts with an empty pool).
"""

from __future__ import annotations

import heapq


class OutOfPagesError(RuntimeError):
    """More pages were asked for than the pool holds."""


class PageAllocator:
    """A free list of page ids ``0 .. num_pages-1``."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # a heap; sorted lists are heaps
        self._used: set[int] = set()

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free page ids (lowest first); raise OutOfPagesError if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(
                f"asked for {n} pages but only {len(self._free)} of {self._num_pages} are free"
            )
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """Return pages to the free list; freeing a page that is not in use is a bug and raises."""
        for i in ids:
            if i not in self._used:
                raise ValueError(f"page {i} is not allocated (double free or foreign id)")
        for i in ids:
            self._used.remove(i)
            heapq.heappush(self._free, i)

    def grow(self, num_pages: int) -> None:
        """Extend the id range to ``num_pages``; new ids are free. Never shrinks."""
        if num_pages < self._num_pages:
            raise ValueError(f"cannot shrink the allocator from {self._num_pages} to {num_pages} pages")
        for i in range(self._num_pages, num_pages):
            heapq.heappush(self._free, i)
        self._num_pages = num_pages

    def reset(self, num_pages: int | None = None) -> None:
        """Free everything, optionally resizing (the pool is empty, so any size is fine)."""
        if num_pages is not None:
            self._num_pages = num_pages
        self._free = list(range(self._num_pages))
        self._used.clear()
