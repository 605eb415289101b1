"""The store interface (oomb.cache.KVStore): both stores implement it, as declared."""

import inspect

import pytest
import torch

from oomb.cache import KVStore, PagedKVStore, StoreSpec
from oomb.offload import OffloadedKVStore

SPEC = StoreSpec.uniform(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32,
                 grad_dtype=torch.float32, device=torch.device("cpu"))
METHODS = sorted(name for name, member in vars(KVStore).items()
                 if inspect.isfunction(member) and not name.startswith("_"))
ATTRIBUTES = sorted(KVStore.__annotations__)


def test_the_interface_declares_what_the_engine_and_attention_call():
    assert {"fetch", "prefetch", "writeback", "needs_page_list", "prefetch_mean_keys", "mean_keys", "write",
            "read_grad", "reserve", "append_chunk", "free_last_chunk", "clear", "release"} <= set(METHODS)
    assert ATTRIBUTES == ["batch_size", "num_tokens", "page_table", "spec"]
    for name in METHODS:
        assert inspect.getdoc(getattr(KVStore, name)), f"KVStore.{name} has no docstring"


@pytest.mark.parametrize("store_class", [PagedKVStore, OffloadedKVStore])
def test_both_stores_satisfy_the_interface(store_class):
    store = store_class(SPEC)
    assert isinstance(store, KVStore)
    for name in METHODS:  # same parameters, same kinds (keyword-only grads), in the same order
        declared = list(inspect.signature(getattr(KVStore, name)).parameters.values())[1:]
        actual = list(inspect.signature(getattr(store, name)).parameters.values())
        assert [(p.name, p.kind) for p in actual] == [(p.name, p.kind) for p in declared], f"{store_class}.{name}"


@pytest.mark.parametrize("missing", ["fetch", "writeback", "page_table"])
def test_an_object_lacking_a_member_is_not_a_store(missing):
    members = {name: (lambda *a, **k: None) for name in METHODS}
    members.update({name: 0 for name in ATTRIBUTES})
    assert isinstance(type("WholeStore", (), members)(), KVStore)
    del members[missing]
    assert not isinstance(type("PartialStore", (), members)(), KVStore)
