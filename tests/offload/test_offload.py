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
    pytest.param("llama", {"selection": PageSelection(page_budget=3, block=16, score="bound")}, id="sparse-bound"),
    pytest.param("llama", {"selection": PageSelection(page_budget=2, block=8, chunk_pages=3)}, id="sparse-chunk-pages"),
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
    layer_means = pages * spec.num_kv_heads * spec.head_dim * 4  # one layer's mean keys (fp32 here)
    # Two slots, grown at most 25% past what they held, with one layer's mean keys each.
    assert store.nbytes() <= 2 * pages * per_page_layer * 5 // 4 + 2 * layer_means
    assert store.host_nbytes() == pages * spec.bytes_per_page()  # every layer's pages and mean keys


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


@pytest.mark.parametrize("batch,pages,chosen", [(1, 9, [0, 3, 8]), (2, 6, [5, 1])])
def test_page_copy_kernel_gathers_and_scatters_like_indexing(batch, pages, chosen):
    """The Triton page-copy kernel (interpreter on CPU) moves exactly the pages torch indexing moves."""
    from oomb.offload.copy import copy_pages

    host = torch.randn(batch, pages, 2, 8, 4)  # [B, pages, H_kv, P, D]
    idx = torch.tensor(chosen, dtype=torch.int32)
    # Gather into a slot with room for more rows than chosen (rows past them stay untouched).
    slot_k, slot_t = (torch.full((batch, len(chosen) + 2, 2, 8, 4), 7.0) for _ in range(2))
    copy_pages(host, slot_k, src_index=idx, use_kernel=True)
    copy_pages(host, slot_t, src_index=idx, use_kernel=False)
    assert torch.equal(slot_k, slot_t)
    assert torch.equal(slot_k[:, : len(chosen)], host[:, idx.long()])
    assert (slot_k[:, len(chosen):] == 7.0).all()
    # Scatter updated rows back: only the chosen pages change.
    upd = torch.randn(batch, len(chosen), 2, 8, 4)
    back_k, back_t = host.clone(), host.clone()
    copy_pages(upd, back_k, dst_index=idx, use_kernel=True)
    copy_pages(upd, back_t, dst_index=idx, use_kernel=False)
    assert torch.equal(back_k, back_t)
    assert torch.equal(back_k[:, idx.long()], upd)
    others = [p for p in range(pages) if p not in chosen]
    assert torch.equal(back_k[:, others], host[:, others])
    with pytest.raises(ValueError, match="src_index or dst_index"):
        copy_pages(host, slot_k, use_kernel=True)
    # Both indices, -1 skipping a row (a union of page lists): page p to slot row slot[p] where both are >= 0.
    pages_in_order = torch.tensor([p if p in chosen else -1 for p in range(pages)], dtype=torch.int32)
    slot_rows = torch.tensor([sorted(chosen).index(p) if p in chosen else -1 for p in range(pages)],
                             dtype=torch.int32)
    for use_kernel in (True, False):
        slot = torch.full((batch, len(chosen) + 2, 2, 8, 4), 7.0)
        copy_pages(host, slot, src_index=pages_in_order, dst_index=slot_rows, use_kernel=use_kernel)
        assert torch.equal(slot[:, : len(chosen)], host[:, sorted(chosen)]) and (slot[:, len(chosen):] == 7.0).all()
        back = host.clone()
        copy_pages(upd, back, src_index=slot_rows, dst_index=pages_in_order, use_kernel=use_kernel)
        assert torch.equal(back[:, sorted(chosen)], upd) and torch.equal(back[:, others], host[:, others])


def test_sparse_offload_through_the_page_copy_kernel_is_bit_identical(monkeypatch):
    """The CUDA path of sparse offload (chosen pages moved by the copy kernel), run in the interpreter."""
    import oomb.offload.store as offload_store

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 160))
    kw = dict(chunk_size=32, page_size=8, selection=PageSelection(page_budget=3, block=16))
    ref_loss, ref = _step(model, ids, **kw)
    _step(model, ids[:, :40], offload=True, **kw)  # builds the offloaded store
    store = store_for_model(model)
    store.copy_kernels = True
    calls, real = [], offload_store.copy_pages

    def counted(*a, **k):
        calls.append(k.get("use_kernel"))
        return real(*a, **k)

    monkeypatch.setattr(offload_store, "copy_pages", counted)
    loss, got = _step(model, ids, offload=True, **kw)
    assert store_for_model(model) is store and calls and all(calls)  # gathers and scatters ran in the kernel
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name


@pytest.mark.parametrize("kw", [pytest.param({}, id="dense"),
                                pytest.param({"selection": PageSelection(page_budget=3, block=16)}, id="sparse")])
@pytest.mark.parametrize("resident", [1, 3, 4])
def test_layers_kept_on_the_gpu_change_no_gradient(kw, resident):
    """offload_gpu_bytes keeps the first layers whole on the device: same gradients, less host memory."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(0, VOCAB, (2, 150))
    ref_loss, ref = _step(model, ids, chunk_size=32, page_size=8, **kw)
    _step(model, ids[:, :40], chunk_size=32, page_size=8, offload=True, **kw)
    layer = store_for_model(model).layer_nbytes(2, 150)  # pages of 150 tokens: 19 per row
    loss, got = _step(model, ids, chunk_size=32, page_size=8, offload=True, offload_gpu_bytes=resident * layer + 1,
                      **kw)
    store = store_for_model(model)
    assert store.resident_layers == resident
    assert store.host_nbytes() == (4 - resident) * layer
    assert store.nbytes() >= resident * layer
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name
    ev = oomb.engine.chunked_eval(model, ids, chunk_size=32, page_size=8, offload=True,
                                  offload_gpu_bytes=resident * layer, **kw)
    ev_ref = oomb.engine.chunked_eval(model, ids, chunk_size=32, page_size=8, **kw)
    assert torch.equal(ev.nll.nan_to_num(), ev_ref.nll.nan_to_num())


def test_gpu_allowance_needs_offload():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs offload=True"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 40)), chunk_size=32, page_size=8,
                              offload_gpu_bytes=1 << 20)


def test_one_page_list_per_chunk_needs_no_union(monkeypatch):
    """Select block = chunk, one sequence, shared lists: the list is the union (no torch.unique, no host
    wait); offload stays bit-identical."""
    import oomb.cache.page_lists as page_lists

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 160))
    kw = dict(chunk_size=32, page_size=8, selection=PageSelection(page_budget=3, block=32))
    ref_loss, ref = _step(model, ids, **kw)

    def no_unique(*a, **k):
        raise AssertionError("torch.unique called for a single page list")

    monkeypatch.setattr(page_lists.torch, "unique", no_unique)
    loss, got = _step(model, ids, offload=True, **kw)
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name


def test_page_lists_that_cover_the_past_bring_every_past_page(monkeypatch):
    """Where a chunk's lists name at least as many pages per row as its past holds (select blocks x budget >=
    past pages), the store is asked for every past page: no torch.unique (a host wait), known before the
    selection (prefetched), the bytes of dense offload; the kernels still attend the listed pages only, so the
    gradients are the device store's, bit for bit. A longer past gets the union again."""
    import oomb.cache.page_lists as page_lists

    model = tiny_model("llama")
    covered = dict(chunk_size=32, page_size=16, selection=PageSelection(page_budget=4, block=16))  # 2 x 4 >= 8
    ids = torch.randint(0, VOCAB, (1, 160))
    ref_loss, ref = _step(model, ids, **covered)
    dense_loss, _ = _step(model, ids, chunk_size=32, page_size=16)
    assert not torch.equal(ref_loss, dense_loss)  # the selection does change the attention

    def no_unique(*a, **k):
        raise AssertionError("torch.unique called although the lists cover the past")

    with monkeypatch.context() as m:
        m.setattr(page_lists.torch, "unique", no_unique)
        loss, got = _step(model, ids, offload=True, **covered)
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name
    moved = dict(store_for_model(model).moved_bytes)
    _step(model, ids, offload=True, chunk_size=32, page_size=16)
    dense = store_for_model(model).moved_bytes
    # what dense offload moves, and the page summaries the selection reads (a few percent here)
    assert moved["to_host"] == dense["to_host"]
    assert dense["to_device"] < moved["to_device"] < 1.05 * dense["to_device"]

    # Budget 1: 2 lists x 1 page < the past from the third chunk on: the union (made on the device, still no
    # torch.unique), fewer bytes than dense.
    sparse = dict(chunk_size=32, page_size=16, selection=PageSelection(page_budget=1, block=16))
    ref_loss, ref = _step(model, ids, **sparse)
    with monkeypatch.context() as m:
        m.setattr(page_lists.torch, "unique", no_unique)
        loss, got = _step(model, ids, offload=True, **sparse)
    assert torch.equal(loss, ref_loss) and all(torch.equal(got[n], g) for n, g in ref.items())
    assert store_for_model(model).moved_bytes["to_device"] < moved["to_device"]


def test_a_cap_on_a_chunks_pages_is_what_offload_moves():
    """chunk_pages: the union of a chunk's lists, and so the device slot and the bytes copied per layer, is at
    most chunk_pages pages per row, not blocks x budget; the gradients stay the device store's, bit for bit."""
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 320))
    moved = {}
    for cap in (None, 2):
        kw = dict(chunk_size=64, page_size=8, selection=PageSelection(page_budget=2, block=8, chunk_pages=cap))
        ref_loss, ref = _step(model, ids, **kw)
        loss, got = _step(model, ids, offload=True, **kw)
        assert torch.equal(loss, ref_loss) and all(torch.equal(got[n], g) for n, g in ref.items())
        moved[cap] = store_for_model(model).moved_bytes["to_device"]
    # Past the first chunks, 8 blocks x 2 pages = 16 rows of up to 32 past pages per layer and chunk against 2.
    assert moved[2] < 0.5 * moved[None]


def test_pools_say_whether_their_table_shares_rows():
    """A slot's table sends the pages it did not fetch to one row (LayerPools.distinct_rows False: kernels must
    accumulate gradients through it); resident layers and the device store give every page its own row."""
    from oomb.cache import PagedKVStore, PastPages, StoreSpec

    spec = StoreSpec(num_layers=3, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32,
                     grad_dtype=torch.float32, device=torch.device("cpu"))
    device = PagedKVStore(spec)
    device.reserve(1, 16)
    device.append_chunk(8)
    assert device.fetch(0, None, grads=False)[0].distinct_rows
    store = OffloadedKVStore(spec, gpu_bytes=spec.layer_bytes(4))  # the first layer's 4 pages stay on the device
    store.reserve(1, 16)
    store.append_chunk(8)
    store.append_chunk(4)
    assert store.resident_layers == 1
    assert store.fetch(0, None, grads=False)[0].distinct_rows
    pools, table = store.fetch(1, PastPages(torch.tensor([1])), grads=False)  # page 0 not fetched
    assert not pools.distinct_rows
    assert table[0, 0] == table[0, 1], "the unfetched page shares the fetched one's row"
