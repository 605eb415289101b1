"""The Triton paged attention (kernels/forward.py, backward.py) against the PyTorch reference
(kernels/reference.py).

Without CUDA the kernels run in the Triton interpreter on CPU, in fp32 (the interpreter's
bf16 arithmetic is silently wrong: products and sums come out as garbage), at tiny shapes. With CUDA the same cases run
compiled on the GPU, and the `gpu`-marked tests check bf16 at realistic shapes
(`pytest -m gpu tests/kernels/test_triton_attention.py`).
"""

import dataclasses
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    # Must precede the first `import triton` of the process; note that `import oomb` imports triton
    # (through transformers and torch._dynamo), so in a full test run tests/conftest.py should set it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from helpers import assert_close_rel, rel_err  # noqa: E402
from paged_inputs import make_problem  # noqa: E402

from oomb.cache.layout import first_visible_page  # noqa: E402
from oomb.kernels import backward, forward, launch, sparse_backward  # noqa: E402
from oomb.kernels import dq as dq_kernel  # noqa: E402
from oomb.kernels import reference as R  # noqa: E402
from oomb.kernels import tiles as kernel_tiles  # noqa: E402

# Without CUDA the kernels only run if triton itself was imported under the interpreter.
_INTERPRETER_MISSING = not _CUDA and type(triton.language.zeros).__name__ != "InterpretedFunction"

DEVICE = "cuda" if _CUDA else "cpu"
TOL = {"fp32": 1e-5, "bf16_grad_pool": 1e-2, "gpu_bf16": 1e-2, "gpu_lse": 1e-3}

# Tile variants (interpreter-sized) that exercise each way of addressing a key block.
SMALL = kernel_tiles.Tiles(16, 16, 1, 1, 16, 16, 16, 16, 1, 1, delta_c=16, dkdv_head_major=True)
TILES = {
    "default": None,
    "wide": dataclasses.replace(SMALL, fwd_m=32, fwd_n=32, dkdv_m=32, dkdv_n=32, dq_m=32, dq_n=32),
    "tma": dataclasses.replace(SMALL, tma=True),
    "interleaved": dataclasses.replace(SMALL, dkdv_head_major=False),  # GQA rows mixed position by position
    # dQ added inside the dK/dV kernel with atomics (dense calls); no dQ kernel.
    "fused": dataclasses.replace(SMALL, dq_fused=True),
    "fused-interleaved": dataclasses.replace(SMALL, dq_fused=True, dkdv_head_major=False),
    "fused-wide": dataclasses.replace(SMALL, dq_fused=True, dkdv_n=32),  # two row tiles per key block's diagonal
}

CASES = [
    # b, h, h_kv, c, kv_len, d, page, window, sinks, tiles
    pytest.param(1, 4, 2, 32, 96, 32, 16, None, False, "default", id="gqa-round"),
    pytest.param(2, 3, 3, 13, 45, 16, 16, None, False, "default", id="mha-odd-ragged"),
    pytest.param(1, 4, 2, 40, 40, 16, 16, None, False, "default", id="first-chunk-ragged"),
    pytest.param(2, 4, 2, 20, 77, 16, 16, 11, False, "default", id="sliding-window"),
    pytest.param(1, 4, 1, 12, 50, 16, 16, None, True, "default", id="sinks-mqa"),
    pytest.param(2, 6, 2, 9, 70, 16, 8, 25, True, "default", id="everything-multipage-blocks"),
    pytest.param(1, 4, 2, 24, 83, 16, 16, None, False, "wide", id="two-pages-per-block"),
    pytest.param(1, 4, 2, 24, 83, 16, 32, 40, False, "default", id="two-blocks-per-page"),
    pytest.param(1, 4, 2, 20, 61, 16, 24, None, True, "default", id="page-size-24"),
    pytest.param(2, 4, 2, 20, 77, 16, 32, 30, True, "tma", id="tma-window-sinks"),
    pytest.param(1, 2, 1, 16, 48, 64, 16, None, False, "default", id="head-dim-64"),
    pytest.param(1, 6, 2, 21, 83, 16, 16, None, False, "interleaved", id="interleaved-gqa-ragged"),
    pytest.param(2, 6, 2, 9, 70, 16, 8, 25, True, "interleaved", id="interleaved-window-sinks-multipage"),
]


def _use_tiles(monkeypatch, name):
    if TILES[name] is not None:
        monkeypatch.setattr(kernel_tiles, "choose_tiles", lambda head_dim, page_size, dtype: TILES[name])


class _NoLaunch:
    """Stands in for a kernel that must not be launched."""

    def __getitem__(self, grid):
        raise AssertionError("the dQ kernel was launched although the dK/dV kernel computes dQ")


def _use_fused_tiles(monkeypatch, name, sparse=False):
    """The fused-dQ tiles; a dense call must then get its dQ from the dK/dV kernel alone."""
    assert TILES[name].dq_fused
    _use_tiles(monkeypatch, name)
    if not sparse:
        monkeypatch.setattr(dq_kernel, "_bwd_dq_kernel", _NoLaunch())


@pytest.fixture(autouse=True)
def _interpreter_ready():
    if _INTERPRETER_MISSING:
        pytest.fail("no CUDA and triton was imported before TRITON_INTERPRET=1 was set (another module imported "
                    "oomb or triton first): set it at the top of tests/conftest.py")


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Every buffer a kernel fills starts as NaN, so an unwritten element fails the comparison."""

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(launch, "empty_buffer", nan_empty)


def _never_read(pb, page, window):
    """[num_pages, page] bool: slots no query may see (spare pages, pages before every window, the
    ragged tail). The kernels get NaN there; the reference gets the clean pools."""
    kv_len, c = pb.kv_len, pb.q.shape[2]
    hidden = torch.ones(pb.k_pool.shape[0], page, dtype=torch.bool, device=pb.k_pool.device)
    first = first_visible_page(kv_len, c, page, window)
    for bi in range(pb.page_table.shape[0]):
        for p in range(first, -(-kv_len // page)):
            hidden[pb.page_table[bi, p], : min(page, kv_len - p * page)] = False
    return hidden


def _poisoned(pool, hidden, value=float("nan")):
    pages, slots = hidden.nonzero(as_tuple=True)
    pool = pool.clone()
    pool[pages, :, slots] = value
    return pool


def _assert_untouched(pool, pool0, hidden):
    pages, slots = hidden.nonzero(as_tuple=True)
    assert torch.equal(pool[pages, :, slots], pool0[pages, :, slots]), "a slot no query sees was written"


def _problem(b, h, h_kv, c, kv_len, d, page, window, sinks, dtype=torch.float32):
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, dtype=dtype, device=DEVICE, sinks=sinks)
    hidden = _never_read(pb, page, window)
    return pb, hidden, _poisoned(pb.k_pool, hidden), _poisoned(pb.v_pool, hidden)


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,window,sinks,tiles", CASES)
def test_forward_matches_reference(monkeypatch, b, h, h_kv, c, kv_len, d, page, window, sinks, tiles):
    _use_tiles(monkeypatch, tiles)
    pb, _, k_pool, v_pool = _problem(b, h, h_kv, c, kv_len, d, page, window, sinks)
    kw = dict(scale=d**-0.5, sliding_window=window, sinks=pb.sinks)
    out, lse = forward.paged_attention_forward(pb.q, k_pool, v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = R.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    assert out.dtype == pb.q.dtype and lse.dtype == torch.float32
    assert_close_rel(out, ref_out, TOL["fp32"], "out")
    assert_close_rel(lse, ref_lse, TOL["fp32"], "lse")


def _check_backward(b, h, h_kv, c, kv_len, d, page, window, sinks):
    pb, hidden, k_pool, v_pool = _problem(b, h, h_kv, c, kv_len, d, page, window, sinks)
    kw = dict(scale=d**-0.5, sliding_window=window, sinks=pb.sinks)
    out, lse = R.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    d_out = torch.randn_like(out)
    # The gradient pools already hold other chunks' gradients: the kernels must ADD into them.
    dk0, dv0 = torch.randn_like(pb.k_pool), torch.randn_like(pb.v_pool)
    dk, dv, ref_dk, ref_dv = dk0.clone(), dv0.clone(), dk0.clone(), dv0.clone()

    dq, d_sinks = backward.paged_attention_backward(d_out, pb.q, out, lse, k_pool, v_pool, dk, dv, pb.page_table,
                                                    kv_len, **kw)
    ref_dq, ref_d_sinks = R.paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, ref_dk, ref_dv,
                                                     pb.page_table, kv_len, **kw)
    assert dq.dtype == pb.q.dtype
    assert_close_rel(dq, ref_dq, TOL["fp32"], "dq")
    assert_close_rel(dk - dk0, ref_dk - dk0, TOL["fp32"], "dk added")
    assert_close_rel(dv - dv0, ref_dv - dv0, TOL["fp32"], "dv added")
    if sinks:
        assert_close_rel(d_sinks, ref_d_sinks, TOL["fp32"], "d_sinks")
    else:
        assert d_sinks is None
    # Slots no query sees (spare pages, pages before the window, the ragged tail) keep their bits.
    _assert_untouched(dk, dk0, hidden)
    _assert_untouched(dv, dv0, hidden)


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,window,sinks,tiles", CASES)
def test_backward_matches_reference(monkeypatch, b, h, h_kv, c, kv_len, d, page, window, sinks, tiles):
    _use_tiles(monkeypatch, tiles)
    _check_backward(b, h, h_kv, c, kv_len, d, page, window, sinks)


FUSED_CASES = [
    # b, h, h_kv, c, kv_len, d, page, window, sinks, tiles
    pytest.param(1, 4, 2, 32, 96, 16, 16, None, False, "fused", id="gqa-round"),
    pytest.param(1, 6, 2, 21, 83, 16, 16, None, False, "fused-interleaved", id="interleaved-gqa-ragged"),
    pytest.param(2, 4, 2, 20, 77, 16, 16, 11, False, "fused", id="sliding-window-ragged"),
    pytest.param(1, 4, 1, 12, 50, 16, 16, None, True, "fused", id="sinks-mqa"),
    pytest.param(2, 6, 2, 9, 70, 16, 8, 25, True, "fused-interleaved", id="interleaved-window-sinks-multipage"),
    pytest.param(1, 4, 2, 24, 83, 16, 16, None, False, "fused-wide", id="two-pages-per-block"),
]


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,window,sinks,tiles", FUSED_CASES)
def test_fused_dq_backward_matches_reference(monkeypatch, b, h, h_kv, c, kv_len, d, page, window, sinks, tiles):
    _use_fused_tiles(monkeypatch, tiles)
    _check_backward(b, h, h_kv, c, kv_len, d, page, window, sinks)


def test_fp16_inputs_as_close_to_fp32_as_torch_fp16():
    # err(kernel) <= 2 * err(reference on the same fp16 inputs) + 1e-6, both against the fp32 reference.
    pb, _, k_pool, v_pool = _problem(1, 4, 2, 24, 70, 32, 16, None, True)
    kw = dict(scale=32**-0.5, sinks=pb.sinks)
    q16, k16, v16 = pb.q.half(), pb.k_pool.half(), pb.v_pool.half()

    def run(fwd, bwd, q, k, v, d_out):
        out, lse = fwd(q, k, v, pb.page_table, 70, **kw)
        dk, dv = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)
        dq, _ = bwd(d_out.to(q.dtype), q, out, lse, k, v, dk, dv, pb.page_table, 70, **kw)
        return {"out": out.float(), "lse": lse, "dq": dq.float(), "dk": dk, "dv": dv}

    d_out = torch.randn_like(pb.q)
    exact = run(R.paged_attention_forward, R.paged_attention_backward, pb.q, pb.k_pool, pb.v_pool, d_out)
    torch16 = run(R.paged_attention_forward, R.paged_attention_backward, q16, k16, v16, d_out)
    ours = run(forward.paged_attention_forward, backward.paged_attention_backward, q16, k_pool.half(), v_pool.half(),
               d_out)
    for name, ref in exact.items():
        assert_close_rel(ours[name], ref, 2 * rel_err(torch16[name], ref) + 1e-6, f"fp16 {name}")


def test_bf16_gradient_pools_accumulate_in_fp32():
    pb, hidden, k_pool, v_pool = _problem(2, 4, 2, 20, 53, 16, 16, None, False)
    kw = dict(scale=0.25)
    out, lse = R.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 53, **kw)
    d_out = torch.randn_like(out)
    ref_dk, ref_dv = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)
    R.paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, ref_dk, ref_dv, pb.page_table, 53, **kw)
    dk0 = (0.1 * torch.randn_like(pb.k_pool)).bfloat16()
    dv0 = (0.1 * torch.randn_like(pb.v_pool)).bfloat16()
    dk, dv = dk0.clone(), dv0.clone()
    backward.paged_attention_backward(d_out, pb.q, out, lse, k_pool, v_pool, dk, dv, pb.page_table, 53, **kw)
    assert dk.dtype == torch.bfloat16
    assert_close_rel(dk.float() - dk0.float(), ref_dk, TOL["bf16_grad_pool"], "bf16 dk added")
    assert_close_rel(dv.float() - dv0.float(), ref_dv, TOL["bf16_grad_pool"], "bf16 dv added")
    _assert_untouched(dk, dk0, hidden)
    _assert_untouched(dv, dv0, hidden)


def test_rejects_bad_inputs():
    pb = make_problem(1, 4, 2, 8, 32, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="columns"):
        forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table[:, :1], 32, scale=0.25)
    with pytest.raises(ValueError, match="newest"):
        forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 4, scale=0.25)
    with pytest.raises(ValueError, match="int32"):
        forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table.long(), 32, scale=0.25)


# --------------------------------------------------------------------------------------
# Packed documents and page-sparse attention
# --------------------------------------------------------------------------------------

MASK_CASES = [
    # b, h, h_kv, c, kv_len, d, page, window, sinks, docs, select (h_sel, select_block, k), tiles
    pytest.param(2, 4, 2, 32, 96, 16, 16, None, False, 5, None, "default", id="docs"),
    pytest.param(1, 4, 2, 20, 77, 16, 16, 11, True, 4, None, "default", id="docs-window-sinks"),
    pytest.param(1, 4, 2, 24, 83, 16, 8, None, False, 7, None, "wide", id="docs-multipage-blocks"),
    pytest.param(2, 4, 2, 32, 128, 16, 16, None, False, None, (1, 16, 3), "default", id="select-shared"),
    pytest.param(1, 6, 2, 20, 84, 16, 16, None, True, None, (2, 8, 2), "default", id="select-per-head-ragged"),
    pytest.param(1, 4, 2, 32, 160, 16, 32, None, False, None, (2, 16, 2), "wide", id="select-two-blocks-per-page"),
    pytest.param(1, 4, 2, 40, 136, 16, 16, None, False, None, (1, 32, 2), "default",
                 id="select-block-over-two-pages"),
    pytest.param(1, 4, 2, 40, 136, 16, 16, None, False, 3, (2, 32, 2), "interleaved",
                 id="select-docs-block-over-pages"),
    pytest.param(2, 4, 2, 32, 128, 16, 16, None, False, 6, (2, 16, 3), "tma", id="select-docs-tma"),
    pytest.param(1, 6, 2, 20, 84, 16, 16, None, False, 5, (2, 8, 2), "interleaved", id="select-docs-interleaved"),
    pytest.param(1, 4, 2, 20, 77, 16, 16, 11, True, 4, None, "interleaved", id="docs-window-interleaved"),
]


def _mask_problem(b, h, h_kv, c, kv_len, d, page, window, sinks, docs, select):
    from paged_inputs import random_doc_start, random_page_select

    torch.manual_seed(1)
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, device=DEVICE, sinks=sinks)
    kw = dict(scale=d**-0.5, sliding_window=window, sinks=pb.sinks)
    if docs:
        kw["doc_start"] = random_doc_start(b, c, kv_len, docs, device=DEVICE)
    if select:
        h_sel, block, k = select
        kw["page_select"] = random_page_select(b, h_sel, c, kv_len, page, block, k, device=DEVICE)
        kw["select_block"] = block
    return pb, kw


def _unselected_past_pages(pb, kw, page):
    """[num_pages, page] bool: past pages no query block selected (never to be read or written)."""
    hidden = _never_read(pb, page, kw["sliding_window"])
    sel = kw.get("page_select")
    if sel is None:
        return hidden
    n_past = (pb.kv_len - pb.q.shape[2]) // page
    for bi in range(pb.page_table.shape[0]):
        chosen = set(sel[bi].reshape(-1).tolist())
        for p in range(n_past):
            if p not in chosen:
                hidden[pb.page_table[bi, p]] = True
    return hidden


def _check_mask_backward(pb, kw, hidden, k_pool, v_pool, ref_out, ref_lse):
    kv_len = pb.kv_len
    d_out = torch.randn_like(ref_out)
    dk0, dv0 = torch.randn_like(pb.k_pool), torch.randn_like(pb.v_pool)
    dk, dv, ref_dk, ref_dv = dk0.clone(), dv0.clone(), dk0.clone(), dv0.clone()
    dq, d_sinks = backward.paged_attention_backward(d_out, pb.q, ref_out, ref_lse, k_pool, v_pool, dk, dv,
                                                    pb.page_table, kv_len, **kw)
    ref_dq, ref_d_sinks = R.paged_attention_backward(d_out, pb.q, ref_out, ref_lse, pb.k_pool, pb.v_pool, ref_dk,
                                                     ref_dv, pb.page_table, kv_len, **kw)
    assert_close_rel(dq, ref_dq, TOL["fp32"], "dq")
    assert_close_rel(dk - dk0, ref_dk - dk0, TOL["fp32"], "dk added")
    assert_close_rel(dv - dv0, ref_dv - dv0, TOL["fp32"], "dv added")
    if pb.sinks is not None:
        assert_close_rel(d_sinks, ref_d_sinks, TOL["fp32"], "d_sinks")
    # Gradient pages of unselected past pages keep their bits (never read, never written).
    _assert_untouched(dk, dk0, hidden)
    _assert_untouched(dv, dv0, hidden)


def _mask_inputs(b, h, h_kv, c, kv_len, d, page, window, sinks, docs, select):
    """(problem, kwargs, hidden slots, poisoned K and V pools)."""
    pb, kw = _mask_problem(b, h, h_kv, c, kv_len, d, page, window, sinks, docs, select)
    hidden = _unselected_past_pages(pb, kw, page)
    return pb, kw, hidden, _poisoned(pb.k_pool, hidden), _poisoned(pb.v_pool, hidden)


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,window,sinks,docs,select,tiles", MASK_CASES)
def test_documents_and_page_selection_match_reference(monkeypatch, b, h, h_kv, c, kv_len, d, page, window, sinks,
                                                      docs, select, tiles):
    _use_tiles(monkeypatch, tiles)
    pb, kw, hidden, k_pool, v_pool = _mask_inputs(b, h, h_kv, c, kv_len, d, page, window, sinks, docs, select)
    out, lse = forward.paged_attention_forward(pb.q, k_pool, v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = R.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    assert_close_rel(out, ref_out, TOL["fp32"], "out")
    assert_close_rel(lse, ref_lse, TOL["fp32"], "lse")
    _check_mask_backward(pb, kw, hidden, k_pool, v_pool, ref_out, ref_lse)


FUSED_MASK_CASES = [
    # b, h, h_kv, c, kv_len, d, page, window, sinks, docs, select (h_sel, select_block, k), tiles
    pytest.param(2, 4, 2, 32, 96, 16, 16, None, False, 5, None, "fused", id="docs"),
    pytest.param(1, 4, 2, 20, 77, 16, 16, 11, True, 4, None, "fused-interleaved", id="docs-window-sinks-interleaved"),
    # Page selection ignores dq_fused: the dQ kernel runs as without it.
    pytest.param(1, 6, 2, 20, 84, 16, 16, None, True, 5, (2, 8, 2), "fused", id="select-docs-sinks"),
    pytest.param(1, 6, 2, 20, 84, 16, 16, None, False, None, (2, 8, 2), "fused-interleaved",
                 id="select-interleaved"),
]


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,window,sinks,docs,select,tiles", FUSED_MASK_CASES)
def test_fused_dq_documents_and_page_selection_match_reference(monkeypatch, b, h, h_kv, c, kv_len, d, page, window,
                                                               sinks, docs, select, tiles):
    _use_fused_tiles(monkeypatch, tiles, sparse=select is not None)
    pb, kw, hidden, k_pool, v_pool = _mask_inputs(b, h, h_kv, c, kv_len, d, page, window, sinks, docs, select)
    ref_out, ref_lse = R.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    _check_mask_backward(pb, kw, hidden, k_pool, v_pool, ref_out, ref_lse)


def test_sparse_dkdv_work_list_orders_pages_by_attending_blocks():
    """The sparse dK/dV launch's work list: selected past pages, then the chunk's pages causally."""
    sel = torch.tensor([[[[0, 2]], [[2, 1]], [[2, 0]]]], dtype=torch.int32).transpose(1, 2)  # [1, 1, 3 blocks, 2]
    # Chunk pages: 3 (the last partial).
    hits = sparse_backward.page_hits(sel, n_past=4, c=40, select_block=16, page_size=16)
    assert hits.shape == (1, 1, 7, 3)
    assert hits[0, 0, :4].tolist() == [[1, 0, 1], [0, 1, 0], [1, 1, 1], [0, 0, 0]]
    # Chunk page j holds keys 16j ..: query block qb (queries 16qb .. 16qb + 15) attends it when qb >= j.
    assert hits[0, 0, 4:].tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]


def test_selection_of_every_past_page_equals_dense(monkeypatch):
    from paged_inputs import random_page_select

    pb = make_problem(1, 4, 2, 32, 128, 16, 16, device=DEVICE)
    n_past = (128 - 32) // 16
    sel = random_page_select(1, 2, 32, 128, 16, 16, n_past, device=DEVICE)
    dense = forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 128, scale=0.25)
    sparse = forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 128, scale=0.25,
                                             page_select=sel, select_block=16)
    assert_close_rel(sparse[0], dense[0], TOL["fp32"], "out")
    assert_close_rel(sparse[1], dense[1], TOL["fp32"], "lse")


# --------------------------------------------------------------------------------------
# bf16 at realistic shapes, on the GPU (Qwen2.5-7B heads; D=64 with GPT-OSS sinks and window)
# --------------------------------------------------------------------------------------

GPU_CASES = [
    # h, h_kv, d, page, window, sinks, tile overrides
    pytest.param(28, 4, 128, 128, None, False, {}, id="d128-page128"),
    pytest.param(28, 4, 128, 128, None, False, {"tma": False}, id="d128-page128-pointers"),
    pytest.param(28, 4, 128, 64, None, False, {}, id="d128-page64"),
    pytest.param(28, 4, 64, 128, None, False, {}, id="d64-page128"),
    pytest.param(64, 8, 64, 64, 128, True, {}, id="d64-page64-window-sinks"),
    # dQ inside the dK/dV kernel (fp32 atomics), the tune candidates `dq-fused` and `dq-fused-m32`
    pytest.param(28, 4, 128, 128, None, False, {"dq_fused": True}, id="d128-page128-dq-fused"),
    pytest.param(28, 4, 128, 128, None, False, {"dq_fused": True, "dkdv_m": 32}, id="d128-page128-dq-fused-m32"),
    pytest.param(64, 8, 64, 64, 128, True, {"dq_fused": True, "dkdv_m": 32}, id="d64-page64-window-sinks-dq-fused"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("h,h_kv,d,page,window,sinks,overrides", GPU_CASES)
def test_bf16_realistic_shapes_on_gpu(monkeypatch, h, h_kv, d, page, window, sinks, overrides):
    if overrides:
        tiles = dataclasses.replace(kernel_tiles.choose_tiles(d, page, torch.bfloat16), **overrides)
        monkeypatch.setattr(kernel_tiles, "choose_tiles", lambda *a: tiles)
    c, kv_len = 4096, 16384
    pb = make_problem(1, h, h_kv, c, kv_len, d, page, dtype=torch.bfloat16, device="cuda", sinks=sinks)
    kw = dict(scale=d**-0.5, sliding_window=window)
    s32 = pb.sinks.float() if sinks else None
    q32, k32, v32 = pb.q.float(), pb.k_pool.float(), pb.v_pool.float()

    out, lse = forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, sinks=pb.sinks, **kw)
    ref_out, ref_lse = R.paged_attention_forward(q32, k32, v32, pb.page_table, kv_len, sinks=s32, **kw)
    assert out.dtype == torch.bfloat16
    assert_close_rel(out.float(), ref_out, TOL["gpu_bf16"], "out")
    assert_close_rel(lse, ref_lse, TOL["gpu_lse"], "lse")

    d_out = torch.randn_like(pb.q)
    dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
    ref_dk, ref_dv = torch.zeros_like(k32), torch.zeros_like(v32)
    dq, d_sinks = backward.paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv, pb.page_table,
                                                    kv_len, sinks=pb.sinks, **kw)
    ref_dq, ref_d_sinks = R.paged_attention_backward(d_out.float(), q32, ref_out, ref_lse, k32, v32, ref_dk, ref_dv,
                                                     pb.page_table, kv_len, sinks=s32, **kw)
    assert_close_rel(dq.float(), ref_dq, TOL["gpu_bf16"], "dq")
    assert_close_rel(dk, ref_dk, TOL["gpu_bf16"], "dk")
    assert_close_rel(dv, ref_dv, TOL["gpu_bf16"], "dv")
    if sinks:
        assert_close_rel(d_sinks, ref_d_sinks, TOL["gpu_bf16"], "d_sinks")

    # bf16 gradient pools (the store's usual grad dtype) get the same sums, rounded once.
    dk16, dv16 = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)
    backward.paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk16, dv16, pb.page_table, kv_len,
                                      sinks=pb.sinks, **kw)
    assert_close_rel(dk16.float(), ref_dk, TOL["gpu_bf16"], "bf16 dk pool")
    assert_close_rel(dv16.float(), ref_dv, TOL["gpu_bf16"], "bf16 dv pool")


GPU_MASK_CASES = [
    # d, page, docs, select (h_sel, select_block, k), sinks
    pytest.param(128, 128, 6, None, False, id="docs-d128"),
    pytest.param(128, 128, None, (1, 128, 64), False, id="select-shared-d128"),
    pytest.param(128, 64, None, (4, 128, 64), False, id="select-per-head-page64"),
    pytest.param(64, 128, 4, (4, 64, 32), True, id="select-docs-sinks-d64"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("d,page,docs,select,sinks", GPU_MASK_CASES)
def test_bf16_documents_and_page_selection_on_gpu(d, page, docs, select, sinks):
    from paged_inputs import random_doc_start, random_page_select

    h, h_kv, c, kv_len = 28, 4, 4096, 32768
    pb = make_problem(1, h, h_kv, c, kv_len, d, page, dtype=torch.bfloat16, device="cuda", sinks=sinks)
    kw = dict(scale=d**-0.5)
    if docs:
        kw["doc_start"] = random_doc_start(1, c, kv_len, docs, device="cuda")
    if select:
        h_sel, block, k = select
        kw["page_select"] = random_page_select(1, h_sel, c, kv_len, page, block, k, device="cuda")
        kw["select_block"] = block
    s32 = pb.sinks.float() if sinks else None
    q32, k32, v32 = pb.q.float(), pb.k_pool.float(), pb.v_pool.float()
    out, lse = forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, sinks=pb.sinks, **kw)
    ref_out, ref_lse = R.paged_attention_forward(q32, k32, v32, pb.page_table, kv_len, sinks=s32, **kw)
    assert_close_rel(out.float(), ref_out, TOL["gpu_bf16"], "out")
    assert_close_rel(lse, ref_lse, TOL["gpu_lse"], "lse")
    d_out = torch.randn_like(pb.q)
    dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
    ref_dk, ref_dv = torch.zeros_like(k32), torch.zeros_like(v32)
    dq, _ = backward.paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv, pb.page_table,
                                              kv_len, sinks=pb.sinks, **kw)
    ref_dq, _ = R.paged_attention_backward(d_out.float(), q32, ref_out, ref_lse, k32, v32, ref_dk, ref_dv,
                                           pb.page_table, kv_len, sinks=s32, **kw)
    assert not torch.isnan(dq).any() and not torch.isnan(dk).any()
    assert_close_rel(dq.float(), ref_dq, TOL["gpu_bf16"], "dq")
    assert_close_rel(dk, ref_dk, TOL["gpu_bf16"], "dk")
    assert_close_rel(dv, ref_dv, TOL["gpu_bf16"], "dv")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "fa4"])
@pytest.mark.parametrize("h,h_kv,d,window", [
    pytest.param(16, 8, 256, 1024, id="gemma3-d256-window1024"),
    pytest.param(28, 4, 128, 1024, id="d128-window1024"),
    pytest.param(64, 8, 64, 128, id="gpt-oss-d64-window128"),
])
def test_pages_no_window_reaches_are_never_read_on_gpu(backend, h, h_kv, d, window):
    # A sliding layer's block table points the pages it gave up at one scratch page of stale bits (the store's
    # pools are torch.empty): keys and values no query may see hold inf here. A kernel that loads them under a mask
    # still multiplies them by zero (0 x inf = NaN) in dS K or P V: out, dq, dk and dv must stay finite and right.
    from oomb.kernels import flash4_unavailable, get_backend

    if backend == "fa4" and (reason := flash4_unavailable()) is not None:
        pytest.skip(reason)
    c, kv_len, page = 4096, 16384, 128
    pb = make_problem(1, h, h_kv, c, kv_len, d, page, dtype=torch.bfloat16, device="cuda")
    hidden = _never_read(pb, page, window)
    k_pool, v_pool = _poisoned(pb.k_pool, hidden, float("inf")), _poisoned(pb.v_pool, hidden, float("inf"))
    attention = get_backend(backend, "cuda")
    kw = dict(scale=d**-0.5, sliding_window=window)
    q32, k32, v32 = pb.q.float(), pb.k_pool.float(), pb.v_pool.float()
    out, lse = attention.forward(pb.q, k_pool, v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = R.paged_attention_forward(q32, k32, v32, pb.page_table, kv_len, **kw)
    assert_close_rel(out.float(), ref_out, TOL["gpu_bf16"], "out")
    assert_close_rel(lse, ref_lse, TOL["gpu_lse"], "lse")
    d_out = torch.randn_like(pb.q)
    dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
    ref_dk, ref_dv = torch.zeros_like(k32), torch.zeros_like(v32)
    dq, _ = attention.backward(d_out, pb.q, out, lse, k_pool, v_pool, dk, dv, pb.page_table, kv_len, **kw)
    ref_dq, _ = R.paged_attention_backward(d_out.float(), q32, ref_out, ref_lse, k32, v32, ref_dk, ref_dv,
                                           pb.page_table, kv_len, **kw)
    assert bool(torch.isfinite(dq).all()), "dq not finite: a masked key was read"
    assert_close_rel(dq.float(), ref_dq, TOL["gpu_bf16"], "dq")
    pages, slots = (~hidden).nonzero(as_tuple=True)  # the slots some query sees (the others may get zeros added)
    assert_close_rel(dk[pages, :, slots], ref_dk[pages, :, slots], TOL["gpu_bf16"], "dk")
    assert_close_rel(dv[pages, :, slots], ref_dv[pages, :, slots], TOL["gpu_bf16"], "dv")
