"""The paged K/V store: per layer, K and V pages and their gradient pages.

Layout (one set of pools per attention layer, page ids shared by all layers)::

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


@dataclass(frozen=True)
class PageShape:
    """The K/V geometry of one attention layer's pages (latent attention: a key head size other than the value's)."""

    kv_heads: int
    key_dim: int  # head size of keys (and queries)
    value_dim: int  # head size of values (and of the attention output)

    def __post_init__(self) -> None:
        for name in ("kv_heads", "key_dim", "value_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class StoreSpec:
    """Shapes and dtypes of a store; two stores with equal specs are interchangeable.

    ``layers``: one PageShape per attention layer of the store (an attention call of a chunk's forward: a
    model that attends twice per decoder layer has two store layers per decoder layer). Most models give
    every layer the same shape (``StoreSpec.uniform``).
    """

    layers: tuple[PageShape, ...]
    page_size: int
    dtype: torch.dtype
    grad_dtype: torch.dtype
    device: torch.device
    key_summary: str = "mean"  # per-page key summary for page selection: "mean", or "bounds" (mean | min | max)
    # Gradient pages (dK, dV) beside K and V: a training step's store has them; a forward-only pass that allocates
    # its own store (an evaluation) does without, half the K/V bytes.
    gradients: bool = True

    def __post_init__(self) -> None:
        if self.key_summary not in KEY_SUMMARIES:
            raise ValueError(f"key_summary must be one of {KEY_SUMMARIES}, got {self.key_summary!r}")
        if not self.layers:
            raise ValueError("a store needs at least one layer")

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, value_dim: int | None = None,
                **fields) -> StoreSpec:
        """``num_layers`` layers of one shape (``value_dim`` defaults to ``head_dim``)."""
        shape = PageShape(num_kv_heads, head_dim, head_dim if value_dim is None else value_dim)
        return cls(layers=(shape,) * num_layers, **fields)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def shape(self) -> PageShape:
        """The one shape of every layer; ValueError where layers differ (callers that need one shape)."""
        first = self.layers[0]
        if any(layer != first for layer in self.layers):
            raise ValueError(f"the store's layers have different shapes ({sorted(set(self.layers), key=str)}): "
                             "this part of oomb needs every attention layer to have the same K/V shape")
        return first

    @property
    def num_kv_heads(self) -> int:
        return self.shape.kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.key_dim

    def summary_dim(self, layer_idx: int = 0) -> int:
        """Last dimension of a layer's per-page key summary: D_k (the mean key), or 3 D_k (mean | min | max)."""
        return self.layers[layer_idx].key_dim * (3 if self.key_summary == "bounds" else 1)

    @property
    def _bytes_per_element(self) -> int:
        """Bytes of one K/V element with its gradient's (where the store has gradient pages)."""
        return self.dtype.itemsize + (self.grad_dtype.itemsize if self.gradients else 0)

    def bytes_per_token(self) -> int:
        """K, V and their gradient pages, all layers (the memory that grows with the context)."""
        return sum(s.kv_heads * (s.key_dim + s.value_dim) * self._bytes_per_element for s in self.layers)

    def summary_bytes_per_page(self) -> int:
        """The key summaries of one page id, all layers (in K's dtype)."""
        return sum(s.kv_heads * self.summary_dim(i) for i, s in enumerate(self.layers)) * self.dtype.itemsize

    def bytes_per_page(self) -> int:
        """One page id across all layers: K, V, dK, dV and the key summary (in K's dtype)."""
        return self.bytes_per_token() * self.page_size + self.summary_bytes_per_page()

    def layer_bytes(self, pages: int) -> int:
        """``pages`` pages of one layer: K, V, dK, dV and mean keys (what offload keeps per layer; one shape)."""
        s = self.shape
        page = s.kv_heads * (s.key_dim + s.value_dim) * self._bytes_per_element * self.page_size
        return pages * (page + s.kv_heads * self.summary_dim() * self.dtype.itemsize)


KEY_SUMMARIES = ("mean", "bounds")


def page_key_summary(tiles: torch.Tensor, valid: torch.Tensor | None, kind: str) -> torch.Tensor:
    """Key tiles [n, H_kv, P, D] -> per-page summaries (fp32) over each page's ``valid`` [n] slots (None: every
    slot holds a key): [n, H_kv, D] mean keys, or for ``kind="bounds"`` [n, H_kv, 3D] = mean | per-channel min |
    max (what an upper bound of q . k over the page's keys needs: q+ . max + q- . min)."""
    if valid is None:  # whole pages (a chunk ending on a page boundary): nothing to mask, half the kernels
        mean = tiles.sum(dim=2, dtype=torch.float32).div_(tiles.shape[2])
        if kind == "mean":
            return mean
        k_min, k_max = torch.aminmax(tiles, dim=2)  # exact in the keys' own dtype
        return torch.cat([mean, k_min.float(), k_max.float()], dim=-1)
    t = tiles.float()
    mean = t.sum(dim=2) / valid.view(-1, 1, 1)  # padding slots are zero
    if kind == "mean":
        return mean
    slots = torch.arange(t.shape[2], device=t.device)
    pad = (slots.view(1, -1) >= valid.view(-1, 1)).view(t.shape[0], 1, t.shape[2], 1)
    k_min = t.masked_fill(pad, float("inf")).amin(dim=2)
    k_max = t.masked_fill(pad, float("-inf")).amax(dim=2)
    return torch.cat([mean, k_min, k_max], dim=-1)


@dataclass(frozen=True)
class StoreBytes:
    """Bytes a store allocates for one step: on the device, in host memory, and (offloaded) how many layers stay
    whole on the device. What the memory planner adds up, from the stores' own ``bytes_for``."""

    device: int
    host: int = 0
    resident_layers: int = 0


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
    (a layer's pools) and ``read`` (a chunk's K/V as dense tensors) serve tests and tools.
    """

    def __init__(self, spec: StoreSpec) -> None:
        if spec.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {spec.page_size}")
        self.spec = spec
        self._allocator = PageAllocator(0)
        self._layers: list[LayerPools] = []
        self._allocate_pools(0)
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

    def pages_for(self, batch_size: int, num_tokens: int) -> int:
        return batch_size * -(-num_tokens // self.spec.page_size)

    @staticmethod
    def bytes_for(spec: StoreSpec, batch_size: int, num_tokens: int) -> StoreBytes:
        """What ``reserve(batch_size, num_tokens)`` allocates: every page's K, V, dK, dV and key summary, and the
        block table (int32)."""
        pages = batch_size * -(-num_tokens // spec.page_size)
        return StoreBytes(device=pages * spec.bytes_per_page() + pages * 4)

    def nbytes(self) -> int:
        """Bytes held by the pools (allocated capacity, used or not)."""
        return self.capacity_pages * self.spec.bytes_per_page()

    def reserve(self, batch_size: int, num_tokens: int) -> None:
        """Make room for ``batch_size`` sequences of ``num_tokens`` and start a new step.

        The store must be empty. Growing an empty pool frees the old tensors before
        allocating new ones, so growth never holds two pools at once.
        """
        self._check_reserve(batch_size, num_tokens)
        needed = self.pages_for(batch_size, num_tokens)
        if needed > self.capacity_pages:
            # Drop the old pools first (peak memory = the new pools only); if the allocation
            # fails the store is left empty and consistent (capacity 0), not half-sized.
            self.release()
            self._allocate_pools(needed)
            self._allocator.reset(needed)
        max_pages = -(-num_tokens // self.spec.page_size)
        self.batch_size = batch_size
        self.page_table = torch.zeros((batch_size, max_pages), dtype=torch.int32, device=self.spec.device)
        self.num_tokens = 0

    def _allocate_pools(self, num_pages: int) -> None:
        s = self.spec
        self._layers = []
        grad_pages = num_pages if s.gradients else 0  # without gradient pages: empty pools of the right shape
        for i, layer in enumerate(s.layers):
            keys = (num_pages, layer.kv_heads, s.page_size, layer.key_dim)
            values = (num_pages, layer.kv_heads, s.page_size, layer.value_dim)
            self._layers.append(LayerPools(
                k=torch.empty(keys, dtype=s.dtype, device=s.device),
                v=torch.empty(values, dtype=s.dtype, device=s.device),
                dk=torch.empty((grad_pages, *keys[1:]), dtype=s.grad_dtype, device=s.device),
                dv=torch.empty((grad_pages, *values[1:]), dtype=s.grad_dtype, device=s.device),
                mean_k=torch.empty((num_pages, layer.kv_heads, s.summary_dim(i)), dtype=s.dtype, device=s.device),
            ))

    def _grow(self, num_pages: int) -> None:
        """Grow while holding data (append past the reservation): copy into larger pools."""
        old = self._layers
        self._allocate_pools(num_pages)
        n = self._allocator.num_pages
        names = ("k", "v", "dk", "dv", "mean_k") if self.spec.gradients else ("k", "v", "mean_k")
        for new_l, old_l in zip(self._layers, old, strict=True):
            for name in names:
                getattr(new_l, name)[:n].copy_(getattr(old_l, name))
        self._allocator.grow(num_pages)

    # ------------------------------------------------------------------ chunks
    def append_chunk(self, num_tokens: int) -> ChunkRecord:
        """Allocate pages for the next ``num_tokens`` tokens of every sequence.

        The previous chunk must have ended on a page boundary (only the last chunk of a
        sequence may be ragged). Gradient pages of the new chunk are zeroed.
        """
        s = self.spec
        first_page, n_pages = self._check_append(num_tokens)
        if first_page + n_pages > self.page_table.shape[1]:
            grown = torch.zeros(
                (self.batch_size, first_page + n_pages), dtype=torch.int32, device=s.device
            )
            grown[:, : self.page_table.shape[1]] = self.page_table
            self.page_table = grown
        want = self.batch_size * n_pages
        if want > self._allocator.num_free:
            self._grow(max(self.capacity_pages + want - self._allocator.num_free, self.capacity_pages * 3 // 2))
        try:
            ids = self._allocator.allocate(want)
        except OutOfPagesError as e:  # unreachable after _grow; kept to name the store in the message
            raise OutOfPagesError(f"paged store: {e}") from e
        # The ids come from the host allocator. A pageable copy would wait for the stream (a host
        # sync per chunk), and ``pool[ids] = 0`` copies its 0 from the host the same way, once per
        # layer and kind: pinned + non_blocking, and index_fill_ (the value is a kernel argument).
        cuda = s.device.type == "cuda"
        ids_t = torch.tensor(ids, dtype=torch.int32, pin_memory=cuda).view(self.batch_size, n_pages)
        ids_t = ids_t.to(s.device, non_blocking=cuda)
        self.page_table[:, first_page : first_page + n_pages] = ids_t
        ids_long = ids_t.view(-1).long()
        for pools in self._layers if s.gradients else ():
            pools.dk.index_fill_(0, ids_long, 0)
            pools.dv.index_fill_(0, ids_long, 0)
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
        """Free the newest chunk's pages (all layers); the store then ends where it began."""
        record = self.last_chunk()
        self._allocator.free(list(record.page_ids))
        self._chunks.pop()
        self.page_table[:, record.first_page : record.first_page + record.num_pages] = 0
        self.num_tokens = record.start

    def release(self) -> None:
        """Free every chunk and drop the pools' memory (capacity 0); the store stays usable."""
        self.clear()
        self._allocate_pools(0)
        self._allocator.reset(0)

    def clear(self) -> None:
        """Free every chunk (after a step, or after an error inside one)."""
        while self._chunks:
            self.free_last_chunk()

    # ------------------------------------------------------------------ data
    def layer(self, layer_idx: int) -> LayerPools:
        return self._layers[layer_idx]

    # The working-set protocol the attention function goes through. Everything lives on the
    # device here, so it is trivial; the offloaded store (oomb.offload) moves pages instead.
    def fetch(self, layer_idx: int, past_pages: PastPages | None, *, grads: bool) -> tuple[LayerPools, torch.Tensor]:
        """Pools and block table through which a kernel reads ``past_pages`` (sequence page indices
        before the newest chunk; None = all of them) and the newest chunk of one layer."""
        if grads:
            self._check_gradients("fetch(grads=True)")
        return self._layers[layer_idx], self.page_table

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

    def _chunk_page_ids(self, record: ChunkRecord) -> torch.Tensor:
        return self.page_table[:, record.first_page : record.first_page + record.num_pages].long()

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the newest chunk's keys and values [B, H_kv, T, D] of one layer into its pages.

        Slots past T in the chunk's last page are zeroed; the per-page mean key is
        computed over valid slots only.
        """
        s = self.spec
        record = self._check_write(layer_idx, k, v)
        pools = self._layers[layer_idx]
        ids = self._chunk_page_ids(record).reshape(-1)
        kp = tokens_to_tiles(k, s.page_size)
        pools.k[ids] = kp
        pools.v[ids] = tokens_to_tiles(v, s.page_size)
        valid = record.ragged_slots(s.page_size, k.device, self.batch_size)
        pools.mean_k[ids] = page_key_summary(kp, valid, s.key_summary).to(s.dtype)

    def read(self, layer_idx: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [start, end) as [B, H_kv, end-start, D] (a copy)."""
        pools = self._layers[layer_idx]
        return self._gather(pools.k, start, end), self._gather(pools.v, start, end)

    def read_grad(self, layer_idx: int, record: ChunkRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient pages of one chunk as dense [B, H_kv, T, D] tensors."""
        self._check_gradients("read_grad()")
        pools = self._layers[layer_idx]
        return self._gather(pools.dk, record.start, record.end), self._gather(pools.dv, record.start, record.end)

    def _check_gradients(self, what: str) -> None:
        if not self.spec.gradients:
            raise RuntimeError(f"{what}: this store was made for forward-only passes and has no gradient pages")

    def _gather(self, pool: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if not 0 <= start < end <= self.num_tokens:
            raise ValueError(f"tokens [{start}, {end}) are not in the store (it holds {self.num_tokens})")
        ps = self.spec.page_size
        p0, p1 = start // ps, -(-end // ps)
        ids = self.page_table[:, p0:p1].long()  # [B, n]
        dense = tiles_to_tokens(pool[ids])  # [B, H_kv, n * page_size, D]
        return dense[:, :, start - p0 * ps : end - p0 * ps]

