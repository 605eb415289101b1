"""The paged store with its pages in host memory and a small working set on the GPU.

K, V and their gradient pages are the only memory that grows with the context. Here they live in pinned host
pools, in sequence order (page p of sequence b at [layer, b, p]); a sliding layer's at the rows of what its window
reaches (oomb/offload/host_pages.py). The store's ``page_table`` [B, max_pages] = b * max_pages + p indexes the
mean keys.

A layer's mean keys (what sparse attention chooses pages by) come to its slot before its selection runs
(``mean_keys``; prefetched with ``prefetch_mean_keys`` while the previous layer computes), so nothing on
the device grows with the context but the page tables.

With a GPU allowance (``gpu_bytes``, 0 by default) the first layers whose pages fit in it stay whole on
the device (``resident_layers``, laid out as the host pools; no copies at all), and only the others go
through the slots: PCIe traffic and host memory shrink by the share of layers kept.

The device holds ``num_slots`` working slots (default 2: the layer being computed and the
next one). A slot holds, for one layer, the pages one kernel call reads, compacted::

    slot k, v, dk, dv : [B * M + 1, H_kv, page_size, D]    M = past pages asked for + chunk pages
    slot table        : [B, max_pages] int32                page p of row b -> its slot row

Every page the slot holds has a row of its own; the pages it does not hold all go to the row after those
(``B * M``), which no copy reads back. A kernel may gather from it (a page-sparse call's padding keys, which no
query sees) and add their zero gradients to it, as over the device store's table.

Dense attention asks for every past page (one contiguous copy per row and kind); sparse attention for the pages
its page lists name, gathered by a kernel that reads the mapped host pools directly (oomb/offload/copy.py: the
page list stays on the GPU, the host never waits). Layer l uses slot l % num_slots. Copies run on their own CUDA
stream and are ordered with events:

    compute:  ... kernels(l-1) -[free(l-1)]- kernels(l) ............ kernels(l+1)
    copy:                       wait free(l-1), K/V(l+1) host->slot -[ready(l+1)]-^
                                chunk K/V(l-1) or dK/dV(l-1) slot->host

A page list made on the compute stream (a sparse layer's selection in stage 1, a window's range) is read by the copy
kernel on the copy stream: the copy stream first waits for the compute stream's point where the list was handed over,
and the list's memory is kept from reuse until the copies that read it ran (``PastPages.hand_to_stream``,
oomb/cache/page_lists.py). A slot remembers which list it holds by the list's serial, never by its address.

Without CUDA (tests) every copy is synchronous and the same code runs. Gradients are bit-identical to the
device-resident store: the kernels see the same values in the same order, only at other addresses.

Debugging: ``OOMB_OFFLOAD_SYNC=1`` runs every copy with nothing overlapping (oomb/offload/copy.py).
"""

from __future__ import annotations

import contextlib

import torch

from oomb.cache import ChunkRecord, LayerPools, PastPages, StoreSpec
from oomb.cache.layout import tiles_to_tokens, tokens_to_tiles
from oomb.cache.store import ChunkLedger, page_key_summary
from oomb.offload.copy import sync_from_env
from oomb.offload.host_pages import HostPages
from oomb.offload.sizes import store_bytes
from oomb.offload.slots import KINDS, DeviceSlot, kind_dim, resident_layers


class OffloadedKVStore(ChunkLedger):
    """A ``KVStore`` (as ``PagedKVStore``) whose pages live in host memory (see the module docstring)."""

    def __init__(self, spec: StoreSpec, *, num_slots: int = 2, gpu_bytes: int = 0) -> None:
        if num_slots < 2:
            raise ValueError(f"offload needs at least 2 device slots (compute one layer, fetch the next), "
                             f"got {num_slots}")
        if not spec.gradients:  # a forward-only pass offloads a training step's store
            raise ValueError("the offloaded store keeps gradient pages: give it a StoreSpec with gradients=True")
        self.spec = spec
        spec.shape  # noqa: B018 -- raises where layers differ in shape: one allocation per kind holds every layer
        self.num_slots = num_slots
        if gpu_bytes < 0:
            raise ValueError(f"gpu_bytes must be >= 0, got {gpu_bytes}")
        self.gpu_bytes = gpu_bytes  # device allowance for whole layers' pages, applied by reserve()
        self.resident_layers = 0  # layers 0 .. resident_layers-1 live on the device
        # Bytes copied between host and device since the last reserve() (one step), in all and per layer (``_moved``).
        self.moved_bytes, self.moved_bytes_by_layer = {"to_device": 0, "to_host": 0}, {}
        self._dev: dict[str, torch.Tensor] = {}  # kind -> [resident_layers, B, max_pages, H_kv, P, D] (mean: no P)
        self._cuda = spec.device.type == "cuda"
        # High priority: the copy kernel (sparse pages) needs multiprocessors; at normal priority its blocks queue
        # behind a running matrix product's and the next layer finds its pages late (measured on the H200 at
        # normal priority: +16% on a sparse 128K step; the priority itself not yet: docs/offload.md).
        self._copy_stream = torch.cuda.Stream(spec.device, priority=-1) if self._cuda else None
        self._host = HostPages(spec, cuda=self._cuda)  # pinned pools, and the host row of each page
        self._slots = [DeviceSlot() for _ in range(num_slots)]
        # Chosen pages move through the page-copy kernel (mapped host memory) on CUDA; without CUDA
        # through torch indexing. Tests set this True on CPU to run the kernel in Triton's interpreter.
        self.copy_kernels = self._cuda
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
        return self._host.nbytes()

    def nbytes(self) -> int:
        """Device bytes held: resident layers and the slots (the other layers' pages are on the host)."""
        slots = sum(t.numel() * t.element_size() for s in self._slots
                    for t in (*s.pools.values(), *([s.mean] if s.mean is not None else [])))
        resident = sum(t.numel() * t.element_size() for t in self._dev.values())
        return resident + slots

    bytes_for = staticmethod(store_bytes)  # what a step holds, host and device (oomb/offload/sizes.py)

    def layer_nbytes(self, batch_size: int, num_tokens: int) -> int:
        """Bytes of one layer's K, V, dK, dV pages and mean keys for ``batch_size`` sequences of ``num_tokens``."""
        return self.spec.layer_bytes(batch_size * -(-num_tokens // self.spec.page_size))

    def _resident(self, layer_idx: int) -> bool:
        return layer_idx < self.resident_layers

    def needs_page_list(self, layer_idx: int) -> bool:
        """Layers in host memory move only the pages a sparse layer reads; resident ones move none."""
        return not self._resident(layer_idx)

    def reserve(self, batch_size: int, num_tokens: int, chunk_size: int | None = None) -> None:
        """Make room for ``batch_size`` sequences of ``num_tokens`` in chunks of ``chunk_size`` (host pools grow,
        never shrink; every page kept but what sliding windows no longer reach)."""
        self._check_reserve(batch_size, num_tokens)
        s = self.spec
        max_pages = -(-num_tokens // s.page_size)
        resident = resident_layers(s, batch_size, max_pages, self.gpu_bytes)
        if not self._host.fits(batch_size, num_tokens, chunk_size, resident):  # the device's layers too
            self._synchronize()
            self._host.release()  # drop the old buffers before allocating
            self._dev = {}
            for slot in self._slots:
                slot.mean = None
            for kind in (*KINDS, "mean") if resident else ():
                dtype = s.grad_dtype if kind in ("dk", "dv") else s.dtype
                shape = ((batch_size, max_pages, s.num_kv_heads, s.page_size, kind_dim(s, kind)) if kind != "mean"
                         else (batch_size, max_pages, s.num_kv_heads, s.summary_dim()))
                self._dev[kind] = torch.zeros((resident, *shape), dtype=dtype, device=s.device)
            self._host.allocate(batch_size, num_tokens, chunk_size, resident)
            self._max_pages = max_pages
            self.resident_layers = resident
        self._host.start()
        self.batch_size = batch_size
        rows = torch.arange(batch_size, device=s.device, dtype=torch.int32).view(-1, 1) * self._max_pages
        self.page_table = rows + torch.arange(self._max_pages, device=s.device, dtype=torch.int32)
        self.num_tokens = 0
        self.moved_bytes, self.moved_bytes_by_layer = {"to_device": 0, "to_host": 0}, {}
        for slot in self._slots:
            slot.key = slot.mean_key = None

    def release(self) -> None:
        """Free every chunk and all memory, host and device; the store stays usable."""
        self.clear()
        self._synchronize()
        self._host.release()
        self._dev = {}
        self._slots = [DeviceSlot() for _ in range(self.num_slots)]
        self.resident_layers = 0
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
        rows = torch.arange(self.batch_size).repeat_interleave(n_pages) * self._max_pages
        ids = tuple((rows + torch.arange(first_page, first_page + n_pages).repeat(self.batch_size)).tolist())
        record = ChunkRecord(start=self.num_tokens, end=self.num_tokens + num_tokens, first_page=first_page,
                             num_pages=n_pages, page_ids=ids)
        self._host.add_chunk(record, self._chunks[-1] if self._chunks else None)
        for kind in ("dk", "dv"):
            if kind in self._dev:  # on the device: ordered by the stream
                self._dev[kind][:, :, first_page : first_page + n_pages].zero_()
        self._chunks.append(record)
        self.num_tokens = record.end
        for slot in self._slots:
            slot.key = None  # a slot's layout includes the newest chunk
        return record

    def free_last_chunk(self) -> None:
        """Free the newest chunk; the chunk before it gets back the host rows its windows gave up (gradients
        zeroed by the host thread: the copies that read the freed rows are waited for first)."""
        record = self.last_chunk()
        self._chunks.pop()
        self.num_tokens = record.start
        if self._host.windows:
            self._sync()
            self._wait_grad_copies()
        self._host.free_chunk(record, self._chunks[-1] if self._chunks else None)
        for slot in self._slots:
            slot.key = None

    def clear(self) -> None:
        """Free every chunk (after a step, or after an error inside one); waits for copies in flight."""
        self._synchronize()
        self._chunks.clear()
        self._host.start()
        self.num_tokens = 0
        for slot in self._slots:
            slot.key = None

    # ------------------------------------------------------------------ working set
    def mean_keys(self, layer_idx: int) -> torch.Tensor:
        """[B * max_pages, H_kv, D]: the layer's per-page mean keys of the newest chunk's past, on the device."""
        if self._resident(layer_idx):
            return self._dev["mean"][layer_idx].flatten(0, 1)
        slot = self._slot_of(layer_idx)
        self.prefetch_mean_keys(layer_idx)
        if self._cuda:
            torch.cuda.current_stream(self.spec.device).wait_event(slot.mean_ready)
        self._sync()
        return slot.mean.flatten(0, 1)

    def prefetch_mean_keys(self, layer_idx: int) -> None:
        """Start copying the layer's mean keys of the newest chunk's past into its slot (for its selection)."""
        if not self.resident_layers <= layer_idx < self.spec.num_layers:
            return
        slot = self._slot_of(layer_idx)
        record = self.last_chunk()
        key = (layer_idx, record.start)
        if slot.mean_key == key:
            return
        self._sync()
        self._ensure_mean(slot)
        n = record.first_page
        self._moved(layer_idx, "to_device", slot.mean[:, :n].numel() * slot.mean.element_size())
        with self._on_copy_stream(wait=slot.free):
            slot.mean[:, :n].copy_(self._host.home("mean", layer_idx)[:, :n], non_blocking=self._cuda)
            if self._cuda:
                slot.mean_ready = torch.cuda.Event()
                slot.mean_ready.record(self._copy_stream)
        slot.mean_key = key
        self._sync()

    def _slot_of(self, layer_idx: int) -> DeviceSlot:
        return self._slots[layer_idx % self.num_slots]

    def fetch(self, layer_idx: int, past_pages: PastPages | None, *, grads: bool) -> tuple[LayerPools, torch.Tensor]:
        """The slot holding ``past_pages`` (None = all) and the newest chunk of one layer, ready for kernels.

        ``grads``: also their gradient pages, and the chunk's own K/V from the host (backward);
        otherwise the chunk's K/V come from ``write`` (forward).
        """
        if self._resident(layer_idx):  # laid out as the block table says: no slot, no copy
            pools = self._dev_pools(layer_idx)
            return LayerPools(**pools, mean_k=self._dev["mean"][layer_idx].flatten(0, 1)), self.page_table
        slot = self._slot_of(layer_idx)
        self._ensure_mean(slot)
        key = self._key(layer_idx, past_pages, grads)
        if slot.key != key:
            self._fill(slot, layer_idx, past_pages, grads, key)
        if self._cuda:
            torch.cuda.current_stream(self.spec.device).wait_event(slot.ready)
        self._sync()
        pools = LayerPools(k=slot.pools["k"], v=slot.pools["v"], dk=slot.pools["dk"], dv=slot.pools["dv"],
                           mean_k=slot.mean.flatten(0, 1))  # the layer's only after mean_keys()
        return pools, slot.table

    def prefetch(self, layer_idx: int, past_pages: PastPages | None, *, grads: bool) -> None:
        """Start the copies ``fetch`` will need for this layer (into its slot), without waiting."""
        if self.resident_layers <= layer_idx < self.spec.num_layers:
            slot = self._slot_of(layer_idx)
            key = self._key(layer_idx, past_pages, grads)
            if slot.key != key:
                self._fill(slot, layer_idx, past_pages, grads, key)

    def writeback(self, layer_idx: int, *, grads: bool) -> None:
        """After this layer's kernels are queued: send the chunk's new K/V (forward) or the updated
        gradient pages of the past (backward) home, and mark the slot reusable once they ran."""
        if self._resident(layer_idx):
            return  # its pages are home already
        slot = self._slot_of(layer_idx)
        record = self.last_chunk()
        self._sync()  # debugging mode: the layer's kernels ran before anything is copied home
        compute = torch.cuda.current_stream(self.spec.device) if self._cuda else None
        if self._cuda:
            slot.free = torch.cuda.Event()
            slot.free.record(compute)
        with self._on_copy_stream(wait=slot.free):
            view = {kind: slot.pools[kind][: self.batch_size * slot.rows].view(
                self.batch_size, slot.rows, *slot.pools[kind].shape[1:]) for kind in KINDS}
            page = self._page_nbytes()
            if not grads:
                c0, n = record.first_page, record.num_pages
                self._moved(layer_idx, "to_host", 2 * self.batch_size * n * page)
                for kind in ("k", "v"):
                    self._host.write_pages(kind, layer_idx, view[kind], slot.num_past, c0, n, **self._copy_args())
                self._host.home("mean", layer_idx)[:, c0 : c0 + n].copy_(slot.mean[:, c0 : c0 + n],
                                                                          non_blocking=self._cuda)
            elif slot.num_past:
                if slot.past is not None and self._cuda:
                    slot.past.hand_to_stream(self._copy_stream)
                self._moved(layer_idx, "to_host", 2 * self.batch_size * slot.num_past * page)
                past_rows = self._host.past_rows(layer_idx, slot.past, slot.num_past)
                for kind in ("dk", "dv"):
                    self._host.write_past(kind, layer_idx, view[kind], past_rows, slot.past, slot.num_past,
                                          **self._copy_args())
            if self._cuda and grads:
                done = torch.cuda.Event()
                done.record(self._copy_stream)
                self._grad_copies = done
        self._sync()

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the newest chunk's K/V [B, H_kv, T, D] into the layer's slot (``fetch`` first)."""
        s = self.spec
        record = self._check_write(layer_idx, k, v)
        n = record.num_pages
        kt, vt = tokens_to_tiles(k, s.page_size), tokens_to_tiles(v, s.page_size)  # [B * n, H, P, D]
        for kind, tiles in (("k", kt), ("v", vt)):
            view, first = self._chunk_rows(layer_idx, kind, record, "write()")
            view[:, first : first + n] = tiles.view(self.batch_size, n, *tiles.shape[1:])
        valid = record.ragged_slots(s.page_size, k.device, self.batch_size)
        mean = page_key_summary(kt, valid, s.key_summary)  # as the device store keeps it
        if self._resident(layer_idx):
            means = self._dev["mean"][layer_idx]
        else:  # into the slot (sent home by writeback); its other rows may belong to another layer
            slot = self._slot_of(layer_idx)
            self._ensure_mean(slot)
            means = slot.mean
            if slot.mean_key != (layer_idx, record.start):
                slot.mean_key = None
        c0 = record.first_page
        means[:, c0 : c0 + n] = mean.to(s.dtype).view(self.batch_size, n, *mean.shape[1:])
        self._sync()

    def refill(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The newest chunk's K/V again where its sliding layer got rows back since stage 1 wrote them: home, and
        into the layer's slot where it was filled from those rows already (prefetched by the next layer's backward)."""
        if self._resident(layer_idx) or not self._host.refill_due(layer_idx):
            return
        s = self.spec
        record = self._check_write(layer_idx, k, v)
        slot = self._slot_of(layer_idx)
        if slot.key is not None and slot.key[:2] == (layer_idx, record.start):
            if self._cuda:  # its copies have landed before the chunk's rows are overwritten
                torch.cuda.current_stream(s.device).wait_event(slot.ready)
            self.write(layer_idx, k, v)
        b, n = self.batch_size, record.num_pages
        # [B * n, H_kv, P, D], whole pages in a row (the copy kernel's layout)
        tiles = {kind: tokens_to_tiles(t, s.page_size).contiguous() for kind, t in (("k", k), ("v", v))}
        made = None
        if self._cuda:
            made = torch.cuda.Event()
            made.record(torch.cuda.current_stream(s.device))
            for t in tiles.values():
                t.record_stream(self._copy_stream)  # kept from reuse until the copy ran
        self._moved(layer_idx, "to_host", 2 * b * n * self._page_nbytes())
        with self._on_copy_stream(wait=made):
            for kind, t in tiles.items():
                self._host.write_pages(kind, layer_idx, t.view(b, n, *t.shape[1:]), 0, record.first_page, n,
                                       **self._copy_args())
        self._sync()

    def read_grad(self, layer_idx: int, record: ChunkRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest chunk's gradient pages as [B, H_kv, T, D], from its slot (after its backward)."""
        slot = self._slot_of(layer_idx)
        if record != self.last_chunk() or not self._resident(layer_idx) and (
                slot.key is None or slot.key[0] != layer_idx or not slot.key[3]):
            raise RuntimeError("read_grad() reads the newest chunk of the layer just fetched with grads=True")
        n, t = record.num_pages, record.end - record.start
        out = []
        for kind in ("dk", "dv"):
            view, first = self._chunk_rows(layer_idx, kind, record, "read_grad()")
            # A copy, never a view: the slot is refilled for another layer once this layer's kernels ran.
            out.append(tiles_to_tokens(view[:, first : first + n])[:, :, :t].clone())
        self._sync()
        return out[0], out[1]

    # ------------------------------------------------------------------ internals
    def _ensure_mean(self, slot: DeviceSlot) -> None:
        """Give the slot a mean-key buffer of the reserved shape."""
        s = self.spec
        slot.ensure_mean(s, (self.batch_size, self._max_pages, s.num_kv_heads, s.summary_dim()), self._synchronize)

    def _page_nbytes(self) -> int:
        """Bytes of one page of one kind of one layer: the mean of K's and V's (gradients counted at that size)."""
        s = self.spec
        return s.num_kv_heads * s.page_size * (s.shape.key_dim + s.shape.value_dim) // 2 * s.dtype.itemsize

    def _moved(self, layer_idx: int, direction: str, nbytes: int) -> None:
        """Count a copy: the step's PCIe traffic (docs/offload.md), per layer too (a sliding layer's: its window's)."""
        self.moved_bytes[direction] += nbytes
        self.moved_bytes_by_layer.setdefault(layer_idx, {"to_device": 0, "to_host": 0})[direction] += nbytes

    def _dev_pools(self, layer_idx: int) -> dict[str, torch.Tensor]:
        s = self.spec
        return {kind: self._dev[kind][layer_idx].view(-1, s.num_kv_heads, s.page_size, kind_dim(s, kind))
                for kind in KINDS}

    def _chunk_rows(self, layer_idx: int, kind: str, record: ChunkRecord, what: str) -> tuple[torch.Tensor, int]:
        """([B, rows, H_kv, P, D] view holding the layer's newest chunk, index of its first page there)."""
        if self._resident(layer_idx):
            return self._dev[kind][layer_idx], record.first_page
        slot = self._slot_of(layer_idx)
        if slot.key is None or slot.key[0] != layer_idx:
            raise RuntimeError(f"{what} for layer {layer_idx} before fetch(): its slot holds another layer")
        pool = slot.pools[kind]
        return pool[: self.batch_size * slot.rows].view(self.batch_size, slot.rows, *pool.shape[1:]), slot.num_past

    def _key(self, layer_idx: int, past_pages: PastPages | None, grads: bool) -> tuple:
        """What a slot filled for these arguments holds. A list is known by its serial, not its address:
        freed memory is reused, and a new list at an old one's address would find the old pages."""
        if past_pages is not None:
            if not isinstance(past_pages, PastPages):
                raise TypeError(f"past_pages must be an oomb.cache.PastPages (PastPages(pages_tensor)) or None, "
                                f"got {type(past_pages).__name__}")
            if past_pages.pages.device != self.page_table.device:
                raise ValueError(f"the past pages are on {past_pages.pages.device}, the store on "
                                 f"{self.page_table.device}: make the list on the store's device")
        return (layer_idx, self.last_chunk().start, None if past_pages is None else past_pages.serial, grads)

    def _fill(self, slot: DeviceSlot, layer_idx: int, past_pages: PastPages | None, grads: bool, key) -> None:
        s = self.spec
        record = self.last_chunk()
        b = self.batch_size
        num_past = record.first_page if past_pages is None else past_pages.num_rows
        rows = num_past + record.num_pages
        self._sync()  # debugging mode: every queued kernel and copy ran before the host touches anything
        unfetched = b * rows  # the row of every page the slot does not hold (module docstring)
        slot.ensure_capacity(s, unfetched + 1, self._synchronize)
        # The slot's table: page p of row b -> b * rows + its index in the slot. Built on the device:
        # a host-built table would be a pageable copy, which waits for the queued kernels.
        dev = s.device
        table = torch.full((b, self._max_pages), unfetched, dtype=torch.int32, device=dev)
        base = (torch.arange(b, dtype=torch.int32, device=dev) * rows).view(-1, 1)
        if past_pages is None:
            table[:, :num_past] = base + torch.arange(num_past, dtype=torch.int32, device=dev)
        else:
            past_idx, past_rows = past_pages.table_rows()
            table[:, past_idx] = torch.where(past_rows >= 0, base + past_rows, unfetched)
        table[:, record.first_page : record.first_page + record.num_pages] = (
            base + num_past + torch.arange(record.num_pages, dtype=torch.int32, device=dev))
        slot.table = table
        slot.past = past_pages
        slot.key, slot.num_past, slot.rows = key, num_past, rows

        kinds = KINDS if grads else ("k", "v")
        pages = num_past + (record.num_pages if grads else 0)  # the chunk's own gradient pages come too
        self._moved(layer_idx, "to_device", len(kinds) * b * pages * self._page_nbytes())
        if slot.past is not None and self._cuda:
            slot.past.hand_to_stream(self._copy_stream)  # before the copies below read it
        with self._on_copy_stream(wait=slot.free):
            past_rows = self._host.past_rows(layer_idx, past_pages, num_past) if num_past else None
            for kind in kinds:
                view = slot.pools[kind][: b * rows].view(b, rows, *slot.pools[kind].shape[1:])
                if num_past:
                    self._host.read_past(kind, layer_idx, view, past_rows, past_pages, num_past, **self._copy_args())
                if grads:  # the chunk's own pages too (K/V were written home by the forward)
                    self._host.read_pages(kind, layer_idx, view, record.first_page, num_past, record.num_pages,
                                          **self._copy_args())
            if self._cuda:
                slot.ready = torch.cuda.Event()
                slot.ready.record(self._copy_stream)
                if grads:
                    self._grad_copies = slot.ready
        self._sync()

    def _copy_args(self) -> dict:
        return {"use_kernel": self.copy_kernels, "non_blocking": self._cuda}

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

    def _on_copy_stream(self, wait):
        """Context: run copies on the copy stream after ``wait`` (an event of the compute stream)."""
        if not self._cuda:
            return contextlib.nullcontext()
        if wait is not None:
            self._copy_stream.wait_event(wait)
        return torch.cuda.stream(self._copy_stream)
