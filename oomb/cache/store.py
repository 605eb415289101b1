"""The paged K/V store: per layer, K and V pages and their gradient pages.

Layout (one set of pools per attention layer, page ids shared by all full-attention layers)::

    k_pool, dk_pool                  : [num_pages, H_kv, page_size, D_k]
    v_pool, dv_pool                  : [num_pages, H_kv, page_size, D_v]  (D_v = D_k but for latent attention)
    mean_k                           : [num_pages, H_kv, summary_dim]  (the K dtype; the mean key,
                                       then per-channel min and max with key_summary="bounds")
    page_table                       : [B, max_pages]        int32 (block table)

    sequence b, absolute position p  ->  page_table[b, p // page_size], slot p % page_size

    chunk 0            chunk 1            chunk 2 (last, ragged)
    |page|page|page|   |page|page|page|   |page|pa..|        <- per sequence
     0    1    2        3    4    5        6    7 (padded; slots past the end are zero)

A [H_kv, page_size, D] tile of one page and head is contiguous, so a kernel reads it
with one strided load. Chunks are appended at the end and freed newest first, which
is exactly the order of the two-stage step (stage 1 appends, stage 2 frees in reverse).
Gradient pages are zeroed when a chunk is allocated; attention backward adds into them.

Memory per token (all layers) = sum over layers of H_kv * (D_k + D_v) * (itemsize + grad_itemsize).
Each layer has its own pools, so layers may differ in shape (``StoreSpec.layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oomb.cache.allocator import OutOfPagesError, PageAllocator
from oomb.cache.layout import tiles_to_tokens, tokens_to_tiles
from oomb.cache.past_pages import PastPages
from oomb.cache.spec import StoreBytes, StoreSpec, page_key_summary
from oomb.cache.window_pages import ids_on_device, window_groups, window_page_ids


@dataclass
class LayerPools:
    """The tensors of one layer; kernels see only these, a page table and lengths."""

    k: torch.Tensor  # [num_pages, H_kv, page_size, D_k]
    v: torch.Tensor  # [num_pages, H_kv, page_size, D_v]
    dk: torch.Tensor  # [num_pages, H_kv, page_size, D_k], grad_dtype
    dv: torch.Tensor  # [num_pages, H_kv, page_size, D_v], grad_dtype
    mean_k: torch.Tensor  # [num_pages, H_kv, summary_dim]: page_key_summary (fp32 sums, stored in K's dtype)


@dataclass(frozen=True)
class ChunkRecord:
    """Where one appended chunk lives: tokens [start, end) of every sequence."""

    start: int
    end: int
    first_page: int  # index into the page table's columns
    num_pages: int
    page_ids: tuple[int, ...]  # B * num_pages ids, sequence-major

    def ragged_slots(self, page_size: int, device: torch.device, batch_size: int = 1) -> torch.Tensor | None:
        """Number of real (non-padding) tokens in each page of the chunk, float32 [batch_size * num_pages] (the
        same for every sequence), where the chunk ends inside its last page; None where every slot holds one."""
        if self.end - self.start == self.num_pages * page_size:
            return None
        valid = torch.full((self.num_pages,), float(page_size), device=device)
        # fill_ passes the number as a kernel argument (an element assignment may go through a
        # host-to-device copy instead; this runs once per layer and chunk).
        valid[-1:].fill_(self.end - self.start - (self.num_pages - 1) * page_size)
        return valid.repeat(batch_size)


class ChunkLedger:
    """The chunk bookkeeping every store shares: chunks appended at the end, freed newest first."""

    spec: StoreSpec
    batch_size: int
    num_tokens: int
    _chunks: list[ChunkRecord]

    @property
    def chunks(self) -> tuple[ChunkRecord, ...]:
        return tuple(self._chunks)

    def last_chunk(self) -> ChunkRecord:
        if not self._chunks:
            raise RuntimeError("the store holds no chunk")
        return self._chunks[-1]

    def _check_reserve(self, batch_size: int, num_tokens: int) -> None:
        if self._chunks:
            raise RuntimeError("reserve() needs an empty store: free the previous step's chunks first")
        if batch_size <= 0 or num_tokens <= 0:
            raise ValueError(f"batch_size and num_tokens must be positive, got {batch_size}, {num_tokens}")

    def _check_append(self, num_tokens: int) -> tuple[int, int]:
        """(first page, number of pages) of the next chunk, after checking it may be appended."""
        if self.batch_size == 0:
            raise RuntimeError("call reserve() before append_chunk()")
        if num_tokens <= 0:
            raise ValueError(f"a chunk needs at least one token, got {num_tokens}")
        page_size = self.spec.page_size
        if self.num_tokens % page_size:
            raise RuntimeError(
                f"the store holds {self.num_tokens} tokens, not a multiple of page_size={page_size}: "
                "only the last chunk of a sequence may end inside a page"
            )
        return self.num_tokens // page_size, -(-num_tokens // page_size)

    def refill(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Nothing to write again: a store that keeps every page it wrote (see ``PagedKVStore.refill``)."""

    def _check_write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> ChunkRecord:
        """The newest chunk, after checking ``k`` [B, H_kv, T, D_k] and ``v`` [B, H_kv, T, D_v] fit its pages."""
        s = self.spec
        record = self.last_chunk()
        shape, tokens = s.layers[layer_idx], record.end - record.start
        for name, t, dim in (("keys", k, shape.key_dim), ("values", v, shape.value_dim)):
            expected = (self.batch_size, shape.kv_heads, tokens, dim)
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} of shape {tuple(t.shape)} do not fit layer {layer_idx}'s pages {expected}")
            if t.dtype != s.dtype:
                raise TypeError(f"{name} are {t.dtype} but the store holds {s.dtype}")
        return record


class PagedKVStore(ChunkLedger):
    """Preallocated K/V (+gradient) pools with a shared block table, all on the device.

    Implements ``oomb.cache.KVStore`` (what the engine and attention call); beside it ``layer``
    (a layer's pools) and ``read`` (a chunk's K/V as dense tensors) serve tests and tools. Layers with a
    sliding window (``StoreSpec.windows``) take page ids of their own and keep only what their window reaches
    (oomb/cache/window_pages.py); the shared table and allocator serve the full-attention layers.
    """

    def __init__(self, spec: StoreSpec) -> None:
        if spec.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {spec.page_size}")
        self.spec = spec
        self._allocator = PageAllocator(0)
        self._windows = window_groups(spec.windows)
        self._window_of = {layer: group for group in self._windows for layer in group.layers}
        self._full_layers = spec.full_layers()  # the layers on the shared ids and block table
        self._layers: list[LayerPools] = [_empty_pools(spec, i, 0) for i in range(spec.num_layers)]
        self.batch_size = 0
        self.page_table = torch.zeros((0, 0), dtype=torch.int32, device=spec.device)
        self.num_tokens = 0
        self._chunks: list[ChunkRecord] = []

    # ------------------------------------------------------------------ capacity
    @property
    def capacity_pages(self) -> int:
        return self._allocator.num_pages

    @property
    def num_used_pages(self) -> int:
        return self._allocator.num_used

    def window_pages_used(self) -> dict[int, int]:
        """Per sliding window: page ids its layers hold now (the scratch page included)."""
        return {group.window: group.allocator.num_used for group in self._windows}

    def pages_for(self, batch_size: int, num_tokens: int) -> int:
        return batch_size * -(-num_tokens // self.spec.page_size)

    @staticmethod
    def bytes_for(spec: StoreSpec, batch_size: int, num_tokens: int, *, chunk_size: int | None = None) -> StoreBytes:
        """What ``reserve(batch_size, num_tokens, chunk_size)`` allocates: every page's K, V, dK, dV and key summary of
        the full-attention layers, what the sliding layers' windows keep, and the block tables (int32)."""
        pages = batch_size * -(-num_tokens // spec.page_size)
        total = pages * (sum(map(spec.layer_page_bytes, spec.full_layers())) + 4)
        for group in window_groups(spec.windows):
            ids = window_page_ids(group.window, batch_size=batch_size, num_tokens=num_tokens,
                                  page_size=spec.page_size, chunk_size=chunk_size)
            total += ids * sum(spec.layer_page_bytes(i) for i in group.layers) + pages * 4
        return StoreBytes(device=total)

    @staticmethod
    def describe(spec: StoreSpec, batch_size: int, pages: int) -> str:
        """What ``bytes_for`` counts, in words (the memory plan's line): the full-attention layers' pages, the
        sliding layers' windows."""
        full = spec.full_layers()
        slide = spec.num_layers - len(full)
        layers = f"{len(full)} layer{'s' * (len(full) != 1)}"
        kept = f" of {layers}; of the other {slide}, what their windows reach" if slide else ""
        return (f"{batch_size} x {pages} pages x {sum(map(spec.layer_page_bytes, full)):,} B (K, V, dK, dV, mean "
                f"keys){kept} + page table{'s' * bool(slide)}")

    def nbytes(self) -> int:
        """Bytes held by the pools (allocated capacity, used or not)."""
        return sum(self.spec.layer_page_bytes(i) * pools.k.shape[0] for i, pools in enumerate(self._layers))

    def reserve(self, batch_size: int, num_tokens: int, chunk_size: int | None = None) -> None:
        """Make room for ``batch_size`` sequences of ``num_tokens`` in chunks of ``chunk_size`` (None: any; sliding
        layers then get room for every page) and start a new step.

        The store must be empty. Growing an empty pool frees the old tensors before
        allocating new ones, so growth never holds two pools at once.
        """
        self._check_reserve(batch_size, num_tokens)
        needed = self.pages_for(batch_size, num_tokens)
        window_needed = [window_page_ids(g.window, batch_size=batch_size, num_tokens=num_tokens,
                                         page_size=self.spec.page_size, chunk_size=chunk_size) for g in self._windows]
        if needed > self.capacity_pages or any(
                n > g.allocator.num_pages for n, g in zip(window_needed, self._windows, strict=True)):
            # Drop the old pools first (peak memory = the new pools only); if the allocation
            # fails the store is left empty and consistent (capacity 0), not half-sized.
            self.release()
            self._allocate_pools(needed, window_needed)
        max_pages = -(-num_tokens // self.spec.page_size)
        self.batch_size = batch_size
        self.page_table = torch.zeros((batch_size, max_pages), dtype=torch.int32, device=self.spec.device)
        for group in self._windows:
            group.start(batch_size, max_pages, self.spec.device)
        self.num_tokens = 0

    def _allocate_pools(self, num_pages: int, window_pages: list[int]) -> None:
        """Every layer's pools (``num_pages`` shared ids; each window's own count), then allocators of those sizes
        (an allocation that fails leaves the pools and allocators as they were)."""
        pages = dict(zip(self._windows, window_pages, strict=True))
        self._layers = [_empty_pools(self.spec, i, pages[self._window_of[i]] if i in self._window_of else num_pages)
                        for i in range(self.spec.num_layers)]
        self._allocator.reset(num_pages)
        for group, n in pages.items():
            group.allocator.reset(n)

    def _grow(self, layers: list[int], num_pages: int) -> None:
        """Grow the pools of ``layers`` while they hold data (appends past the reservation): copy into larger ones."""
        names = ("k", "v", "dk", "dv", "mean_k") if self.spec.gradients else ("k", "v", "mean_k")
        for i in layers:
            old, new = self._layers[i], _empty_pools(self.spec, i, num_pages)
            for name in names:
                getattr(new, name)[: getattr(old, name).shape[0]].copy_(getattr(old, name))
            self._layers[i] = new

    def _take(self, allocator: PageAllocator, want: int, layers: list[int]) -> list[int]:
        """``want`` ids of ``allocator``, its layers' pools grown first where too few are free."""
        if want > allocator.num_free:
            pages = max(allocator.num_pages + want - allocator.num_free, allocator.num_pages * 3 // 2)
            self._grow(layers, pages)
            allocator.grow(pages)
        try:
            return allocator.allocate(want)
        except OutOfPagesError as e:  # unreachable after growing; kept to name the store in the message
            raise OutOfPagesError(f"paged store: {e}") from e

    def _zero_grads(self, layers, ids: torch.Tensor) -> None:
        # index_fill_ passes the 0 as a kernel argument (``pool[ids] = 0`` copies it from the host, once per layer)
        ids_long = ids.reshape(-1).long()
        for i in layers if self.spec.gradients else ():
            self._layers[i].dk.index_fill_(0, ids_long, 0)
            self._layers[i].dv.index_fill_(0, ids_long, 0)

    # ------------------------------------------------------------------ chunks
    def append_chunk(self, num_tokens: int) -> ChunkRecord:
        """Allocate pages for the next ``num_tokens`` tokens of every sequence.

        The previous chunk must have ended on a page boundary (only the last chunk of a
        sequence may be ragged). Gradient pages of the new chunk are zeroed; sliding layers
        keep of the previous chunk only the pages the new one's window reaches.
        """
        s = self.spec
        first_page, n_pages = self._check_append(num_tokens)
        if first_page + n_pages > self.page_table.shape[1]:
            grown = torch.zeros(
                (self.batch_size, first_page + n_pages), dtype=torch.int32, device=s.device
            )
            grown[:, : self.page_table.shape[1]] = self.page_table
            self.page_table = grown
        ids = self._take(self._allocator, self.batch_size * n_pages, self._full_layers)
        ids_t = ids_on_device(ids, self.batch_size, s.device)
        self.page_table[:, first_page : first_page + n_pages] = ids_t
        self._zero_grads(self._full_layers, ids_t)
        for group in self._windows:
            if self._chunks:
                previous = self._chunks[-1]
                group.trim_newest(previous.first_page, previous.end, s.page_size)
            group.widen(first_page + n_pages)
            window_ids = self._take(group.allocator, self.batch_size * n_pages, list(group.layers))
            group.add(first_page, window_ids, self.batch_size)
            self._zero_grads(group.layers, group.table[:, first_page : first_page + n_pages])
        record = ChunkRecord(
            start=self.num_tokens,
            end=self.num_tokens + num_tokens,
            first_page=first_page,
            num_pages=n_pages,
            page_ids=tuple(ids),
        )
        self._chunks.append(record)
        self.num_tokens = record.end
        return record

    def free_last_chunk(self) -> None:
        """Free the newest chunk's pages (all layers); the store then ends where it began, and the chunk before it
        has its whole pages again in every layer, for its recompute and backward."""
        self._free_last(restore=True)

    def _free_last(self, *, restore: bool) -> None:
        record = self.last_chunk()
        self._allocator.free(list(record.page_ids))
        self._chunks.pop()
        self.page_table[:, record.first_page : record.first_page + record.num_pages] = 0
        self.num_tokens = record.start
        for group in self._windows:
            group.free_newest(record.first_page, record.num_pages)
            if restore and self._chunks and (missing := group.missing(self._chunks[-1].first_page)):
                first = self._chunks[-1].first_page
                ids = self._take(group.allocator, self.batch_size * missing, list(group.layers))
                group.restore_newest(first, ids, self.batch_size)
                self._zero_grads(group.layers, group.table[:, first : first + missing])

    def release(self) -> None:
        """Free every chunk and drop the pools' memory (capacity 0); the store stays usable."""
        self.clear()
        self._allocate_pools(0, [0] * len(self._windows))

    def clear(self) -> None:
        """Free every chunk (after a step, or after an error inside one)."""
        while self._chunks:
            self._free_last(restore=False)  # nothing recomputes them: no pages given back

    # ------------------------------------------------------------------ data
    def layer(self, layer_idx: int) -> LayerPools:
        return self._layers[layer_idx]

    def layer_table(self, layer_idx: int) -> torch.Tensor:
        """The block table through which the layer's pools are read: its window's, else the shared one."""
        group = self._window_of.get(layer_idx)
        return self.page_table if group is None else group.table

    # The working-set protocol the attention function goes through. Everything lives on the
    # device here, so it is trivial; the offloaded store (oomb.offload) moves pages instead.
    def fetch(self, layer_idx: int, past_pages: PastPages | None, *, grads: bool) -> tuple[LayerPools, torch.Tensor]:
        """Pools and block table through which a kernel reads ``past_pages`` (sequence page indices
        before the newest chunk; None = all of them) and the newest chunk of one layer."""
        if grads:
            self._check_gradients("fetch(grads=True)")
        return self._layers[layer_idx], self.layer_table(layer_idx)

    def needs_page_list(self, layer_idx: int) -> bool:
        """Whether ``fetch`` uses the list of past pages a sparse layer reads (to move only those).
        Here every page is on the device, so the list (a torch.unique, which waits for the
        selection) is not built."""
        return False

    def prefetch(self, layer_idx: int, past_pages: PastPages | None, *, grads: bool) -> None:
        """Start bringing what ``fetch`` will ask for next (nothing to do when all pages are here)."""

    def writeback(self, layer_idx: int, *, grads: bool) -> None:
        """The kernels of this layer are queued: new K/V (or updated gradients) may go home."""

    def prefetch_mean_keys(self, layer_idx: int) -> None:
        """Nothing to move: every layer's mean keys are on the device (see OffloadedKVStore)."""

    def mean_keys(self, layer_idx: int) -> torch.Tensor:
        """[num_pages, H_kv, summary_dim] per-page key summaries (mean keys first; K's dtype), indexed
        through ``page_table``."""
        return self._layers[layer_idx].mean_k

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the newest chunk's keys and values [B, H_kv, T, D] of one layer into its pages.

        Slots past T in the chunk's last page are zeroed; the per-page mean key is
        computed over valid slots only.
        """
        s = self.spec
        record = self._check_write(layer_idx, k, v)
        pools = self._layers[layer_idx]
        table = self.layer_table(layer_idx)
        ids = table[:, record.first_page : record.first_page + record.num_pages].reshape(-1).long()
        kp = tokens_to_tiles(k, s.page_size)
        pools.k[ids] = kp
        pools.v[ids] = tokens_to_tiles(v, s.page_size)
        valid = record.ragged_slots(s.page_size, k.device, self.batch_size)
        pools.mean_k[ids] = page_key_summary(kp, valid, s.key_summary).to(s.dtype)

    def refill(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the newest chunk's K/V again where the store gave its pages up since stage 1 wrote them (a sliding
        layer's pages outside the tail): a recompute that reuses stage 1's attention output writes nothing else."""
        group = self._window_of.get(layer_idx)
        if group is not None and group.refill_due:
            self.write(layer_idx, k, v)

    def read(self, layer_idx: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [start, end) as [B, H_kv, end-start, D] (a copy). A sliding layer holds, of the
        chunks before the newest, only the pages the newest one's window reaches."""
        group = self._window_of.get(layer_idx)
        ps = self.spec.page_size
        if group is not None and 0 <= start < end and bool((group.table[:, start // ps : -(-end // ps)]
                                                           == group.scratch).any()):
            raise ValueError(f"layer {layer_idx} keeps only what its {group.window}-token window reaches from later "
                             f"chunks: tokens [{start}, {end}) include pages it gave up")
        pools = self._layers[layer_idx]
        return self._gather(layer_idx, pools.k, start, end), self._gather(layer_idx, pools.v, start, end)

    def read_grad(self, layer_idx: int, record: ChunkRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient pages of one chunk as dense [B, H_kv, T, D] tensors."""
        self._check_gradients("read_grad()")
        pools = self._layers[layer_idx]
        return (self._gather(layer_idx, pools.dk, record.start, record.end),
                self._gather(layer_idx, pools.dv, record.start, record.end))

    def _check_gradients(self, what: str) -> None:
        if not self.spec.gradients:
            raise RuntimeError(f"{what}: this store was made for forward-only passes and has no gradient pages")

    def _gather(self, layer_idx: int, pool: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if not 0 <= start < end <= self.num_tokens:
            raise ValueError(f"tokens [{start}, {end}) are not in the store (it holds {self.num_tokens})")
        ps = self.spec.page_size
        p0, p1 = start // ps, -(-end // ps)
        ids = self.layer_table(layer_idx)[:, p0:p1].long()  # [B, n]
        dense = tiles_to_tokens(pool[ids])  # [B, H_kv, n * page_size, D]
        return dense[:, :, start - p0 * ps : end - p0 * ps]


def _empty_pools(spec: StoreSpec, layer_idx: int, num_pages: int) -> LayerPools:
    """Uninitialised pools of ``num_pages`` pages for one layer (no gradient pages in a forward-only store)."""
    layer = spec.layers[layer_idx]
    keys = (num_pages, layer.kv_heads, spec.page_size, layer.key_dim)
    values = (num_pages, layer.kv_heads, spec.page_size, layer.value_dim)
    grad_pages = num_pages if spec.gradients else 0  # without gradient pages: empty pools of the right shape
    return LayerPools(
        k=torch.empty(keys, dtype=spec.dtype, device=spec.device),
        v=torch.empty(values, dtype=spec.dtype, device=spec.device),
        dk=torch.empty((grad_pages, *keys[1:]), dtype=spec.grad_dtype, device=spec.device),
        dv=torch.empty((grad_pages, *values[1:]), dtype=spec.grad_dtype, device=spec.device),
        mean_k=torch.empty((num_pages, layer.kv_heads, spec.summary_dim(layer_idx)), dtype=spec.dtype,
                           device=spec.device),
    )
