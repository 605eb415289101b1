"""What an offloaded store holds for a step, on the device and in host memory (what the memory planner adds up)."""

from __future__ import annotations

from oomb.cache import StoreBytes, StoreSpec
from oomb.offload.host_pages import HostPages
from oomb.offload.slots import resident_layers


def store_bytes(spec: StoreSpec, batch_size: int, num_tokens: int, *, chunk_size: int,
                listed_pages: int | None = None, gpu_bytes: int = 0) -> StoreBytes:
    """What a step of ``batch_size`` sequences of ``num_tokens`` in chunks of ``chunk_size`` holds (the slots at
    their largest): in host memory every page's K, V, dK, dV and key summary of the layers not kept whole
    (pinned, exactly this size); on the device the first layers that fit in ``gpu_bytes`` whole, the block
    tables (the store's and the two slots'), and two slots, each one layer's key summaries and the pages one
    kernel call reads (every past page when dense; ``listed_pages`` past pages per sequence when sparse: the
    page lists' union, PageSelection.pages_per_list times the lists) plus the chunk's own and the spare row,
    grown by at most 5/4 over what they held (DeviceSlot.ensure_capacity). Of a sliding layer the host keeps
    what its window reaches (oomb/offload/host_pages.py)."""
    page_size = spec.page_size
    pages = -(-num_tokens // page_size)
    page_bytes = spec.bytes_per_token() * page_size // spec.num_layers  # one page of one layer: K, V, dK, dV
    layer = spec.layer_bytes(batch_size * pages)  # one layer's pages and key summaries
    summaries = layer - batch_size * pages * page_bytes
    resident = resident_layers(spec, batch_size, pages, gpu_bytes)
    offloaded = spec.num_layers - resident
    chunk_pages = -(-min(chunk_size, num_tokens) // page_size)
    slot_pages = pages if listed_pages is None else min(pages, listed_pages + chunk_pages)
    slots = 2 * ((batch_size * slot_pages + 1) * page_bytes * 5 // 4 + summaries) if offloaded else 0
    device = resident * layer + slots + 3 * batch_size * pages * 4
    host = HostPages.bytes_for(spec, batch_size, num_tokens, chunk_size=chunk_size, resident=resident)
    return StoreBytes(device=device, host=host, resident_layers=resident)
