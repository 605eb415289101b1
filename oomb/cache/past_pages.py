"""The past pages one layer reads for a chunk, as a store receives them (made by oomb.cache.page_lists).

Each ``PastPages`` gets a serial when it is made: a store keys what its device slots hold by
it, never by the tensor's address (freed memory is reused, so a new list could alias an old
one). ``PastPages.hand_to_stream`` is how a store's copy stream receives a list made on the
compute stream.

Two forms. A list: the pages, ascending, each to the next row of the store's device slot. A union
of page lists (``PastPages.union``): every past page in order, -1 where no list names it, with the
slot row of each named page beside it; the host never learns how many pages that is (counting them
would wait for the selection), so the slot is sized for the most the lists can name and the copies
skip the rows marked -1.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

_SERIALS = itertools.count()


@dataclass(eq=False)
class PastPages:
    """The past pages one layer's kernels read for the newest chunk: what a store must have on the device."""

    pages: torch.Tensor  # [m] page indices before the chunk, ascending, distinct (-1: none), on the store's device
    slot_rows: torch.Tensor | None = None  # [m] each page's row in the device slot (-1: none); None: row r for pages[r]
    rows: int | None = None  # device slot rows the pages need (None: m)
    serial: int = field(default_factory=lambda: next(_SERIALS), init=False)  # unique in the process
    _ordered_after: set = field(default_factory=set, init=False, repr=False)  # streams that waited for its making

    @classmethod
    def union(cls, page_lists: torch.Tensor, num_past_pages: int, most: int | None = None) -> PastPages:
        """Every page of ``num_past_pages`` that some list of ``page_lists`` (any shape, page indices) names,
        made on the device without the host waiting for the lists (module docstring). ``most``: the most
        distinct pages the lists can name, where the selection knows fewer than their entries (a chunk's cap,
        PageSelection.chunk_pages); the device slot is sized for it."""
        dev = page_lists.device
        # index_fill_, not ``named[ids] = True``: indexed assignment of a Python scalar copies it from pageable host
        # memory first, a host sync per layer and chunk (tests/engine/test_gpu_syncs.py counts them)
        named = torch.zeros(num_past_pages, dtype=torch.bool, device=dev)
        named.index_fill_(0, page_lists.reshape(-1).long(), True)
        none = torch.full((num_past_pages,), -1, dtype=torch.int32, device=dev)
        order = torch.cumsum(named, 0, dtype=torch.int32) - 1  # a named page's row among the named ones
        pages = torch.where(named, torch.arange(num_past_pages, dtype=torch.int32, device=dev), none)
        rows = min(page_lists.numel(), num_past_pages, page_lists.numel() if most is None else most)
        return cls(pages, torch.where(named, order, none), rows=rows)

    @property
    def num_rows(self) -> int:
        """Rows of the device slot the past pages take."""
        return self.pages.numel() if self.rows is None else self.rows

    def table_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, slot rows) to write into a slot's page table: every named page's row, -1 for a union's other
        pages (the store sends those to a row of its own that nothing reads back)."""
        if self.slot_rows is None:
            return self.pages.long(), torch.arange(self.pages.numel(), dtype=torch.int32, device=self.pages.device)
        return torch.arange(self.pages.numel(), device=self.pages.device), self.slot_rows

    def hand_to_stream(self, stream: torch.cuda.Stream) -> None:
        """Make the list (made on the current stream) safe for the work queued next on ``stream``, which reads it.

        Order: ``stream`` otherwise waits only for what its owner orders it after, so a list made since (a
        sparse layer's selection in stage 1, a window's range) could be read before it is written, and the
        wrong pages copied (or an address outside the pools). Waiting for the current stream's current point
        is exact for a list made just now. Each list is waited for once per stream: stage 2 reuses stage 1's
        lists, which the stream is ordered after since.

        Lifetime: when the last reference goes (``PageLists.drop`` after the chunk's backward, a store's slot
        taking the next list), the list's memory must not go to new tensors of the current stream before the
        work queued on ``stream`` ran, or it would read someone else's numbers as page indices.
        """
        self.pages.record_stream(stream)
        if self.slot_rows is not None:
            self.slot_rows.record_stream(stream)
        if stream in self._ordered_after:
            return
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(self.pages.device))
        stream.wait_event(made)
        self._ordered_after.add(stream)
