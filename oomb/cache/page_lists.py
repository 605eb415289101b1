"""A step's page lists, in one place: chosen once, reused, handed to the store, dropped.

A sparse layer's page lists for a chunk (``page_select`` [B, H_sel, n_blocks, K]: the past
pages each block of queries attends) and the past pages a layer's kernels read (what an
offloaded store must bring to the device) live here, per (layer, chunk start)::

    stage 1, chunk k, layer l    chosen(l, k, choose)   choose() runs: select_pages, kept
                                 layer_ran(...)         the union of the lists -> PastPages, fetched
                                 past_pages(l + 1)      known? the next layer's pages are prefetched
    stage 2, chunk k, layer l    chosen(l, k, ...)      the same lists: recompute and backward attend
                                 past_pages(l)          stage 1's pages, the same PastPages
    after chunk k's backward     drop(k)

Dense layers read every past page (``None``); sliding-window layers the pages of their
window (a range made when first asked for). A layer's window is learned when it first runs.

``PastPages`` (oomb/cache/past_pages.py) is what a store receives: one layer's list, with a
serial a store keys its device slots by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from oomb.cache.layout import first_visible_page
from oomb.cache.past_pages import PastPages

if TYPE_CHECKING:
    from oomb.cache.interface import KVStore

class PageLists:
    """A step's page lists and the past pages each layer reads, per (layer, chunk start) (module docstring)."""

    def __init__(self, sparse: bool, listed: Callable[[int], int] | None = None) -> None:
        self.sparse = sparse  # a selection policy is on: a full-attention layer's pages are known once it ran
        # Entries of one row's page lists for a chunk of n queries (blocks x budget x lists per row): where they
        # are at least the past pages, their union may be the whole past, and a store is asked for every past
        # page instead (known before the selection, so prefetched; one contiguous copy per row and kind). The
        # kernels still attend only the listed pages.
        self.listed = listed
        self._chosen: dict[tuple[int, int], torch.Tensor | None] = {}
        self._past: dict[tuple[int, int], PastPages | None] = {}
        self._windows: dict[int, int | None] = {}  # each layer's sliding window (None = full attention)

    @staticmethod
    def bytes_for(*, batch_size: int, seq_len: int, chunk_size: int, page_size: int, page_budget: int, block: int,
                  lists: int, layers: int) -> int:
        """The page lists a step keeps from stage 1 to stage 2: int32 [B, ``lists``, ceil(C / block), budget] per
        sparse layer (``layers`` of them), for every chunk whose past holds more than ``page_budget`` pages (with
        fewer, attention is dense and no list is made)."""
        chunk = min(chunk_size, seq_len)
        n_chunks = -(-seq_len // chunk)
        # Chunk k has k * chunk // page_size past pages: lists exist from k = ceil((budget + 1) * page / chunk).
        listed = max(0, n_chunks - -(-(page_budget + 1) * page_size // chunk))
        return 4 * batch_size * lists * -(-chunk // block) * page_budget * layers * listed

    def chosen(self, layer_idx: int, chunk_start: int,
               choose: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """The layer's page lists [B, H_sel, n_blocks, K] for the chunk (None: it attends densely). ``choose``
        makes them the first time the chunk runs (stage 1, or stage 2 for the last chunk); every later pass
        gets the same tensor, so the recomputed forward and the backward attend the pages stage 1 attended."""
        key = (layer_idx, chunk_start)
        if key not in self._chosen:
            self._chosen[key] = choose()
        return self._chosen[key]

    def layer_ran(self, store: KVStore, layer_idx: int, sliding_window: int | None,
                  page_select: torch.Tensor | None) -> PastPages | None:
        """Record a layer running on the newest chunk (its window; the union of its page lists where the store
        moves only listed pages) and return the past pages it reads (None = all)."""
        self._windows[layer_idx] = sliding_window
        key = (layer_idx, store.last_chunk().start)
        if (key not in self._past and page_select is not None and store.needs_page_list(layer_idx)
                and not self.covers_past(store)):
            # Every page some block or head reads (each list is ascending and distinct). One list is its own
            # union; several are joined on the device (PastPages.union), never with torch.unique, whose
            # data-dependent size would make the host wait for the selection.
            one_list = page_select.shape[:3] == (1, 1, 1)
            past = store.last_chunk().start // store.spec.page_size
            # a row's lists name at most listed(n) pages, and the union is of page indices over the batch's rows
            most = (None if self.listed is None
                    else page_select.shape[0] * self.listed(store.num_tokens - store.last_chunk().start))
            self._past[key] = PastPages(page_select.view(-1)) if one_list else PastPages.union(page_select, past, most)
        return self.past_pages(store, layer_idx)[1]

    def past_pages(self, store: KVStore, layer_idx: int) -> tuple[bool, PastPages | None]:
        """(known, pages): the past pages (None = all) the layer's kernels read for the newest chunk. Unknown
        for a layer that has not run yet, and for a sparse layer whose selection is not made yet."""
        q0 = store.last_chunk().start
        key = (layer_idx, q0)
        if key in self._past:
            return True, self._past[key]
        if layer_idx not in self._windows:
            return False, None
        window = self._windows[layer_idx]
        if window is not None:
            page_size = store.spec.page_size
            first = first_visible_page(store.num_tokens, store.num_tokens - q0, page_size, window)
            pages = PastPages(torch.arange(first, q0 // page_size, device=store.page_table.device))
        elif not self.sparse or self.covers_past(store):
            pages = None
        else:
            return False, None  # chosen when the layer runs on this chunk
        self._past[key] = pages
        return True, pages

    def covers_past(self, store: KVStore) -> bool:
        """Whether the newest chunk's page lists name at least as many pages per row as its past holds
        (``listed``): then every past page is asked for instead of the lists' union."""
        if self.listed is None:
            return False
        q0 = store.last_chunk().start
        return self.listed(store.num_tokens - q0) >= q0 // store.spec.page_size

    def drop(self, chunk_start: int) -> None:
        """Forget the page lists of the chunk that starts at ``chunk_start`` (after its backward)."""
        for table in (self._chosen, self._past):
            for key in [key for key in table if key[1] == chunk_start]:
                del table[key]
