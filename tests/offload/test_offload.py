"""Pages in host memory (offload=True) give exactly the gradients of the device-resident store."""

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import oomb
from oomb.engine import store_for_model
from oomb.offload import OffloadedKVStore
from oomb.sparse import PageSelection


def _step(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, **kw)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [
    pytest.param("llama", {}, id="dense"),
    pytest.param("qwen2", {}, id="dense-sliding-window-layer"),
    pytest.param("gpt_oss", {"selection": PageSelection(page_budget=3, block=16, sink_pages=1)},
                 id="sparse-gpt-oss-window-and-sinks"),
    pytest.param("llama", {"selection": PageSelection(page_budget=4, block=16, per_head=True)}, id="sparse-per-head"),
    pytest.param("qwen3", {"page_budget": 2, "doc_ids": "packed"}, id="sparse-documents"),
]


@pytest.mark.parametrize("family,kw", CASES)
def test_offload_gradients_are_bit_identical(family, kw):
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 200))
    kw = dict(kw)
    if kw.get("doc_ids") == "packed":
        doc_ids = torch.zeros_like(ids)
        doc_ids[:, 77:] = 1
        doc_ids[1, 150:] = 2
        kw["doc_ids"] = doc_ids
    ref_loss, ref = _step(model, ids, chunk_size=32, page_size=8, **kw)
    loss, got = _step(model, ids, chunk_size=32, page_size=8, offload=True, **kw)
    assert isinstance(store_for_model(model), OffloadedKVStore)
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name
    store = store_for_model(model)
    assert store.num_tokens == 0 and not store.chunks
    assert all(torch.isfinite(g).all() for g in got.values())


def test_offload_with_layer_checkpointing_and_eval():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 130))
    ref_loss, ref = _step(model, ids, chunk_size=32, page_size=8)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, got = _step(model, ids, chunk_size=32, page_size=8, offload=True)
    model.gradient_checkpointing_disable()
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name
    ev = oomb.engine.chunked_eval(model, ids, chunk_size=32, page_size=8, offload=True)
    ev_ref = oomb.engine.chunked_eval(model, ids, chunk_size=32, page_size=8)
    assert torch.equal(ev.nll.nan_to_num(), ev_ref.nll.nan_to_num())


def test_device_memory_holds_two_slots_not_the_context():
    # The device part of the offloaded store: two layer slots (+ mean keys), not the whole store.
    model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(0, VOCAB, (1, 256))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=8, offload=True)
    store = store_for_model(model)
    spec = store.spec
    per_page_layer = spec.bytes_per_token() // spec.num_layers * spec.page_size  # K, V, dK, dV of one layer
    pages = 256 // 8
    slots = store.nbytes() - pages * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # minus mean keys
    assert slots <= 2 * pages * per_page_layer * 5 // 4  # two slots, grown at most 25% past what they held
    assert store.host_nbytes() == pages * spec.bytes_per_token() * spec.page_size  # every layer's pages


def test_offload_store_refuses_misuse():
    from oomb.cache import StoreSpec

    spec = StoreSpec(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32,
                     grad_dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="2 device slots"):
        OffloadedKVStore(spec, num_slots=1)
    store = OffloadedKVStore(spec)
    with pytest.raises(RuntimeError, match="reserve"):
        store.append_chunk(4)
    store.reserve(1, 8)
    store.append_chunk(4)
    with pytest.raises(RuntimeError, match="before fetch"):
        store.write(0, torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4))
    with pytest.raises(RuntimeError, match="reserved for 2 pages"):
        store.append_chunk(4)
        store.append_chunk(4)


def test_synchronous_debug_mode_is_read_from_the_environment(monkeypatch):
    """OOMB_OFFLOAD_SYNC=1 (the race-vs-logic switch of docs/offload.md): same gradients, flag set."""
    from oomb.offload.store import SYNC_ENV

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 70))
    ref_loss, ref = _step(model, ids, chunk_size=32, page_size=8)
    monkeypatch.setenv(SYNC_ENV, "1")
    oomb.release_memory(model)
    loss, got = _step(model, ids, chunk_size=32, page_size=8, offload=True)
    assert store_for_model(model).synchronous
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name
    monkeypatch.setenv(SYNC_ENV, "0")
    assert not OffloadedKVStore(store_for_model(model).spec).synchronous
