"""The paged store with its pages in host memory and a small working set on the GPU.

K, V and their gradient pages are the only memory that grows with the context. Here
they live in host pools (pinned when CUDA is present), one allocation per kind for all
layers, in sequence order::

    host k, v, dk, dv : [num_layers, B, max_pages, H_kv, page_size, D]     (page p of row b
                                                                          at [layer, b, p])
    mean_k (device)   : [num_layers, B * max_pages, H_kv, D] (K's dtype)  (page selection)
    page_table        : [B, max_pages] int32 = b * max_pages + p          (for mean_k only)

The device holds ``num_slots`` working slots (default 2: the layer being computed and the
next one). A slot holds, for one layer, the pages one kernel call reads, compacted::

    slot k, v, dk, dv : [B * M, H_kv, page_size, D]    M = past pages asked for + chunk pages
    slot table        : [B, max_pages] int32            page p of row b -> its slot row

Dense attention asks for every past page (one contiguous copy per row and kind); sparse
attention for the pages its page lists name (gathered on the host into a pinned staging
buffer, then one copy). Layer l uses slot l % num_slots. Copies run on their own CUDA
stream and are ordered with events:

    compute:  ... kernels(l-1) -[free(l-1)]- kernels(l) ............ kernels(l+1)
    copy:                       wait free(l-1), K/V(l+1) host->slot -[ready(l+1)]-^
                                chunk K/V(l-1) or dK/dV(l-1) slot->host

Without CUDA (tests) every copy is synchronous and the same code runs. Gradients are
bit-identical to the device-resident store: the kernels see the same values in the
same order, only at other addresses.

Debugging: ``OOMB_OFFLOAD_SYNC=1`` (read when a store is built; or set ``store.synchronous``)
synchronises the whole device before and after every copy batch, kernel-facing call and
host-side access of the pinned pools, so nothing overlaps. A result that changes with it is
a stream race; one that does not is a logic error.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

from oomb.cache import ChunkRecord, LayerPools, StoreSpec
from oomb.cache.layout import tiles_to_tokens, tokens_to_tiles
from oomb.cache.store import ChunkLedger, _valid_per_page

_KINDS = ("k", "v", "dk", "dv")
SYNC_ENV = "OOMB_OFFLOAD_SYNC"


def sync_from_env() -> bool:
    """Whether ``OOMB_OFFLOAD_SYNC`` asks for the fully synchronous (debugging) mode."""
    return os.environ.get(SYNC_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass
class _Slot:
    """One layer's working set on the device."""

    pools: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> [capacity, H_kv, P, D]
    table: torch.Tensor | None = None  # [B, max_pages] int32
    key: tuple | None = None  # what the slot holds: (layer, chunk start, past pages id, grads)
    past: torch.Tensor | None = None  # [m] sequence page indices of its past pages (None = 0..m-1)
    num_past: int = 0
    rows: int = 0  # M: pages per sequence in the slot (past + chunk)
    staging: dict[str, torch.Tensor] = field(default_factory=dict)  # pinned host buffers (sparse)
    ready: object = None  # CUDA event: its pages have arrived
    free: object = None  # CUDA event: the kernels reading it are done
    staging_done: object = None  # CUDA event: copies out of / into its staging buffers are done
    pending_scatter: list = field(default_factory=list)  # host writes waiting for staging_done


class OffloadedKVStore(ChunkLedger):
    """Drop-in for ``PagedKVStore`` whose pages live in host memory (see the module docstring)."""

    def __init__(self, spec: StoreSpec, *, num_slots: int = 2) -> None:
        if num_slots < 2:
            raise ValueError(f"offload needs at least 2 device slots (compute one layer, fetch the next), "
                             f"got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        self._cuda = spec.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(spec.device) if self._cuda else None
        self._host: dict[str, torch.Tensor] = {}
        self._mean_k = torch.empty(0, device=spec.device)
        self._slots = [_Slot() for _ in range(num_slots)]
        self._host_written: list = [None] * spec.num_layers  # CUDA event of the last copy into host[layer]
        # CUDA event of the last copy batch that read or wrote the host gradient pools (dk, dv):
        # the host thread zeroes their pages in append_chunk and must not race such a copy.
        self._grad_copies: object = None
        self.synchronous = sync_from_env()  # debugging: no overlap at all (module docstring)
        self._max_pages = 0
        self.batch_size = 0
        self.num_tokens = 0
        self.page_table = torch.zeros((0, 0), dtype=torch.int32, device=spec.device)
        self._chunks: list[ChunkRecord] = []

    # ------------------------------------------------------------------ capacity
    @property
    def num_used_pages(self) -> int:
        return self.batch_size * -(-self.num_tokens // self.spec.page_size)

    def host_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host.values())

    def nbytes(self) -> int:
        """Device bytes held: the slots and the mean keys (the pages themselves are on the host)."""
        slots = sum(t.numel() * t.element_size() for s in self._slots for t in s.pools.values())
        return slots + self._mean_k.numel() * self._mean_k.element_size()

    def reserve(self, batch_size: int, num_tokens: int) -> None:
        """Make room for ``batch_size`` sequences of ``num_tokens`` (host pools grow, never shrink)."""
        self._check_reserve(batch_size, num_tokens)
        s = self.spec
        max_pages = -(-num_tokens // s.page_size)
        if not self._host or batch_size != self.batch_size or max_pages > self._max_pages:
            self._synchronize()
            self._host = {}
            self._mean_k = torch.empty(0, device=s.device)  # drop the old buffers before allocating
            shape = (s.num_layers, batch_size, max_pages, s.num_kv_heads, s.page_size, s.head_dim)
            for kind in _KINDS:
                dtype = s.dtype if kind in ("k", "v") else s.grad_dtype
                self._host[kind] = torch.zeros(shape, dtype=dtype, pin_memory=self._cuda)
            self._mean_k = torch.zeros((s.num_layers, batch_size * max_pages, s.num_kv_heads, s.head_dim),
                                       dtype=s.dtype, device=s.device)
            self._max_pages = max_pages
        self.batch_size = batch_size
        rows = torch.arange(batch_size, device=s.device, dtype=torch.int32).view(-1, 1) * self._max_pages
        self.page_table = rows + torch.arange(self._max_pages, device=s.device, dtype=torch.int32)
        self.num_tokens = 0
        for slot in self._slots:
            slot.key = None

    def release(self) -> None:
        """Free every chunk and all memory, host and device; the store stays usable."""
        self.clear()
        self._synchronize()
        self._host = {}
        self._mean_k = torch.empty(0, device=self.spec.device)
        self._slots = [_Slot() for _ in range(self.num_slots)]
        self._max_pages = 0
        self.batch_size = 0

    # ------------------------------------------------------------------ chunks
    def append_chunk(self, num_tokens: int) -> ChunkRecord:
        first_page, n_pages = self._check_append(num_tokens)
        if first_page + n_pages > self._max_pages:
            raise RuntimeError(f"the store was reserved for {self._max_pages} pages per sequence; "
                               f"reserve() for the whole sequence before appending")
        # Gradient pages start at zero. This is a host-thread write into pinned memory, which
        # stream order does not cover: a copy still in flight on the copy stream that reads or
        # writes the gradient pools (a writeback of a freed chunk's pages, or a fill) must be
        # done first. In the two-stage step none is pending here (stage 1 moves no gradient
        # pages and stage 2 appends before its first backward), so this costs no wait there.
        self._sync()
        self._wait_grad_copies()
        for kind in ("dk", "dv"):
            self._host[kind][:, :, first_page : first_page + n_pages].zero_()
        rows = torch.arange(self.batch_size).repeat_interleave(n_pages) * self._max_pages
        ids = tuple((rows + torch.arange(first_page, first_page + n_pages).repeat(self.batch_size)).tolist())
        record = ChunkRecord(start=self.num_tokens, end=self.num_tokens + num_tokens, first_page=first_page,
                             num_pages=n_pages, page_ids=ids)
        self._chunks.append(record)
        self.num_tokens = record.end
        for slot in self._slots:
            slot.key = None  # a slot's layout includes the newest chunk
        return record

    def free_last_chunk(self) -> None:
        record = self.last_chunk()
        self._chunks.pop()
        self.num_tokens = record.start
        for slot in self._slots:
            slot.key = None

    def clear(self) -> None:
        """Free every chunk (after a step, or after an error inside one); waits for copies in flight."""
        self._synchronize()
        self._chunks.clear()
        self.num_tokens = 0
        for slot in self._slots:
            slot.key = None

    # ------------------------------------------------------------------ working set
    def mean_keys(self, layer_idx: int) -> torch.Tensor:
        return self._mean_k[layer_idx]

    def _slot_of(self, layer_idx: int) -> _Slot:
        return self._slots[layer_idx % self.num_slots]

    def fetch(self, layer_idx: int, past_pages: torch.Tensor | None, *, grads: bool) -> tuple[LayerPools, torch.Tensor]:
        """The slot holding ``past_pages`` (None = all) and the newest chunk of one layer, ready for kernels.

        ``grads``: also their gradient pages, and the chunk's own K/V from the host (backward);
        otherwise the chunk's K/V come from ``write`` (forward).
        """
        slot = self._slot_of(layer_idx)
        key = self._key(layer_idx, past_pages, grads)
        if slot.key != key:
            self._fill(slot, layer_idx, past_pages, grads, key)
        if self._cuda:
            torch.cuda.current_stream(self.spec.device).wait_event(slot.ready)
        self._sync()
        pools = LayerPools(k=slot.pools["k"], v=slot.pools["v"], dk=slot.pools["dk"], dv=slot.pools["dv"],
                           mean_k=self._mean_k[layer_idx])
        return pools, slot.table

    def prefetch(self, layer_idx: int, past_pages: torch.Tensor | None, *, grads: bool) -> None:
        """Start the copies ``fetch`` will need for this layer (into its slot), without waiting."""
        if 0 <= layer_idx < self.spec.num_layers:
            slot = self._slot_of(layer_idx)
            key = self._key(layer_idx, past_pages, grads)
            if slot.key != key:
                self._fill(slot, layer_idx, past_pages, grads, key)

    def writeback(self, layer_idx: int, *, grads: bool) -> None:
        """After this layer's kernels are queued: send the chunk's new K/V (forward) or the updated
        gradient pages of the past (backward) home, and mark the slot reusable once they ran."""
        slot = self._slot_of(layer_idx)
        record = self.last_chunk()
        self._sync()  # debugging mode: the layer's kernels ran before anything is copied home
        compute = torch.cuda.current_stream(self.spec.device) if self._cuda else None
        if self._cuda:
            slot.free = torch.cuda.Event()
            slot.free.record(compute)
        with self._on_copy_stream(wait=slot.free):
            view = {kind: slot.pools[kind][: self.batch_size * slot.rows].view(
                self.batch_size, slot.rows, *slot.pools[kind].shape[1:]) for kind in _KINDS}
            if not grads:
                c0, n = record.first_page, record.num_pages
                for kind in ("k", "v"):
                    self._host[kind][layer_idx, :, c0 : c0 + n].copy_(
                        view[kind][:, slot.num_past : slot.num_past + n], non_blocking=self._cuda)
            elif slot.num_past:
                for kind in ("dk", "dv"):
                    src = view[kind][:, : slot.num_past]
                    if slot.past is None:  # pages 0 .. m-1: one contiguous copy per row
                        self._host[kind][layer_idx, :, : slot.num_past].copy_(src, non_blocking=self._cuda)
                    else:  # through the staging buffer, scattered on the host once the copy is done
                        stage = self._staged(slot, kind, slot.num_past)
                        stage.copy_(src, non_blocking=self._cuda)
                        slot.pending_scatter.append((kind, layer_idx, slot.past.cpu(), stage))
            if self._cuda:
                slot.staging_done = torch.cuda.Event()
                slot.staging_done.record(self._copy_stream)
                self._host_written[layer_idx] = slot.staging_done
                if grads:
                    self._grad_copies = slot.staging_done
        self._sync()
        if not self._cuda:
            self._finish_scatter(slot)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the newest chunk's K/V [B, H_kv, T, D] into the layer's slot (``fetch`` first)."""
        s = self.spec
        record = self._check_write(k, v)
        slot = self._slot_of(layer_idx)
        if slot.key is None or slot.key[0] != layer_idx:
            raise RuntimeError(f"write() for layer {layer_idx} before fetch(): its slot holds another layer")
        n = record.num_pages
        kt, vt = tokens_to_tiles(k, s.page_size), tokens_to_tiles(v, s.page_size)  # [B * n, H, P, D]
        for kind, tiles in (("k", kt), ("v", vt)):
            view = slot.pools[kind][: self.batch_size * slot.rows].view(self.batch_size, slot.rows, *tiles.shape[1:])
            view[:, slot.num_past : slot.num_past + n] = tiles.view(self.batch_size, n, *tiles.shape[1:])
        valid = _valid_per_page(record, s.page_size, k.device)
        # The chunk's mean-key rows, read off the device block table (b * max_pages + p): a tensor
        # built from record.page_ids would be a pageable copy that waits for the queued kernels.
        ids = self.page_table[:, record.first_page : record.first_page + n].reshape(-1).long()
        mean = kt.float().sum(dim=2) / valid.repeat(self.batch_size).view(-1, 1, 1)
        self._mean_k[layer_idx][ids] = mean.to(s.dtype)  # as the device store keeps it
        self._sync()

    def read_grad(self, layer_idx: int, record: ChunkRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest chunk's gradient pages as [B, H_kv, T, D], from its slot (after its backward)."""
        slot = self._slot_of(layer_idx)
        if record != self.last_chunk() or slot.key is None or slot.key[0] != layer_idx or not slot.key[3]:
            raise RuntimeError("read_grad() reads the newest chunk of the layer just fetched with grads=True")
        n, t = record.num_pages, record.end - record.start
        out = []
        for kind in ("dk", "dv"):
            view = slot.pools[kind][: self.batch_size * slot.rows].view(self.batch_size, slot.rows,
                                                                        *slot.pools[kind].shape[1:])
            # A copy, never a view: the slot is refilled for another layer once this layer's kernels ran.
            out.append(tiles_to_tokens(view[:, slot.num_past : slot.num_past + n])[:, :, :t].clone())
        self._sync()
        return out[0], out[1]

    # ------------------------------------------------------------------ internals
    def _key(self, layer_idx, past_pages, grads):
        past_id = None if past_pages is None else (past_pages.data_ptr(), past_pages.numel())
        return (layer_idx, self.last_chunk().start, past_id, grads)

    def _fill(self, slot: _Slot, layer_idx: int, past_pages: torch.Tensor | None, grads: bool, key) -> None:
        s = self.spec
        record = self.last_chunk()
        b = self.batch_size
        if past_pages is None:
            num_past, past_cpu = record.first_page, None
        else:
            past_cpu = past_pages.to("cpu", torch.long)
            num_past = past_cpu.numel()
        rows = num_past + record.num_pages
        self._sync()  # debugging mode: every queued kernel and copy ran before the host touches anything
        # Gradient pages still waiting in this slot's staging buffer go home first: the copies
        # below may read them (and the staging buffer is about to be reused).
        self._finish_scatter(slot)
        if past_cpu is not None and self._cuda:
            # The host is read on this thread (gather into staging): copies still writing it, or still
            # reading the staging buffers, must be done first.
            for event in (self._host_written[layer_idx], slot.staging_done):
                if event is not None:
                    event.synchronize()
        self._ensure_capacity(slot, b * rows, num_past if past_cpu is not None else 0)
        # The slot's table: page p of row b -> b * rows + its index in the slot. Built on the device:
        # a host-built table would be a pageable copy, which waits for the queued kernels.
        dev = s.device
        table = torch.zeros((b, self._max_pages), dtype=torch.int32, device=dev)
        base = (torch.arange(b, dtype=torch.int32, device=dev) * rows).view(-1, 1)
        past_idx = torch.arange(num_past, device=dev) if past_pages is None else past_pages.to(dev, torch.long)
        table[:, past_idx] = base + torch.arange(num_past, dtype=torch.int32, device=dev)
        table[:, record.first_page : record.first_page + record.num_pages] = (
            base + num_past + torch.arange(record.num_pages, dtype=torch.int32, device=dev))
        slot.table = table
        slot.key, slot.past, slot.num_past, slot.rows = key, past_cpu, num_past, rows

        kinds = _KINDS if grads else ("k", "v")
        with self._on_copy_stream(wait=slot.free):
            for kind in kinds:
                view = slot.pools[kind][: b * rows].view(b, rows, *slot.pools[kind].shape[1:])
                host = self._host[kind][layer_idx]  # [B, max_pages, H, P, D]
                if num_past:
                    if past_cpu is None:
                        view[:, :num_past].copy_(host[:, :num_past], non_blocking=self._cuda)
                    else:
                        stage = self._staged(slot, kind, num_past)
                        torch.index_select(host, 1, past_cpu, out=stage)
                        view[:, :num_past].copy_(stage, non_blocking=self._cuda)
                if grads:  # the chunk's own pages too (K/V were written home by the forward)
                    c0, n = record.first_page, record.num_pages
                    view[:, num_past:].copy_(host[:, c0 : c0 + n], non_blocking=self._cuda)
            if self._cuda:
                slot.ready = torch.cuda.Event()
                slot.ready.record(self._copy_stream)
                slot.staging_done = slot.ready
                if grads:
                    self._grad_copies = slot.ready
        self._sync()

    def _ensure_capacity(self, slot: _Slot, pages: int, staged: int) -> None:
        s = self.spec
        have = slot.pools["k"].shape[0] if slot.pools else 0
        if pages > have:
            self._synchronize()  # the old slot may still be read or written
            if self._cuda:
                torch.cuda.current_stream(s.device).synchronize()
            new = max(pages, have * 5 // 4)
            slot.pools = {}
            for kind in _KINDS:
                dtype = s.dtype if kind in ("k", "v") else s.grad_dtype
                slot.pools[kind] = torch.zeros((new, s.num_kv_heads, s.page_size, s.head_dim), dtype=dtype,
                                               device=s.device)
            if self._cuda:
                # The zero fill above is queued on the compute stream, but the copies that fill
                # the new pools run on the copy stream after waiting only ``slot.free``, an event
                # of the old pools (already passed): without this event the fill could land after
                # (on top of) the copied pages. _fill's copies wait ``slot.free``: make it this.
                slot.free = torch.cuda.Event()
                slot.free.record(torch.cuda.current_stream(s.device))
        have_staged = slot.staging["k"].shape[0] if slot.staging else 0
        if self.batch_size * staged > have_staged:
            self._synchronize()
            new = max(self.batch_size * staged, have_staged * 5 // 4)
            slot.staging = {}
            for kind in _KINDS:
                dtype = s.dtype if kind in ("k", "v") else s.grad_dtype
                slot.staging[kind] = torch.zeros((new, s.num_kv_heads, s.page_size, s.head_dim),
                                                 dtype=dtype, pin_memory=self._cuda)

    def _staged(self, slot: _Slot, kind: str, pages: int) -> torch.Tensor:
        """A contiguous [B, pages, H_kv, P, D] view of the slot's pinned staging buffer."""
        buf = slot.staging[kind]
        return buf[: self.batch_size * pages].view(self.batch_size, pages, *buf.shape[1:])

    def _finish_scatter(self, slot: _Slot) -> None:
        """Complete the host-side scatter of gradient pages copied out through the slot's staging."""
        if not slot.pending_scatter:
            return
        if self._cuda and slot.staging_done is not None:
            slot.staging_done.synchronize()
        self._sync()
        for kind, layer_idx, past_cpu, stage in slot.pending_scatter:
            self._host[kind][layer_idx].index_copy_(1, past_cpu, stage)
        slot.pending_scatter.clear()

    def _sync(self) -> None:
        """Debugging mode (``synchronous``): wait for all work of the device, every stream."""
        if self.synchronous and self._cuda:
            torch.cuda.synchronize(self.spec.device)

    def _wait_grad_copies(self) -> None:
        """Block the host until no copy that reads or writes the host gradient pools is in flight."""
        if self._grad_copies is not None:
            self._grad_copies.synchronize()
            self._grad_copies = None

    def _synchronize(self) -> None:
        if self._cuda and self._copy_stream is not None:
            self._copy_stream.synchronize()
            self._grad_copies = None
        for slot in self._slots:
            self._finish_scatter(slot)

    def _on_copy_stream(self, wait):
        """Context: run copies on the copy stream after ``wait`` (an event of the compute stream)."""
        if not self._cuda:
            return contextlib.nullcontext()
        if wait is not None:
            self._copy_stream.wait_event(wait)
        return torch.cuda.stream(self._copy_stream)
