"""Pages in host memory (offload=True) give exactly the gradients of the device-resident store."""

import pytest
import torch
from helpers import copy_kernel_calls
from tiny_models import VOCAB, tiny_model

import oomb
from oomb.engine import StepOptions, store_for_model
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

    spec = StoreSpec.uniform(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32,
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
    from oomb.offload.copy import SYNC_ENV

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
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 160))
    kw = dict(chunk_size=32, page_size=8, selection=PageSelection(page_budget=3, block=16))
    ref_loss, ref = _step(model, ids, **kw)
    _step(model, ids[:, :40], offload=True, **kw)  # builds the offloaded store
    store = store_for_model(model)
    calls = copy_kernel_calls(monkeypatch, store)
    loss, got = _step(model, ids, offload=True, **kw)
    assert store_for_model(model) is store and calls and all(calls)  # gathers and scatters ran in the kernel
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name


@pytest.mark.parametrize("kw", [
    pytest.param({"selection": PageSelection(page_budget=3, block=16)}, id="sparse"),
    pytest.param({"selection": PageSelection(page_budget=2, block=8, chunk_pages=3)}, id="sparse-chunk-pages"),
    pytest.param({"selection": PageSelection(page_budget=3, block=16, per_head=True)}, id="sparse-per-head"),
])
def test_offload_through_the_fa4_backend_is_bit_identical(monkeypatch, kw):
    """The fa4 backend (FA4 replaced by its PyTorch stand-in) adds sparse dK/dV by gather-add-write through an
    offloaded slot's table as through the device store's: the same gradients, bit for bit."""
    from flash_standin import TorchFlash

    import oomb.engine.prepare as prepare
    from oomb.kernels import AttentionBackend, reference
    from oomb.kernels.flash4 import Flash4Attention

    kernels = TorchFlash(sparse_blocks=(8, 8))
    fallback = AttentionBackend("torch", reference.paged_attention_forward, reference.paged_attention_backward)
    attention = Flash4Attention(kernels, fallback=fallback)
    monkeypatch.setattr(prepare, "get_backend",
                        lambda name, device: AttentionBackend("fa4", attention.forward, attention.backward))
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 160))
    ref_loss, ref = _step(model, ids, chunk_size=32, page_size=8, **kw)
    sparse_calls = kernels.sparse_calls
    loss, got = _step(model, ids, chunk_size=32, page_size=8, offload=True, **kw)
    assert isinstance(store_for_model(model), OffloadedKVStore)
    assert sparse_calls > 0 and kernels.sparse_calls == 2 * sparse_calls  # FA4's block sparsity ran, both times
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


def test_a_slot_table_sends_the_pages_it_does_not_hold_to_a_row_of_their_own():
    """Each page a slot holds has its own row, and the others share one more row, which no copy reads back
    (oomb.cache.KVStore.fetch): kernels add gradients by gather-add-write as over the device store's table."""
    from oomb.cache import PastPages, StoreSpec

    spec = StoreSpec.uniform(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32,
                     grad_dtype=torch.float32, device=torch.device("cpu"))
    store = OffloadedKVStore(spec)
    store.reserve(2, 24)  # 6 pages a row
    store.append_chunk(12)
    store.append_chunk(4)  # page 3: pages 0-2 are its past
    lists = torch.tensor([[0, 2]])
    for past in (PastPages(torch.tensor([1])), PastPages.union(lists, 3)):
        pools, table = store.fetch(1, past, grads=True)
        held = {1} if past.slot_rows is None else {0, 2}
        rows = len(held) + 1  # and the chunk's page
        unheld = 2 * rows
        assert pools.k.shape[0] > unheld
        for b in range(2):
            assert [int(table[b, p]) for p in sorted(held)] == [b * rows + i for i in range(len(held))]
            assert int(table[b, 3]) == b * rows + len(held)
            assert all(int(table[b, p]) == unheld for p in (0, 1, 2, 4, 5) if p not in held)
        # What the kernels write there stays on the device: the host's gradient pages are those of the slot's rows
        pools.dk[:unheld] = 1.0
        pools.dk[unheld] = 7.0
        store.writeback(1, grads=True)
        home = store._host.home("dk", 1)
        assert (home[:, sorted(held)] == 1.0).all() and not (home == 7.0).any()
        store.free_last_chunk()
        store.append_chunk(4)




@pytest.mark.parametrize("recompute,cache", [("layer", False), ("layer-host", False), ("layer-host", "host")])
@pytest.mark.parametrize("family,kw", [CASES[0], CASES[2]])  # dense; sparse with GPT-OSS's windows and sinks
def test_offload_with_one_layer_rebuilt_at_a_time(family, kw, recompute, cache):
    # The lean setting: the pages and every layer's input in host memory, one layer's activations on the GPU. The
    # same gradients as the device store, and no more bytes moved than the whole-chunk recompute moves: each layer's
    # forward fetches what its backward (next) reads, one fill of the layer's slot.
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 200))
    ref_loss, ref = _step(model, ids, chunk_size=32, page_size=8, recompute=recompute, cache_attention=cache, **kw)
    loss, got = _step(model, ids, chunk_size=32, page_size=8, offload=True, recompute=recompute,
                      cache_attention=cache, **kw)
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name
    by_layer = dict(store_for_model(model).moved_bytes)
    _step(model, ids, chunk_size=32, page_size=8, offload=True, **kw)
    whole_chunk = store_for_model(model).moved_bytes
    assert by_layer["to_device"] <= whole_chunk["to_device"]
    # stage 1 runs the last chunk too (its K/V go home once more); a cached forward writes none home in stage 2
    assert by_layer["to_host"] <= 1.25 * whole_chunk["to_host"]


def test_offload_refuses_the_attention_cache_on_the_gpu():
    with pytest.raises(ValueError, match="cache_attention='host'"):
        StepOptions(offload=True, cache_attention=True)
