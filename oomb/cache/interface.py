"""The paged store's interface: what the engine and attention call, declared once.

``PagedKVStore`` (oomb/cache/store.py: every page on the device) and ``OffloadedKVStore``
(oomb/offload/store.py: pages in host memory, a working set on the device) implement it.
A step goes through it in this order::

    reserve(B, N, C)
    append_chunk(C)                                  stage 1, each chunk
        per layer: [mean_keys] fetch -> write -> kernels -> writeback, prefetch(next layer)
    append_chunk(C_last)                             stage 2, newest chunk first
        per layer, forward: as in stage 1 (refill where stage 1's output is reused);
                   backward: fetch(grads) -> kernels -> read_grad -> writeback
        free_last_chunk()
    clear()
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from oomb.cache.past_pages import PastPages
from oomb.cache.spec import StoreSpec
from oomb.cache.store import ChunkRecord, LayerPools


@runtime_checkable
class KVStore(Protocol):
    """A paged K/V store with gradient pages, as the engine and attention use it (module docstring)."""

    spec: StoreSpec  # shapes and dtypes
    batch_size: int  # sequences of the current step
    num_tokens: int  # tokens per sequence stored so far (the newest chunk included)
    page_table: torch.Tensor  # [B, max_pages] int32 block table, on the device

    def nbytes(self) -> int:
        """Device bytes the store holds."""

    def reserve(self, batch_size: int, num_tokens: int, chunk_size: int | None = None) -> None:
        """Make room for ``batch_size`` sequences of ``num_tokens`` in chunks of ``chunk_size`` (None: of any size) and
        start a new step (the store must be empty)."""

    def append_chunk(self, num_tokens: int) -> ChunkRecord:
        """Allocate the pages of the next ``num_tokens`` tokens of every sequence (gradient pages zeroed)."""

    def last_chunk(self) -> ChunkRecord:
        """The newest chunk (raises when the store holds none)."""

    def free_last_chunk(self) -> None:
        """Free the newest chunk's pages, all layers."""

    def clear(self) -> None:
        """Free every chunk (after a step, or after an error inside one)."""

    def release(self) -> None:
        """Free every chunk and the store's memory; the store stays usable."""

    def needs_page_list(self, layer_idx: int) -> bool:
        """Whether ``fetch`` moves only the listed past pages of a sparse layer (else a list is not worth making)."""

    def mean_keys(self, layer_idx: int) -> torch.Tensor:
        """[num_pages, H_kv, summary_dim] per-page key summaries of the newest chunk's past, through ``page_table``."""

    def prefetch_mean_keys(self, layer_idx: int) -> None:
        """Start bringing the layer's key summaries to the device (for its page selection), without waiting."""

    def fetch(self, layer_idx: int, past_pages: PastPages | None, *, grads: bool) -> tuple[LayerPools, torch.Tensor]:
        """Pools and block table through which a kernel reads ``past_pages`` (None = all) and the newest chunk of
        one layer; with ``grads`` also their gradient pages. The table gives each page it holds a row of its own
        (kernels add gradients by gathering, adding and writing back rows); pages it does not hold may share
        one row, which kernels may read and write (zero gradients of keys no query sees) and nothing reads back."""

    def prefetch(self, layer_idx: int, past_pages: PastPages | None, *, grads: bool) -> None:
        """Start bringing what ``fetch`` will ask for next, without waiting."""

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the newest chunk's keys and values [B, H_kv, T, D] of one layer into its pages."""

    def refill(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the newest chunk's K/V again where the store gave up its pages since stage 1 wrote them (a sliding
        layer's pages its window does not reach from later chunks); nothing where it kept them."""

    def writeback(self, layer_idx: int, *, grads: bool) -> None:
        """The layer's kernels are queued: new K/V (``grads=False``) or updated gradient pages may go home."""

    def read_grad(self, layer_idx: int, record: ChunkRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest chunk's gradient pages of one layer as dense [B, H_kv, T, D] tensors (after its backward)."""
