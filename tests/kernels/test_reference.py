"""The PyTorch paged attention against dense float64 attention (the oracle of the oracle)."""

import pytest
import torch
from helpers import assert_close_rel
from paged_inputs import dense_attention, make_problem

from oomb.kernels.reference import paged_attention_backward, paged_attention_forward

CASES = [
    # b, h, h_kv, c, kv_len, d, page, window, sinks, block_tokens
    pytest.param(1, 4, 2, 16, 64, 16, 8, None, False, None, id="gqa-round"),
    pytest.param(2, 3, 3, 13, 45, 8, 4, None, False, 8, id="mha-odd-ragged-small-blocks"),
    pytest.param(1, 4, 1, 32, 32, 16, 16, None, False, 16, id="first-chunk-mqa"),
    pytest.param(2, 4, 2, 20, 77, 8, 8, 11, False, 16, id="sliding-window"),
    pytest.param(1, 4, 2, 12, 50, 8, 8, None, True, 8, id="sinks"),
    pytest.param(2, 6, 2, 9, 70, 8, 8, 25, True, None, id="everything"),
]


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,window,sinks,block", CASES)
def test_reference_matches_dense(b, h, h_kv, c, kv_len, d, page, window, sinks, block):
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, dtype=torch.float64, sinks=sinks)
    scale = d**-0.5
    out, lse = paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, scale=scale,
                                       sliding_window=window, sinks=pb.sinks, block_tokens=block)

    q = pb.q.clone().requires_grad_()
    k = pb.k.clone().requires_grad_()
    v = pb.v.clone().requires_grad_()
    s_ref = pb.sinks.clone().requires_grad_() if sinks else None
    ref_out, ref_lse = dense_attention(q, k, v, kv_len, scale=scale, sliding_window=window, sinks=s_ref)
    assert_close_rel(out, ref_out.detach(), 1e-12, "out")
    assert_close_rel(lse, ref_lse.detach(), 1e-12, "lse")

    d_out = torch.randn_like(out)
    ref_out.backward(d_out)
    dk_pool = torch.randn_like(pb.k_pool)  # gradients are ADDED into whatever the pool holds
    dv_pool = torch.randn_like(pb.v_pool)
    dk0, dv0 = dk_pool.clone(), dv_pool.clone()
    dq, d_sinks = paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk_pool, dv_pool,
                                           pb.page_table, kv_len, scale=scale, sliding_window=window,
                                           sinks=pb.sinks, block_tokens=block)
    assert_close_rel(dq, q.grad, 1e-12, "dq")
    if sinks:
        assert_close_rel(d_sinks, s_ref.grad, 1e-12, "d_sinks")
    else:
        assert d_sinks is None
    # Read the accumulated gradient back per token; unused pages and padding slots stay as they were.
    added_k, added_v = dk_pool - dk0, dv_pool - dv0
    for bi in range(b):
        for p in range(pb.page_table.shape[1]):
            lo, hi = p * page, min((p + 1) * page, kv_len)
            pid = pb.page_table[bi, p]
            assert_close_rel(added_k[pid, :, : hi - lo], k.grad[bi, :, lo:hi], 1e-12, f"dk page {p}")
            assert_close_rel(added_v[pid, :, : hi - lo], v.grad[bi, :, lo:hi], 1e-12, f"dv page {p}")
            assert torch.equal(added_k[pid, :, hi - lo :], torch.zeros_like(added_k[pid, :, hi - lo :]))
    used = set(pb.page_table.reshape(-1).tolist())
    for pid in range(dk_pool.shape[0]):
        if pid not in used:
            assert torch.equal(dk_pool[pid], dk0[pid]) and torch.equal(dv_pool[pid], dv0[pid])


def test_sliding_window_skips_pages_outside_every_window():
    # Pages entirely before the window are never read: poison them and the result must not change.
    pb = make_problem(1, 2, 1, 8, 64, 8, 8, dtype=torch.float64)
    out, _ = paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 64, scale=0.3,
                                     sliding_window=9)
    k_pool, v_pool = pb.k_pool.clone(), pb.v_pool.clone()
    for p in range(5):  # window of the earliest query (pos 56) starts at 48 = page 6; pages 0-4 unused
        k_pool[pb.page_table[0, p]] = float("nan")
        v_pool[pb.page_table[0, p]] = float("nan")
    out2, _ = paged_attention_forward(pb.q, k_pool, v_pool, pb.page_table, 64, scale=0.3, sliding_window=9)
    assert torch.equal(out, out2)


def test_block_size_bounds_memory_not_results():
    pb = make_problem(1, 4, 2, 16, 96, 8, 8, dtype=torch.float64)
    outs = [paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 96, scale=0.3,
                                    block_tokens=bt)[0] for bt in (8, 24, 96, 1000)]
    for o in outs[1:]:
        assert_close_rel(o, outs[0], 1e-13, "out across block sizes")


def test_bf16_inputs_stay_close_to_fp32():
    pb = make_problem(1, 4, 2, 16, 40, 16, 8, dtype=torch.float32)
    ref, _ = paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 40, scale=0.25)
    out, lse = paged_attention_forward(pb.q.bfloat16(), pb.k_pool.bfloat16(), pb.v_pool.bfloat16(),
                                       pb.page_table, 40, scale=0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close_rel(out.float(), ref, 1e-2, "bf16 out")


MASK_CASES = [
    # b, h, h_kv, c, kv_len, d, page, window, sinks, docs, select (h_sel, select_block, k)
    pytest.param(2, 4, 2, 16, 64, 8, 8, None, False, 4, None, id="docs"),
    pytest.param(1, 4, 2, 13, 45, 8, 4, 9, True, 6, None, id="docs-window-sinks-ragged"),
    pytest.param(2, 4, 2, 16, 80, 8, 8, None, False, None, (1, 8, 3), id="select-shared"),
    pytest.param(1, 6, 2, 20, 84, 8, 4, None, True, None, (2, 8, 5), id="select-per-head-ragged-block"),
    pytest.param(2, 4, 2, 16, 96, 8, 8, None, False, 5, (2, 4, 4), id="select-and-docs"),
]


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,window,sinks,docs,select", MASK_CASES)
def test_reference_documents_and_page_selection_match_dense(b, h, h_kv, c, kv_len, d, page, window, sinks,
                                                            docs, select):
    from paged_inputs import random_doc_start, random_page_select, visibility_mask

    torch.manual_seed(0)
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, dtype=torch.float64, sinks=sinks)
    doc_start = random_doc_start(b, c, kv_len, docs) if docs else None
    page_select, block = None, None
    if select:
        h_sel, block, k = select
        page_select = random_page_select(b, h_sel, c, kv_len, page, block, k)
    extra = visibility_mask(b, h, c, kv_len, page_size=page, doc_start=doc_start, page_select=page_select,
                            select_block=block)
    kw = dict(scale=d**-0.5, sliding_window=window, sinks=pb.sinks, doc_start=doc_start,
              page_select=page_select, select_block=block, block_tokens=2 * page)
    out, lse = paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    q, k, v = (t.clone().requires_grad_() for t in (pb.q, pb.k, pb.v))
    ref_out, ref_lse = dense_attention(q, k, v, kv_len, scale=d**-0.5, sliding_window=window, sinks=pb.sinks,
                                       extra_mask=extra)
    assert_close_rel(out, ref_out.detach(), 1e-12, "out")
    assert_close_rel(lse, ref_lse.detach(), 1e-12, "lse")
    d_out = torch.randn_like(out)
    ref_out.backward(d_out)
    dk_pool, dv_pool = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)
    dq, _ = paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk_pool, dv_pool,
                                     pb.page_table, kv_len, **kw)
    assert_close_rel(dq, q.grad, 1e-12, "dq")
    for bi in range(b):
        for p in range(pb.page_table.shape[1]):
            lo, hi = p * page, min((p + 1) * page, kv_len)
            pid = pb.page_table[bi, p]
            assert_close_rel(dk_pool[pid, :, : hi - lo], k.grad[bi, :, lo:hi], 1e-12, f"dk page {p}")
            assert_close_rel(dv_pool[pid, :, : hi - lo], v.grad[bi, :, lo:hi], 1e-12, f"dv page {p}")


def test_visibility_arguments_are_checked():
    pb = make_problem(1, 4, 2, 16, 64, 8, 8, dtype=torch.float64)
    args = (pb.q, pb.k_pool, pb.v_pool, pb.page_table, 64)
    with pytest.raises(ValueError, match="doc_start"):
        paged_attention_forward(*args, scale=0.3, doc_start=torch.zeros(1, 15, dtype=torch.int32))
    sel = torch.zeros(1, 1, 2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="select_block"):
        paged_attention_forward(*args, scale=0.3, page_select=sel)
    with pytest.raises(ValueError, match="page_select must be"):
        paged_attention_forward(*args, scale=0.3, page_select=sel, select_block=4)
    with pytest.raises(ValueError, match="start on a page"):
        pb2 = make_problem(1, 4, 2, 16, 60, 8, 8, dtype=torch.float64)
        paged_attention_forward(pb2.q, pb2.k_pool, pb2.v_pool, pb2.page_table, 60, scale=0.3, page_select=sel,
                                select_block=8)
