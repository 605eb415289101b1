"""Sliding-window layers keep the pages their window reaches, not the whole past.

A layer whose attention calls name a window W (key j visible to query i where i - j < W) reads, of the chunks before
the one it computes, only the pages holding one of the W - 1 tokens before the chunk. The layers that share a window
share page ids of their own (an allocator and a block table beside the store's), and each chunk keeps only the pages
a later chunk's window reaches::

    stage 1, append chunk k+1    chunk k keeps its tail, the ceil((W - 1) / page_size) pages chunk k+1's window
                                 reaches (every page where the window is longer than the chunk); the rest are freed
    stage 2, free chunk k+1      chunk k gets its other pages back, gradient pages zeroed; its recomputed forward
                                 writes their K/V again (``KVStore.refill`` where the attention output was cached in
                                 stage 1) before its backward reads them

The gradient stays exact: the only pages a later chunk attends are the tails, kept with their gradient pages from
stage 1 to their own chunk's backward, and a page given back holds no gradient of a later chunk (none sees it). A
step holds of such a layer every chunk's tail and one whole chunk: Gemma-3's 1024-token windows (40 of its 48
layers) keep 8 pages of 128 tokens a chunk instead of all of them. Entries of the block table for pages it no longer
holds point at one scratch page, which kernels may read and write (zero gradients of keys no query sees) and nothing
reads back, as ``KVStore.fetch`` allows.
"""

from __future__ import annotations

import torch

from oomb.cache.allocator import PageAllocator


def ids_on_device(ids: list[int], batch_size: int, device: torch.device) -> torch.Tensor:
    """Host page ids, sequence-major, as an int32 [batch_size, n] tensor on ``device``. The ids come from a host
    allocator: a pageable copy would wait for the stream (a host sync per chunk), so pinned + non_blocking."""
    cuda = device.type == "cuda"
    return torch.tensor(ids, dtype=torch.int32, pin_memory=cuda).view(batch_size, -1).to(device, non_blocking=cuda)


def tail_pages(window: int, page_size: int) -> int:
    """Pages of a chunk that the next chunk's window reaches (its first query sees W - 1 tokens back)."""
    return -(-(window - 1) // page_size)


def window_page_ids(window: int, *, batch_size: int, num_tokens: int, page_size: int, chunk_size: int | None) -> int:
    """Page ids the layers of one window take at most in a step of ``batch_size`` x ``num_tokens`` in chunks of
    ``chunk_size``: every chunk's tail and one whole chunk (the one being computed), and the scratch page. Without a
    chunk size: every page."""
    pages = -(-num_tokens // page_size)
    if chunk_size is None:
        return batch_size * pages + 1
    chunk = min(chunk_size, num_tokens)
    per_chunk, chunks = -(-chunk // page_size), -(-num_tokens // chunk)
    return batch_size * min(pages, (chunks - 1) * min(per_chunk, tail_pages(window, page_size)) + per_chunk) + 1


class WindowPages:
    """The page ids of the store layers that share one sliding window: their allocator, block table, and for each
    chunk of the store's ledger the pages it still holds (module docstring)."""

    def __init__(self, window: int, layers: tuple[int, ...]) -> None:
        self.window = window
        self.layers = layers
        self.allocator = PageAllocator(0)
        self.table = torch.zeros((0, 0), dtype=torch.int32)
        self.scratch = 0
        self._first: list[int] = []  # per chunk, oldest first: the first page index it holds
        self._held: list[torch.Tensor] = []  # per chunk: the ids it holds, int64 [B, n] on the host
        # The newest chunk got pages back after stage 1 wrote them: its K/V must be written again before they are
        # read (``refill``); a fresh chunk is written by its first attention call anyway.
        self.refill_due = False

    def start(self, batch_size: int, max_pages: int, device: torch.device) -> None:
        """A new step over an empty ledger: every id free but the scratch page, every table entry on it."""
        self.allocator.reset()
        self.scratch = self.allocator.allocate(1)[0]
        self.table = torch.full((batch_size, max_pages), self.scratch, dtype=torch.int32, device=device)
        self._first, self._held = [], []
        self.refill_due = False

    def widen(self, max_pages: int) -> None:
        """Room in the block table for ``max_pages`` page indices (appends past the reservation)."""
        if max_pages > self.table.shape[1]:
            grown = torch.full((self.table.shape[0], max_pages), self.scratch, dtype=torch.int32,
                               device=self.table.device)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown

    def trim_newest(self, first_page: int, end: int, page_size: int) -> None:
        """Free the newest chunk's pages that no later chunk's window reaches (before the next chunk is added)."""
        keep_from = max(first_page, (end - self.window + 1) // page_size)
        cut = keep_from - self._first[-1]
        if cut <= 0:
            return
        held = self._held[-1]
        self.allocator.free(held[:, :cut].flatten().tolist())
        self._held[-1], self._first[-1] = held[:, cut:], keep_from
        self.table[:, first_page:keep_from].fill_(self.scratch)

    def add(self, first_page: int, ids: list[int], batch_size: int) -> None:
        """A new newest chunk holding ``ids`` (sequence-major) from page ``first_page`` on."""
        held = torch.tensor(ids, dtype=torch.int64).view(batch_size, -1)
        self.table[:, first_page : first_page + held.shape[1]] = ids_on_device(ids, batch_size, self.table.device)
        self._first.append(first_page)
        self._held.append(held)
        self.refill_due = False

    def free_newest(self, first_page: int, num_pages: int) -> None:
        """Free every page the newest chunk holds."""
        self.allocator.free(self._held.pop().flatten().tolist())
        self._first.pop()
        self.table[:, first_page : first_page + num_pages].fill_(self.scratch)

    def missing(self, first_page: int) -> int:
        """Pages per sequence the newest chunk (starting at page ``first_page``) gave up to its tail."""
        return self._first[-1] - first_page if self._first else 0

    def restore_newest(self, first_page: int, ids: list[int], batch_size: int) -> None:
        """Give the newest chunk its trimmed pages back as ``ids`` (sequence-major, ``missing`` per sequence)."""
        back = torch.tensor(ids, dtype=torch.int64).view(batch_size, -1)
        self.table[:, first_page : self._first[-1]] = ids_on_device(ids, batch_size, self.table.device)
        self._held[-1] = torch.cat([back, self._held[-1]], dim=1)
        self._first[-1] = first_page
        self.refill_due = True


def window_groups(windows: tuple[int | None, ...] | None) -> list[WindowPages]:
    """One WindowPages per distinct window of a store's layers (none where no layer has one)."""
    if windows is None:
        return []
    by_window: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        if window is not None:
            by_window.setdefault(window, []).append(layer)
    return [WindowPages(window, tuple(layers)) for window, layers in sorted(by_window.items())]
