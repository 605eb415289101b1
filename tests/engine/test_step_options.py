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
