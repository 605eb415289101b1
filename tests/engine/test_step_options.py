"""chunked_backward's hooks for data parallel training: loss_divisor and before_last_backward."""

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import oomb


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_loss_divisor_replaces_the_target_count():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 100))
    n_targets = 2 * 99
    loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    scaled = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, loss_divisor=n_targets / 4)
    torch.testing.assert_close(scaled, loss * 4, rtol=1e-6, atol=0)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name] * 4, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="loss_divisor must be positive"):
        oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, loss_divisor=0)


def test_before_last_backward_runs_once_before_the_backward_of_chunk_0():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 100))  # 4 chunks of 32: backwards of chunks 3, 2, 1, then 0
    backwards, seen = [], []
    model.get_input_embeddings().weight.register_hook(lambda grad: backwards.append(1))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=16,
                          before_last_backward=lambda: seen.append(len(backwards)))
    assert seen == [3]  # called once, after 3 chunk backwards and before the 4th
    assert len(backwards) == 4


@pytest.mark.parametrize("family,kw", [
    ("llama", {}),
    ("qwen2", {"page_budget": 2}),  # page-sparse: stage 2 reuses stage 1's page lists and outputs
    ("gpt_oss", {"doc_ids": "two-documents"}),  # sinks, sliding-window layers, packed documents
])
def test_cached_attention_outputs_give_the_same_gradients(family, kw):
    """Stage 2 reusing stage 1's attention outputs is the same computation, so the same bits."""
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 150))
    if kw.get("doc_ids") == "two-documents":
        kw = {"doc_ids": (torch.arange(150) >= 70).long().expand(2, -1)}
    results = []
    for cache in (False, True):
        model.zero_grad(set_to_none=True)
        loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, cache_attention=cache, **kw)
        results.append((loss, _grads(model)))
    (loss, grads), (cached_loss, cached_grads) = results
    assert torch.equal(loss, cached_loss)
    assert grads.keys() == cached_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, cached_grads[name]), name


def test_cached_attention_calls_the_kernels_once_less_per_chunk_and_layer(monkeypatch):
    from oomb.kernels import reference

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 128))  # 4 chunks of 32
    layers = model.config.num_hidden_layers
    calls = []
    original = reference.paged_attention_forward
    monkeypatch.setattr(reference, "paged_attention_forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    counts = {}
    for cache in (False, True):
        calls.clear()
        oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, backend="torch", cache_attention=cache)
        counts[cache] = len(calls)
    # Without the cache: stage 1 (3 chunks) + stage 2 (4 chunks); with it, stage 2 attends only the last.
    assert counts[False] == (3 + 4) * layers
    assert counts[True] == (3 + 1) * layers


def test_cached_attention_refuses_offload():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="use cache_attention='host' \\(in host memory\\) or False"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 64)), chunk_size=32, page_size=16,
                              cache_attention=True, offload=True)
