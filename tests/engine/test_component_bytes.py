"""Each allocating component's ``bytes_for`` (what the memory planner adds up) is what it allocates."""

import pytest
import torch

from oomb.cache import PagedKVStore, StoreSpec
from oomb.cache.store import LayerPools
from oomb.offload import OffloadedKVStore


def _spec(**kw) -> StoreSpec:
    base = dict(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16,
                grad_dtype=torch.float32, device=torch.device("cpu"))
    base.update(kw)
    return StoreSpec.uniform(**base)


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize(("batch", "tokens"), [(1, 4), (2, 37), (3, 128)])
def test_the_paged_store_allocates_what_bytes_for_says(batch, tokens):
    spec = _spec()
    store = PagedKVStore(spec)
    store.reserve(batch, tokens)
    pools = [getattr(layer, name) for layer in store._layers for name in LayerPools.__dataclass_fields__]
    assert PagedKVStore.bytes_for(spec, batch, tokens).device == _bytes([*pools, store.page_table])


@pytest.mark.parametrize("resident", [0, 1, 3])
def test_the_offloaded_store_holds_in_host_memory_and_keeps_whole_on_the_device_what_bytes_for_says(resident):
    spec, batch, tokens = _spec(), 2, 37
    layer = spec.layer_bytes(batch * -(-tokens // spec.page_size))
    gpu_bytes = resident * layer + layer // 2  # room for `resident` layers, not one more
    store = OffloadedKVStore(spec, gpu_bytes=gpu_bytes)
    store.reserve(batch, tokens)
    planned = OffloadedKVStore.bytes_for(spec, batch, tokens, chunk_size=16, gpu_bytes=gpu_bytes)
    assert store.resident_layers == planned.resident_layers == resident
    assert planned.host == store.host_nbytes()
    assert _bytes(store._dev.values()) == resident * layer  # the device part besides the slots and tables
