"""One layer's working set on the device: a slot of the offloaded store, and how its buffers grow.

The store (oomb/offload/store.py) fills and empties slots; a slot only knows what it holds and
how to make room. Buffers are made on first use and grow, never shrink, within a store's life.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from oomb.cache import PastPages, StoreSpec

KINDS = ("k", "v", "dk", "dv")


def kind_dim(spec: StoreSpec, kind: str) -> int:
    """Head size of a page of ``kind``: the keys' for k and dk, the values' for v and dv (one shape per store)."""
    return spec.shape.key_dim if kind in ("k", "dk") else spec.shape.value_dim


def resident_layers(spec: StoreSpec, batch_size: int, pages: int, gpu_bytes: int) -> int:
    """The first layers whose pages (K, V, dK, dV, key summaries) fit in ``gpu_bytes`` whole: kept on the device
    instead of going through slots."""
    return min(spec.num_layers, gpu_bytes // spec.layer_bytes(batch_size * pages))


@dataclass
class DeviceSlot:
    """One layer's working set on the device."""

    pools: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> [capacity, H_kv, P, D_k or D_v]
    table: torch.Tensor | None = None  # [B, max_pages] int32
    key: tuple | None = None  # what the slot holds: (layer, chunk start, past pages' serial, grads)
    past: PastPages | None = None  # its past pages (None = 0..m-1)
    num_past: int = 0
    rows: int = 0  # M: pages per sequence in the slot (past + chunk)
    ready: object = None  # CUDA event: its pages have arrived
    free: object = None  # CUDA event: the kernels reading it are done
    mean: torch.Tensor | None = None  # [B, max_pages, H_kv, D]: one layer's mean keys
    mean_key: tuple | None = None  # (layer, chunk start) whose past the mean keys hold
    mean_ready: object = None  # CUDA event: they have arrived

    def ensure_mean(self, spec: StoreSpec, shape: tuple[int, ...], wait_for_copies: Callable[[], None]) -> None:
        """Give the slot a mean-key buffer of ``shape`` (made on first use, like its pools); ``wait_for_copies``
        runs first when the old buffer is replaced (copies in flight may still use it)."""
        if self.mean is None or tuple(self.mean.shape) != shape:
            wait_for_copies()
            self.mean = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
            self.mean_key = None
            if spec.device.type == "cuda":  # copies into it wait self.free: order them after this fill (as below)
                self.free = torch.cuda.Event()
                self.free.record(torch.cuda.current_stream(spec.device))

    def ensure_capacity(self, spec: StoreSpec, pages: int, wait_for_copies: Callable[[], None]) -> None:
        """Room for ``pages`` pages of every kind; ``wait_for_copies`` runs first when the pools are replaced."""
        have = self.pools["k"].shape[0] if self.pools else 0
        if pages > have:
            wait_for_copies()  # the old slot may still be read or written
            if spec.device.type == "cuda":
                torch.cuda.current_stream(spec.device).synchronize()
            new = max(pages, have * 5 // 4)
            self.pools = {}
            for kind in KINDS:
                dtype = spec.dtype if kind in ("k", "v") else spec.grad_dtype
                self.pools[kind] = torch.zeros((new, spec.num_kv_heads, spec.page_size, kind_dim(spec, kind)),
                                               dtype=dtype, device=spec.device)
            if spec.device.type == "cuda":
                # The zero fill above is queued on the compute stream, but the copies that fill
                # the new pools run on the copy stream after waiting only ``self.free``, an event
                # of the old pools (already passed): without this event the fill could land after
                # (on top of) the copied pages. The store's copies wait ``self.free``: make it this.
                self.free = torch.cuda.Event()
                self.free.record(torch.cuda.current_stream(spec.device))
