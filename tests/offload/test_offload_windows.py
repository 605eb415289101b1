"""An offloaded store keeps, of a sliding layer, only the host rows its window reaches (oomb/offload/host_pages.py),
and the step's gradients stay bit-identical to the device store's (which is exact: tests/engine/test_window_exact.py)
where the windows are shorter than a chunk: stage 1 gives rows up, stage 2 gets them back."""

import pytest
import torch
from helpers import copy_kernel_calls
from tiny_models import VOCAB, tiny_model

import oomb
from oomb.engine import store_for_model
from oomb.offload import OffloadedKVStore
from oomb.offload.host_pages import HostPages

WINDOW, CHUNK, PAGE = 9, 32, 4  # 2 of a chunk's 8 pages reach the next chunk


def _step(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, chunk_size=CHUNK, page_size=PAGE, **kw)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(got, ref):
    assert got[0].item() == ref[0].item()
    assert got[1].keys() == ref[1].keys()
    for name, g in ref[1].items():
        assert torch.equal(got[1][name], g), name


@pytest.mark.parametrize("family", ["gpt_oss", "mistral"])  # windows on half the layers; on every layer
@pytest.mark.parametrize("cache,recompute", [(False, "chunk"), ("host", "chunk"), (False, "layer-host"),
                                             ("host", "layer-host")])
def test_windowed_host_rows_give_the_device_stores_gradients(family, cache, recompute):
    model = tiny_model(family, sliding_window=WINDOW)
    ids = torch.randint(0, VOCAB, (2, 110))  # 4 chunks, the last ragged
    ref = _step(model, ids, cache_attention=cache, recompute=recompute)
    got = _step(model, ids, cache_attention=cache, recompute=recompute, offload=True)
    _same(got, ref)
    store = store_for_model(model)
    assert isinstance(store, OffloadedKVStore)
    spec = store.spec
    windowed = [i for i in range(spec.num_layers) if spec.window(i) is not None]
    assert windowed and all(spec.window(i) == WINDOW for i in windowed)
    # Host memory: what bytes_for plans (the memory plan's number), less than every page of every layer.
    planned = OffloadedKVStore.bytes_for(spec, 2, 110, chunk_size=CHUNK).host
    assert store.host_nbytes() == planned
    every_page = spec.num_layers * spec.layer_bytes(2 * 28)  # 2 sequences of 28 pages
    summary = spec.num_kv_heads * spec.summary_dim() * spec.dtype.itemsize  # a page's key summary, kept for all
    rows = 3 * 2 + 8 + 1  # every chunk's 2-page tail, one whole chunk, the scratch row (per sequence)
    kept = every_page - len(windowed) * 2 * (28 - rows) * (spec.layer_bytes(1) - summary)
    assert planned == kept < every_page
    assert all(g.allocator.num_used == 1 for g in store._host._groups)  # every row given back but the scratch one
    oomb.release_memory(model)


def test_windowed_rows_through_the_page_copy_kernel(monkeypatch):
    """The CUDA path (rows named by an index on the device, moved by the copy kernel), in the interpreter."""
    model = tiny_model("gpt_oss", sliding_window=WINDOW)
    ids = torch.randint(0, VOCAB, (1, 110))
    ref = _step(model, ids, cache_attention="host", recompute="layer-host")
    _step(model, ids[:, :40], offload=True)  # builds the offloaded store
    store = store_for_model(model)
    calls = copy_kernel_calls(monkeypatch, store)
    got = _step(model, ids, cache_attention="host", recompute="layer-host", offload=True)
    assert store_for_model(model) is store and calls and all(calls)
    _same(got, ref)


def test_resident_layers_keep_every_page_and_the_others_their_window():
    model = tiny_model("mistral", sliding_window=WINDOW, num_hidden_layers=3)
    ids = torch.randint(0, VOCAB, (2, 110))
    ref = _step(model, ids)
    _step(model, ids[:, :40], offload=True)
    layer = store_for_model(model).layer_nbytes(2, 110)
    got = _step(model, ids, offload=True, offload_gpu_bytes=layer + 1)  # layer 0 whole on the device
    _same(got, ref)
    store = store_for_model(model)
    assert store.resident_layers == 1
    assert store.host_nbytes() == OffloadedKVStore.bytes_for(store.spec, 2, 110, chunk_size=CHUNK,
                                                             gpu_bytes=layer + 1).host < 2 * layer


def test_a_sliding_layers_page_traffic_grows_with_its_window_not_the_past():
    # Bytes copied to the device per step: a layer that attends everything brings every past page for every chunk
    # (quadratic in the chunks), one with a 9-token window the two pages its window reaches (linear).
    def moved(family, tokens):
        model = tiny_model(family, sliding_window=WINDOW, num_hidden_layers=2)
        _step(model, torch.randint(0, VOCAB, (1, tokens)), offload=True)
        return store_for_model(model).moved_bytes["to_device"]

    assert moved("mistral", 8 * CHUNK) / moved("mistral", 4 * CHUNK) < 2.2  # 8 chunks against 4
    assert moved("llama", 8 * CHUNK) / moved("llama", 4 * CHUNK) > 3


def test_each_layers_traffic_is_counted_and_grouped_by_what_it_attends():
    # GPT-OSS alternates sliding and full layers: per layer, the sliding ones' traffic grows with the chunks (its
    # window's pages each), the full ones' with the past; the per-layer counts add up to the step's.
    from benchmarks.common import pages_moved_by_kind

    def moved(tokens):
        model = tiny_model("gpt_oss", sliding_window=WINDOW)
        _step(model, torch.randint(0, VOCAB, (1, tokens)), offload=True)
        store = store_for_model(model)
        for direction in ("to_device", "to_host"):
            assert sum(m[direction] for m in store.moved_bytes_by_layer.values()) == store.moved_bytes[direction]
        return pages_moved_by_kind(store, model.config)

    short, long = moved(4 * CHUNK), moved(8 * CHUNK)
    assert {k: v["layers"] for k, v in long.items()} == {"window": 1, "full": 1}
    assert long["window"]["per_layer_gib"] < long["full"]["per_layer_gib"]
    assert long["window"]["to_device_gib"] / short["window"]["to_device_gib"] < 2.2  # 8 chunks against 4
    assert long["full"]["to_device_gib"] / short["full"]["to_device_gib"] > 3
    device_model = tiny_model("gpt_oss", sliding_window=WINDOW)
    _step(device_model, torch.randint(0, VOCAB, (1, 64)))
    assert pages_moved_by_kind(store_for_model(device_model), device_model.config) is None  # no copies to count


def test_rows_run_out_where_chunks_outgrow_the_reservation():
    model = tiny_model("mistral", sliding_window=WINDOW)
    _step(model, torch.randint(0, VOCAB, (1, 64)), offload=True)
    store = store_for_model(model)
    store.clear()
    store.reserve(1, 96, chunk_size=16)  # rows for chunks of 16
    store.append_chunk(16)
    with pytest.raises(RuntimeError, match="reserve\\(\\) with the chunk size the step appends"):
        store.append_chunk(64)


def test_host_bytes_without_windows_are_every_page():
    model = tiny_model("llama")
    _step(model, torch.randint(0, VOCAB, (2, 100)), offload=True)
    spec = store_for_model(model).spec
    assert spec.windows is None
    assert HostPages.bytes_for(spec, 2, 100, chunk_size=CHUNK, resident=1) == (spec.num_layers - 1) * spec.layer_bytes(
        2 * 25)


@pytest.mark.gpu
@pytest.mark.parametrize("cache,recompute", [(False, "chunk"), ("host", "layer-host")])
def test_windowed_host_rows_on_the_gpu(cache, recompute):
    # The copies run on the store's own stream here, the row maps uploaded there while the compute stream runs ahead.
    model = tiny_model("gpt_oss", sliding_window=200).cuda()  # 4 of a chunk's 16 pages reach the next chunk
    ids = torch.randint(0, VOCAB, (2, 4096 + 77), device="cuda")
    results = []
    for offload in (False, True):
        model.zero_grad(set_to_none=True)
        oomb.release_memory(model)
        loss = oomb.chunked_backward(model, ids, chunk_size=1024, page_size=64, backend="triton",
                                     cache_attention=cache, recompute=recompute, offload=offload)
        results.append((loss.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                                if p.grad is not None])))
    (loss, grads), (off_loss, off_grads) = results
    assert abs(off_loss - loss) <= 1e-6 * abs(loss)
    assert ((off_grads - grads).norm() / grads.norm()).item() <= 1e-6
    store = store_for_model(model)
    assert store.host_nbytes() == OffloadedKVStore.bytes_for(store.spec, 2, 4096 + 77, chunk_size=1024).host
