"""Chunked fused linear cross-entropy against the plain logits + cross_entropy path."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_rel

from oomb.engine import loss as loss_mod
from oomb.engine.loss import linear_cross_entropy_sum


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows,block_bytes", [(37, 64 * 2**20), (37, 4 * 53 * 5)])  # one block; blocks of 5 rows
def test_chunked_linear_cross_entropy_matches_reference(with_bias, rows, block_bytes, monkeypatch):
    monkeypatch.setattr(loss_mod, "_LOGITS_BLOCK_BYTES", block_bytes)
    h = torch.randn(rows, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(53, 24, dtype=torch.float64, requires_grad=True)
    b = torch.randn(53, dtype=torch.float64, requires_grad=True) if with_bias else None
    t = torch.randint(0, 53, (rows,))
    t[::4] = -100
    out = linear_cross_entropy_sum(h, w, b, t, impl="torch")
    (out * 0.7).backward()
    grads = [h.grad.clone(), w.grad.clone()] + ([b.grad.clone()] if with_bias else [])
    for x in (h, w, b):
        if x is not None:
            x.grad = None
    ref = F.cross_entropy(F.linear(h, w, b), t, ignore_index=-100, reduction="sum")
    (ref * 0.7).backward()
    assert_close_rel(out, ref.detach(), 1e-12, "loss")
    for g, x, name in zip(grads, (h, w, b), ("dh", "dw", "db"), strict=False):
        assert_close_rel(g, x.grad, 1e-12, name)


def test_frozen_head_gets_no_gradient():
    h = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(11, 8)  # requires_grad=False: only dh is produced
    out = linear_cross_entropy_sum(h, w, None, torch.randint(0, 11, (5,)), impl="torch")
    out.backward()
    assert h.grad is not None and w.grad is None


def test_unknown_impl_raises():
    with pytest.raises(ValueError, match="cross-entropy implementation"):
        linear_cross_entropy_sum(torch.randn(2, 3), torch.randn(4, 3), None, torch.zeros(2, dtype=torch.long),
                                 impl="cce")
