"""Where an offloaded store's pages live in host memory, and which host row holds a page.

The layers kept in host memory (all but the first ``resident`` ones, which stay whole on the device) have pinned
pools, one allocation per kind and group of layers::

    full-attention layers   k, v, dk, dv : [layers, B, max_pages, H_kv, P, D]      page p at row p
    layers of window W      k, v, dk, dv : [layers of W, B, rows_W, H_kv, P, D]    page p at row map_W[p]
    every such layer        mean         : [layers, B, max_pages, H_kv, summary]   page p at row p

The layers that share a sliding window keep, as the device store does (oomb/cache/window_pages.py), only what a
later chunk's window reaches: every chunk's tail and one whole chunk. Every sequence of a step has the same pages,
so one row map per window serves the batch: a ``WindowPages`` of one sequence on the host (its allocator hands out
rows, its block table is the map). Pages a window gave up map to a scratch row, which copies may read and write
(keys no query sees) and nothing reads back. Key summaries stay whole (a page's is 1 / (4 P) of its K, V, dK and
dV bytes), read by page as a sparse layer's selection reads them.

Copies name host rows by an index on the device (oomb/offload/copy.py). The map changes on the host when a chunk
is added or freed; ``rows`` uploads it on the stream that runs the copies (pinned, non-blocking), so no copy waits
for the compute stream, and a copy queued before a change reads the map it was queued with.
"""

from __future__ import annotations

import torch

from oomb.cache import ChunkRecord, OutOfPagesError, PastPages, StoreSpec
from oomb.cache.window_pages import WindowPages, window_groups, window_page_ids
from oomb.offload.copy import copy_pages, pinned_empty
from oomb.offload.slots import KINDS, kind_dim

_CPU = torch.device("cpu")


def _summary_bytes(spec: StoreSpec) -> int:
    """One page's key summary, one layer (K's dtype)."""
    return spec.num_kv_heads * spec.summary_dim() * spec.dtype.itemsize


def _groups(spec: StoreSpec, resident: int) -> tuple[list[int], list[WindowPages]]:
    """(the full-attention layers in host memory, a WindowPages per window of the sliding ones there)."""
    windows = [None if i < resident else spec.window(i) for i in range(spec.num_layers)]
    full = [i for i in range(resident, spec.num_layers) if windows[i] is None]
    return full, window_groups(tuple(windows))


def _window_rows(window: int, spec: StoreSpec, num_tokens: int, chunk_size: int | None) -> int:
    """Host rows per sequence a window's layers take: what the device store's ids are for one sequence."""
    return window_page_ids(window, batch_size=1, num_tokens=num_tokens, page_size=spec.page_size,
                           chunk_size=chunk_size)


class HostPages:
    """The host pools of an offloaded store's layers and the row of each page (module docstring)."""

    def __init__(self, spec: StoreSpec, *, cuda: bool) -> None:
        self.spec = spec
        self._cuda = cuda
        self.resident = 0  # the layers before this one are not here (whole on the device)
        self.batch_size = 0
        self.max_pages = 0
        self.allocated = False  # by ``allocate`` (where every layer stays on the device, nothing is here)
        self._pools: dict[str, torch.Tensor] = {}  # the full-attention layers' K, V, dK, dV
        self._mean: torch.Tensor | None = None  # every layer's key summaries
        self._full: list[int] = []
        self._groups: list[WindowPages] = []
        self._group_pools: list[dict[str, torch.Tensor]] = []
        self._where: dict[int, tuple[int, int]] = {}  # layer -> (group index or -1 for the full layers, its index)
        self._uploaded: dict[int, torch.Tensor] = {}  # group index -> its map on the device, while unchanged

    @property
    def windows(self) -> bool:
        """Whether some layer here keeps only what its window reaches (its rows are freed and given back)."""
        return bool(self._groups)

    @staticmethod
    def bytes_for(spec: StoreSpec, batch_size: int, num_tokens: int, *, chunk_size: int | None,
                  resident: int) -> int:
        """Host bytes of ``allocate(batch_size, num_tokens, chunk_size, resident)``."""
        pages = -(-num_tokens // spec.page_size)
        summary = _summary_bytes(spec)
        page = spec.layer_bytes(1) - summary
        full, groups = _groups(spec, resident)
        kept = len(full) * pages + sum(len(g.layers) * _window_rows(g.window, spec, num_tokens, chunk_size)
                                       for g in groups)
        return batch_size * (kept * page + (spec.num_layers - resident) * pages * summary)

    def fits(self, batch_size: int, num_tokens: int, chunk_size: int | None, resident: int) -> bool:
        """Whether the pools allocated serve such a step (they never shrink: fewer tokens fit)."""
        if not self.allocated or batch_size != self.batch_size or resident != self.resident:
            return False
        if -(-num_tokens // self.spec.page_size) > self.max_pages:
            return False
        return all(_window_rows(g.window, self.spec, num_tokens, chunk_size) <= g.allocator.num_pages
                   for g in self._groups)

    def allocate(self, batch_size: int, num_tokens: int, chunk_size: int | None, resident: int) -> None:
        """New pools for ``batch_size`` sequences of ``num_tokens`` in chunks of ``chunk_size`` (None: any size; the
        windows then keep every page), the layers from ``resident`` on. The old ones are dropped first; ``start``
        begins a step over them."""
        self.release()
        s = self.spec
        max_pages = -(-num_tokens // s.page_size)
        self._full, self._groups = _groups(s, resident)
        if resident < s.num_layers:
            self._mean = self._pinned((s.num_layers - resident, batch_size, max_pages, s.num_kv_heads,
                                       s.summary_dim()), s.dtype)
            if self._full:
                self._pools = self._kinds(len(self._full), batch_size, max_pages)
            for group in self._groups:
                rows = _window_rows(group.window, s, num_tokens, chunk_size)
                self._group_pools.append(self._kinds(len(group.layers), batch_size, rows))
                group.allocator.reset(rows)
        self._where = {layer: (-1, i) for i, layer in enumerate(self._full)}
        for g, group in enumerate(self._groups):
            self._where.update({layer: (g, i) for i, layer in enumerate(group.layers)})
        self.resident, self.batch_size, self.max_pages = resident, batch_size, max_pages
        self.allocated = True

    def release(self) -> None:
        self._pools, self._mean, self._group_pools, self._uploaded = {}, None, [], {}
        self._full, self._groups, self._where = [], [], {}
        self.resident = self.batch_size = self.max_pages = 0
        self.allocated = False

    def nbytes(self) -> int:
        tensors = [*self._pools.values(), *(t for pools in self._group_pools for t in pools.values())]
        if self._mean is not None:
            tensors.append(self._mean)
        return sum(t.numel() * t.element_size() for t in tensors)

    def start(self) -> None:
        """An empty step: every window's rows free but its scratch row, every page mapped to it."""
        for group in self._groups:
            group.start(1, self.max_pages, _CPU)
        self._uploaded = {}

    # ------------------------------------------------------------------ where a page is
    def home(self, kind: str, layer_idx: int) -> torch.Tensor:
        """[B, rows, H_kv, P, D] (mean: [B, max_pages, H_kv, summary]): the layer's pool of ``kind``."""
        if kind == "mean":
            return self._mean[layer_idx - self.resident]
        g, i = self._where[layer_idx]
        return (self._pools if g < 0 else self._group_pools[g])[kind][i]

    def windowed(self, layer_idx: int) -> bool:
        """Whether the layer's pages sit at rows of a window's map (else page p at row p)."""
        return self._where[layer_idx][0] >= 0

    def rows(self, layer_idx: int) -> torch.Tensor:
        """int32 [max_pages]: the host row of each page of a windowed layer, on the store's device. Call it on the
        stream that runs the copies reading it: it is uploaded there after a change (module docstring)."""
        device = self.spec.device
        g = self._where[layer_idx][0]
        if g not in self._uploaded:
            table = self._groups[g].table[0]
            self._uploaded[g] = (table.clone() if device.type != "cuda"
                                 else table.pin_memory().to(device, non_blocking=True))
        return self._uploaded[g]

    def past_rows(self, layer_idx: int, past: PastPages | None, num_past: int) -> torch.Tensor | None:
        """The host rows of a slot's past pages (-1 where a union names none); None where they are rows 0 .. m-1
        (every past page of a layer that keeps every page). On the copy stream (``rows``)."""
        if not self.windowed(layer_idx):
            return None if past is None else past.pages
        rows = self.rows(layer_idx)
        if past is None:
            return rows[:num_past]
        return torch.where(past.pages >= 0, rows[past.pages.clamp(min=0).long()], past.pages)

    def read_past(self, kind: str, layer_idx: int, into: torch.Tensor, rows: torch.Tensor | None,
                  past: PastPages | None, n: int, *, use_kernel: bool, non_blocking: bool) -> None:
        """A slot's past pages, at host ``rows`` (``past_rows``), -> ``into`` [B, slot rows, ...] at the past's slot
        rows (the first ``n`` where ``past`` is None)."""
        home = self.home(kind, layer_idx)
        if rows is None:  # pages 0 .. n-1 at rows 0 .. n-1: one contiguous copy per sequence
            into[:, :n].copy_(home[:, :n], non_blocking=non_blocking)
        else:  # the chosen pages (or a window's), read from the mapped host pool by the copy kernel
            copy_pages(home, into, src_index=rows, dst_index=None if past is None else past.slot_rows,
                       use_kernel=use_kernel)

    def write_past(self, kind: str, layer_idx: int, src: torch.Tensor, rows: torch.Tensor | None,
                   past: PastPages | None, n: int, *, use_kernel: bool, non_blocking: bool) -> None:
        """The inverse of ``read_past``: a slot's past pages (its gradients) home."""
        home = self.home(kind, layer_idx)
        if rows is None:
            home[:, :n].copy_(src[:, :n], non_blocking=non_blocking)
        else:  # scattered into the mapped host pool by the copy kernel
            copy_pages(src[:, :n] if past is None else src, home, src_index=None if past is None else past.slot_rows,
                       dst_index=rows, use_kernel=use_kernel)

    def read_pages(self, kind: str, layer_idx: int, into: torch.Tensor, first: int, row: int, n: int, *,
                   use_kernel: bool, non_blocking: bool) -> None:
        """Pages first .. first+n-1 of the layer's ``kind`` -> rows row .. row+n-1 of ``into`` [B, rows, ...]."""
        home = self.home(kind, layer_idx)
        if not self.windowed(layer_idx):
            into[:, row : row + n].copy_(home[:, first : first + n], non_blocking=non_blocking)
            return
        rows = self.rows(layer_idx)[first : first + n]
        slots = torch.arange(row, row + n, dtype=torch.int32, device=self.spec.device)
        copy_pages(home, into, src_index=rows, dst_index=slots, use_kernel=use_kernel)

    def write_pages(self, kind: str, layer_idx: int, src: torch.Tensor, row: int, first: int, n: int, *,
                    use_kernel: bool, non_blocking: bool) -> None:
        """Rows row .. row+n-1 of ``src`` [B, rows, ...] -> pages first .. first+n-1 of the layer's ``kind``."""
        home = self.home(kind, layer_idx)
        if not self.windowed(layer_idx):
            home[:, first : first + n].copy_(src[:, row : row + n], non_blocking=non_blocking)
            return
        rows = self.rows(layer_idx)[first : first + n]
        slots = torch.arange(row, row + n, dtype=torch.int32, device=self.spec.device)
        copy_pages(src, home, src_index=slots, dst_index=rows, use_kernel=use_kernel)

    def refill_due(self, layer_idx: int) -> bool:
        """Whether the layer's newest chunk got rows back since stage 1 wrote its K/V (they hold none now)."""
        g = self._where.get(layer_idx, (-1, 0))[0]
        return g >= 0 and self._groups[g].refill_due

    # ------------------------------------------------------------------ chunks
    def add_chunk(self, record: ChunkRecord, previous: ChunkRecord | None) -> None:
        """Rows for a new newest chunk, gradient rows zeroed (a host write: no copy may use them in flight); the
        previous chunk keeps of each window only the tail the new one reaches."""
        c0, n = record.first_page, record.num_pages
        for kind in ("dk", "dv"):
            if kind in self._pools:
                self._pools[kind][:, :, c0 : c0 + n].zero_()
        for g, group in enumerate(self._groups):
            if previous is not None:
                group.trim_newest(previous.first_page, previous.end, self.spec.page_size)
            group.add(c0, self._take(g, n), 1)
            self._zero_grads(g, group.table[0, c0 : c0 + n])

    def free_chunk(self, record: ChunkRecord, previous: ChunkRecord | None) -> None:
        """Free the newest chunk's rows; the chunk before it gets back the rows its tail gave up, gradients zeroed
        (a host write, as in ``add_chunk``), K/V to be written again (``refill_due``). (A step's end frees every
        chunk at once, giving none back: ``start``.)"""
        for g, group in enumerate(self._groups):
            group.free_newest(record.first_page, record.num_pages)
            if previous is not None and (missing := group.missing(previous.first_page)):
                group.restore_newest(previous.first_page, self._take(g, missing), 1)
                self._zero_grads(g, group.table[0, previous.first_page : previous.first_page + missing])
            self._uploaded.pop(g, None)

    def _take(self, g: int, n: int) -> list[int]:
        """``n`` rows of window group ``g`` (its map changes: uploaded again when next asked for)."""
        group = self._groups[g]
        self._uploaded.pop(g, None)
        try:
            return group.allocator.allocate(n)
        except OutOfPagesError as e:
            raise RuntimeError(f"the offloaded store's rows for the layers of window {group.window} are used up: "
                               f"reserve() with the chunk size the step appends ({e})") from e

    def _zero_grads(self, g: int, rows: torch.Tensor) -> None:
        for kind in ("dk", "dv"):
            self._group_pools[g][kind].index_fill_(2, rows.long(), 0)

    # ------------------------------------------------------------------ allocation
    def _kinds(self, layers: int, batch_size: int, rows: int) -> dict[str, torch.Tensor]:
        s = self.spec
        return {kind: self._pinned((layers, batch_size, rows, s.num_kv_heads, s.page_size, kind_dim(s, kind)),
                                   s.grad_dtype if kind in ("dk", "dv") else s.dtype) for kind in KINDS}

    def _pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Pinned and mapped, exactly this size (pin_memory=True would round up to a power of two).
        return pinned_empty(shape, dtype) if self._cuda else torch.zeros(shape, dtype=dtype)
