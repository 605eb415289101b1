"""Sliding-window layers keep only the pages their window reaches (oomb/cache/window_pages.py), and the step stays
exact: loss and every gradient equal full-sequence training (fp32, CPU) where the windows are shorter than a chunk,
so stage 1 gives pages up and stage 2 gets them back, with the attention output cached or not, one layer or the whole
chunk recomputed at a time."""

import pytest
import torch
from helpers import rel_err
from tiny_models import VOCAB, tiny_model

import oomb
from oomb.cache import PagedKVStore
from oomb.cache.window_pages import window_page_ids
from oomb.engine import chunked_eval, store_for_model
from oomb.engine.sizes import store_spec

TOL = 1e-5


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["gpt_oss", "mistral"])  # windows on half the layers; on every layer
@pytest.mark.parametrize("cache,recompute", [(False, "chunk"), (True, "chunk"), (True, "layer"), ("host", "layer")])
def test_windows_shorter_than_a_chunk_train_exactly(family, cache, recompute):
    model = tiny_model(family, sliding_window=9)  # 9 tokens: 2 of a chunk's 8 pages of 4 reach the next chunk
    ids = torch.randint(0, VOCAB, (2, 110))  # 4 chunks of 32, the last ragged
    model.zero_grad(set_to_none=True)
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=4, cache_attention=cache, recompute=recompute)
    assert rel_err(loss, ref.detach()) <= TOL
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys()
    errors = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: relative gradient error {errors[worst]:.2e}"

    store = store_for_model(model)
    windowed = [i for i, w in enumerate(store.spec.windows) if w is not None]
    assert windowed and all(store.spec.windows[i] == 9 for i in windowed)
    kept = window_page_ids(9, batch_size=2, num_tokens=110, page_size=4, chunk_size=32)
    assert kept == 2 * (3 * 2 + 8) + 1  # every chunk's 2-page tail, one whole chunk, the scratch page
    assert all(store.layer(i).k.shape[0] == kept for i in windowed)  # against 2 x 28 pages kept by full layers
    assert store.window_pages_used() == {9: 1}  # all given back after the step (the scratch page stays)
    # The memory plan counts the store the engine allocates where the config lists its layers' types (GPT-OSS);
    # where it does not (Mistral), every page: an upper bound.
    planned = store_spec(model.config, page_size=4, dtype=torch.float32, grad_dtype=None, device="cpu")
    if family == "gpt_oss":
        assert planned == store.spec
    else:
        assert planned.windows is None
        assert (PagedKVStore.bytes_for(planned, 2, 110, chunk_size=32).device
                > PagedKVStore.bytes_for(store.spec, 2, 110, chunk_size=32).device)
    oomb.release_memory(model)


def test_a_chunked_evaluation_keeps_the_tails_only():
    model = tiny_model("gpt_oss", sliding_window=9)
    ids = torch.randint(0, VOCAB, (1, 128))
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids).loss
    nll = chunked_eval(model, ids, chunk_size=32, page_size=4).nll
    assert rel_err(nll.nanmean(), ref) <= TOL
    store = store_for_model(model)
    assert not store.spec.gradients
    assert store.layer(0).k.shape[0] == window_page_ids(9, batch_size=1, num_tokens=128, page_size=4, chunk_size=32)
