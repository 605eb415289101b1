"""Key and value head sizes in every attention backend: latent attention (Dk != Dv, as DeepSeek-V2/V3's
multi-head latent attention hands transformers' attention function: keys of 192, values of 128) and sizes
that are not powers of two (Phi-3's 96, 80, ...).

- ``torch`` (kernels/reference.py) against dense float64 attention, exactly;
- ``triton`` in the interpreter (fp32, tiny shapes, padded head tiles: 24 in 32, 48 in 64, 40 in 64)
  against the reference: out, lse, dq, the dK/dV added into the pools, d_sinks;
- ``fa4`` through the FA4 stand-in (flash_standin.py, which checks head sizes as FA4 4.0.0b40 does on
  Hopper): what FA4 runs goes to it, the rest to the fallback, forward and backward alike;
- the package docstring's claims (kernels/__init__.py).

On a GPU: ``pytest -m gpu tests/kernels/test_head_sizes.py`` (bf16 accuracy of the Triton kernels and FA4
at realistic shapes, and the padded tiles' speed against d=128's).
"""

import dataclasses
import os
import time

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` (tests/conftest.py too)

from flash_standin import FallbackSpy, TorchFlash  # noqa: E402
from helpers import assert_close_rel  # noqa: E402
from paged_inputs import (  # noqa: E402
    dense_attention,
    make_problem,
    random_doc_start,
    random_page_select,
    visibility_mask,
)

import oomb.kernels  # noqa: E402
from oomb.cache.layout import first_visible_page  # noqa: E402
from oomb.kernels import AttentionBackend, reference  # noqa: E402
from oomb.kernels.flash4 import Flash4Attention  # noqa: E402
from oomb.kernels.flash4_calls import FA4_MIN_HEAD_DIM, fa4_supports_head_dims  # noqa: E402

DEVICE = "cuda" if _CUDA else "cpu"
TOL = {"fp64": 1e-12, "fp32": 1e-5, "stand-in": 1e-10, "gpu_bf16": 1e-2, "gpu_lse": 1e-3}
REFERENCE = AttentionBackend("torch", reference.paged_attention_forward, reference.paged_attention_backward)


@pytest.fixture
def triton_kernels(monkeypatch):
    """(forward, backward, tiles module) of the Triton backend, every buffer a kernel fills poisoned with NaN."""
    triton = pytest.importorskip("triton")
    if not _CUDA and type(triton.language.zeros).__name__ != "InterpretedFunction":
        pytest.fail("no CUDA and triton was imported before TRITON_INTERPRET=1 was set")
    from oomb.kernels import backward, forward, launch, tiles

    monkeypatch.setattr(launch, "empty_buffer",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))
    return forward, backward, tiles


# --------------------------------------------------------------------------------------
# torch: the reference against dense float64 attention
# --------------------------------------------------------------------------------------

REFERENCE_CASES = [
    # b, h, h_kv, c, kv_len, dk, dv, page, window, sinks, docs, select (h_sel, select_block, k)
    pytest.param(1, 4, 2, 16, 64, 12, 8, 8, None, False, None, None, id="dk12-dv8-gqa"),
    pytest.param(2, 4, 2, 13, 45, 24, 5, 4, 9, True, 6, None, id="dk24-dv5-window-sinks-docs-ragged"),
    pytest.param(1, 6, 2, 20, 84, 8, 20, 4, None, True, 5, (2, 8, 5), id="dk8-dv20-select-docs-sinks"),
]


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,dk,dv,page,window,sinks,docs,select", REFERENCE_CASES)
def test_reference_with_key_and_value_head_sizes_matches_dense(b, h, h_kv, c, kv_len, dk, dv, page, window, sinks,
                                                               docs, select):
    pb = make_problem(b, h, h_kv, c, kv_len, dk, page, dtype=torch.float64, sinks=sinks, d_v=dv)
    doc_start = random_doc_start(b, c, kv_len, docs) if docs else None
    page_select, block = None, None
    if select:
        h_sel, block, k = select
        page_select = random_page_select(b, h_sel, c, kv_len, page, block, k)
    extra = visibility_mask(b, h, c, kv_len, page_size=page, doc_start=doc_start, page_select=page_select,
                            select_block=block)
    scale = 0.37  # given, not Dk ** -0.5 (latent attention scales by its own rule)
    kw = dict(scale=scale, sliding_window=window, sinks=pb.sinks, doc_start=doc_start, page_select=page_select,
              select_block=block, block_tokens=2 * page)
    out, lse = reference.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    q, k, v = (t.clone().requires_grad_() for t in (pb.q, pb.k, pb.v))
    s_ref = pb.sinks.clone().requires_grad_() if sinks else None
    ref_out, ref_lse = dense_attention(q, k, v, kv_len, scale=scale, sliding_window=window, sinks=s_ref,
                                       extra_mask=extra)
    assert out.shape == (b, h, c, dv)
    assert_close_rel(out, ref_out.detach(), TOL["fp64"], "out")
    assert_close_rel(lse, ref_lse.detach(), TOL["fp64"], "lse")

    d_out = torch.randn_like(out)
    ref_out.backward(d_out)
    dk_pool, dv_pool = torch.randn_like(pb.k_pool), torch.randn_like(pb.v_pool)  # gradients are ADDED
    dk0, dv0 = dk_pool.clone(), dv_pool.clone()
    dq, d_sinks = reference.paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk_pool, dv_pool,
                                                     pb.page_table, kv_len, **kw)
    assert dq.shape == (b, h, c, dk)
    assert_close_rel(dq, q.grad, TOL["fp64"], "dq")
    if sinks:
        assert_close_rel(d_sinks, s_ref.grad, TOL["fp64"], "d_sinks")
    for bi in range(b):
        for p in range(pb.page_table.shape[1]):
            lo, hi = p * page, min((p + 1) * page, kv_len)
            pid = pb.page_table[bi, p]
            assert_close_rel(dk_pool[pid, :, : hi - lo] - dk0[pid, :, : hi - lo], k.grad[bi, :, lo:hi], TOL["fp64"],
                             f"dk page {p}")
            assert_close_rel(dv_pool[pid, :, : hi - lo] - dv0[pid, :, : hi - lo], v.grad[bi, :, lo:hi], TOL["fp64"],
                             f"dv page {p}")


def test_shapes_that_do_not_fit_are_refused_with_what_is_wrong():
    pb = make_problem(1, 4, 2, 8, 32, 16, 8, dtype=torch.float64, d_v=8)
    args = (pb.page_table, 32)
    with pytest.raises(ValueError, match="head size 16 must equal k_pool's 12"):
        reference.paged_attention_forward(pb.q, pb.k_pool[..., :12], pb.v_pool, *args, scale=0.25)
    with pytest.raises(ValueError, match="v_pool .* must be"):
        reference.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool[:, :1], *args, scale=0.25)
    out, lse = reference.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, *args, scale=0.25)
    dk, dv = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)
    with pytest.raises(ValueError, match=r"d_out .* must be \[B, H, C, Dv\]"):
        reference.paged_attention_backward(torch.zeros_like(pb.q), pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv,
                                           *args, scale=0.25)
    with pytest.raises(ValueError, match="dk_pool .* must match"):
        reference.paged_attention_backward(torch.zeros_like(out), pb.q, out, lse, pb.k_pool, pb.v_pool, dv, dk,
                                           *args, scale=0.25)


# --------------------------------------------------------------------------------------
# triton: the kernels (interpreter on CPU) against the reference
# --------------------------------------------------------------------------------------

def _tiles(name, tiles_module):
    small = tiles_module.Tiles(16, 16, 1, 1, 16, 16, 16, 16, 1, 1, delta_c=16, dkdv_head_major=True)
    return {"default": small, "tma": dataclasses.replace(small, tma=True),
            "interleaved": dataclasses.replace(small, dkdv_head_major=False),
            "fused": dataclasses.replace(small, dq_fused=True)}[name]


def _hidden_slots(pb, page, window, page_select):
    """[num_pages, page] bool: slots no query sees (spare pages, pages before every window, the ragged tail, past
    pages no query block selected): the kernels get NaN there and must not write their gradient slots."""
    kv_len, c = pb.kv_len, pb.q.shape[2]
    hidden = torch.ones(pb.k_pool.shape[0], page, dtype=torch.bool)
    first = first_visible_page(kv_len, c, page, window)
    n_past = (kv_len - c) // page
    for bi in range(pb.page_table.shape[0]):
        chosen = set(range(n_past)) if page_select is None else set(page_select[bi].reshape(-1).tolist())
        for p in range(first, -(-kv_len // page)):
            if p >= n_past or p in chosen:
                hidden[pb.page_table[bi, p], : min(page, kv_len - p * page)] = False
    return hidden


def _poisoned(pool, hidden):
    pages, slots = hidden.nonzero(as_tuple=True)
    pool = pool.clone()
    pool[pages, :, slots] = float("nan")
    return pool


def _strided_like(pool, width):
    """``pool``'s values in a view whose rows are ``width`` apart: another stride than a contiguous pool's."""
    wide = torch.full((*pool.shape[:-1], width), float("nan"), dtype=pool.dtype, device=pool.device)
    view = wide[..., : pool.shape[-1]]
    view.copy_(pool)
    return view


TRITON_CASES = [
    # b, h, h_kv, c, kv_len, dk, dv, page, window, sinks, docs, select (h_sel, select_block, k), tiles, strided_v
    # TMA asked for, but padded heads read through pointers (launch.kv_descriptors).
    pytest.param(1, 4, 2, 20, 61, 24, 16, 16, None, False, None, None, "tma", False, id="dk24-dv16-gqa-ragged"),
    # Equal padded sizes; V and its gradient pool with other strides than K's (no shared offsets).
    pytest.param(2, 4, 2, 20, 77, 24, 24, 16, 11, True, None, None, "default", True, id="d24-window-sinks-strided-v"),
    # Every option at once (a window does not combine with a page selection).
    pytest.param(1, 6, 2, 20, 84, 48, 32, 16, None, True, 5, (2, 8, 2), "interleaved", False,
                 id="dk48-dv32-sinks-docs-select-interleaved"),
    # Whole tiles of different widths through TMA descriptors.
    pytest.param(1, 4, 2, 24, 83, 32, 16, 16, None, False, None, None, "tma", False, id="dk32-dv16-tma"),
    pytest.param(1, 4, 2, 21, 83, 24, 16, 16, 30, False, 4, None, "fused", False, id="dk24-dv16-fused-dq-window-docs"),
    # Values wider than keys; key blocks over two pages of 8.
    pytest.param(2, 3, 3, 13, 45, 16, 40, 8, None, False, None, None, "default", False, id="dk16-dv40-mha-pages-of-8"),
]


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,dk,dv,page,window,sinks,docs,select,tiles,strided_v", TRITON_CASES)
def test_triton_with_key_and_value_head_sizes_matches_reference(triton_kernels, monkeypatch, b, h, h_kv, c, kv_len,
                                                                dk, dv, page, window, sinks, docs, select, tiles,
                                                                strided_v):
    forward, backward, tiles_module = triton_kernels
    chosen = _tiles(tiles, tiles_module)
    monkeypatch.setattr(tiles_module, "choose_tiles", lambda head_dim, page_size, dtype: chosen)
    torch.manual_seed(1)
    pb = make_problem(b, h, h_kv, c, kv_len, dk, page, device=DEVICE, sinks=sinks, d_v=dv)
    kw = dict(scale=0.3, sliding_window=window, sinks=pb.sinks)
    if docs:
        kw["doc_start"] = random_doc_start(b, c, kv_len, docs, device=DEVICE)
    if select:
        h_sel, block, k = select
        kw["page_select"] = random_page_select(b, h_sel, c, kv_len, page, block, k, device=DEVICE)
        kw["select_block"] = block
    hidden = _hidden_slots(pb, page, window, kw.get("page_select"))
    k_pool, v_pool = _poisoned(pb.k_pool, hidden), _poisoned(pb.v_pool, hidden)
    v_ref = pb.v_pool
    if strided_v:
        v_pool, v_ref = _strided_like(v_pool, dv + 8), _strided_like(pb.v_pool, dv + 8)

    out, lse = forward.paged_attention_forward(pb.q, k_pool, v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = reference.paged_attention_forward(pb.q, pb.k_pool, v_ref, pb.page_table, kv_len, **kw)
    assert out.shape == (b, h, c, dv) and out.dtype == pb.q.dtype
    assert_close_rel(out, ref_out, TOL["fp32"], "out")
    assert_close_rel(lse, ref_lse, TOL["fp32"], "lse")

    d_out = torch.randn_like(ref_out)
    dk0, dv0 = torch.randn_like(pb.k_pool), torch.randn_like(pb.v_pool)  # other chunks' sums: ADDED to
    dk_pool, ref_dk = dk0.clone(), dk0.clone()
    dv_pool = _strided_like(dv0, dv + 8) if strided_v else dv0.clone()
    ref_dv = dv0.clone()
    dq, d_sinks = backward.paged_attention_backward(d_out, pb.q, ref_out, ref_lse, k_pool, v_pool, dk_pool, dv_pool,
                                                    pb.page_table, kv_len, **kw)
    ref_dq, ref_d_sinks = reference.paged_attention_backward(d_out, pb.q, ref_out, ref_lse, pb.k_pool, v_ref, ref_dk,
                                                             ref_dv, pb.page_table, kv_len, **kw)
    assert dq.shape == (b, h, c, dk)
    assert_close_rel(dq, ref_dq, TOL["fp32"], "dq")
    assert_close_rel(dk_pool - dk0, ref_dk - dk0, TOL["fp32"], "dk added")
    assert_close_rel(dv_pool - dv0, ref_dv - dv0, TOL["fp32"], "dv added")
    if sinks:
        assert_close_rel(d_sinks, ref_d_sinks, TOL["fp32"], "d_sinks")
    pages, slots = hidden.nonzero(as_tuple=True)
    assert torch.equal(dk_pool[pages, :, slots], dk0[pages, :, slots]), "a dK slot no query sees was written"
    assert torch.equal(dv_pool[pages, :, slots], dv0[pages, :, slots]), "a dV slot no query sees was written"


def test_triton_takes_head_sizes_up_to_256_and_says_so_above(triton_kernels):
    forward, _, _ = triton_kernels
    from oomb.kernels import launch

    assert [launch.head_block(d) for d in (1, 16, 24, 80, 96, 128, 192, 256)] == [16, 16, 32, 128, 128, 128, 256, 256]
    assert launch.tile_head_dim(192, 128) == 256
    pb = make_problem(1, 2, 1, 8, 16, 264, 16, device=DEVICE, d_v=8)
    with pytest.raises(ValueError, match=r"head sizes 1 \.\. 256; got Dk=264, Dv=8"):
        forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 16, scale=0.1)


def test_compiled_tiles_for_wide_heads_are_smaller(monkeypatch):
    # What a GPU gets (the interpreter's tiles are small whatever the head): heads padded past 128 keep fewer
    # keys per block and fewer stages (registers, shared memory); d <= 128 keeps its measured tiles.
    pytest.importorskip("triton")
    from oomb.kernels import tiles

    monkeypatch.setattr(tiles, "interpreting", lambda: False)
    usual = tiles.choose_tiles(128, 128, torch.bfloat16)
    wide = tiles.choose_tiles(256, 128, torch.bfloat16)
    assert (usual.fwd_m, usual.fwd_n, usual.fwd_stages, usual.dkdv_n) == (128, 128, 3, 128)  # d <= 128 unchanged
    assert wide.fwd_n * wide.fwd_stages < usual.fwd_n * usual.fwd_stages  # K/V stages in shared memory
    assert wide.dkdv_n < usual.dkdv_n and wide.dq_m < usual.dq_m  # fp32 accumulators [rows, 256] in registers


# --------------------------------------------------------------------------------------
# fa4: FA4 where it runs the head sizes, the fallback elsewhere (through the stand-in)
# --------------------------------------------------------------------------------------

def test_what_fa4_runs_follows_its_source():
    # flash-attn-4 4.0.0b40 on Hopper: 8..256, multiples of 8, Dk != Dv only without grouped KV heads.
    assert fa4_supports_head_dims(9, 192, 128, grouped=False)  # DeepSeek-V2/V3 latent attention
    assert not fa4_supports_head_dims(9, 192, 128, grouped=True)  # FA4's SM90 GQA backward wants Dk == Dv
    assert fa4_supports_head_dims(9, 96, 96, grouped=True) and fa4_supports_head_dims(9, 80, 80, grouped=True)
    assert fa4_supports_head_dims(9, 72, 72, grouped=True) and fa4_supports_head_dims(9, 256, 256, grouped=True)
    assert not fa4_supports_head_dims(9, 264, 264, grouped=False)
    assert not fa4_supports_head_dims(9, 20, 20, grouped=False) and not fa4_supports_head_dims(9, 4, 4, False)
    # Below 64 on either: measured wrong (16) or not compiling (24 with 16) on an H100.
    assert not fa4_supports_head_dims(9, 16, 16, grouped=True) and not fa4_supports_head_dims(9, 24, 16, False)
    assert not fa4_supports_head_dims(9, 56, 56, grouped=False) and fa4_supports_head_dims(9, 64, 64, grouped=True)
    # Blackwell: what oomb has run there, equal sizes up to 128.
    assert fa4_supports_head_dims(10, 128, 128, grouped=True) and fa4_supports_head_dims(10, 96, 96, grouped=True)
    assert not fa4_supports_head_dims(10, 192, 128, grouped=False)
    assert not fa4_supports_head_dims(10, 256, 256, grouped=False)


FA4_CASES = [
    # b, h, h_kv, c, kv_len, dk, dv, page, window, docs, key_segment, calls per direction
    pytest.param(1, 3, 3, 16, 64, 96, 64, 8, None, None, None, 1, id="mha-dk96-dv64"),
    pytest.param(2, 3, 3, 13, 77, 192, 128, 8, 20, 4, None, 1, id="mha-dk192-dv128-window-documents"),
    pytest.param(1, 2, 2, 13, 77, 64, 128, 8, None, None, 16, 5, id="mha-dk64-dv128-segments"),
    pytest.param(1, 4, 2, 16, 64, 72, 72, 8, None, 3, None, 1, id="gqa-d72-documents"),
]


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,dk,dv,page,window,docs,key_segment,calls", FA4_CASES)
def test_fa4_runs_the_head_sizes_it_supports(b, h, h_kv, c, kv_len, dk, dv, page, window, docs, key_segment, calls):
    torch.manual_seed(0)
    pb = make_problem(b, h, h_kv, c, kv_len, dk, page, dtype=torch.float64, d_v=dv)
    kw = dict(scale=0.3, sliding_window=window)
    if docs:
        kw["doc_start"] = random_doc_start(b, c, kv_len, docs)
    kernels, spy = TorchFlash(), FallbackSpy()
    attention = Flash4Attention(kernels, fallback=spy, **({"key_segment": key_segment} if key_segment else {}))
    out, lse = attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = reference.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    assert_close_rel(out, ref_out, TOL["stand-in"], "out")
    assert_close_rel(lse, ref_lse, TOL["stand-in"], "lse")
    d_out = torch.randn_like(out)
    dk0, dv0 = torch.randn_like(pb.k_pool), torch.randn_like(pb.v_pool)
    dk, dv, ref_dk, ref_dv = dk0.clone(), dv0.clone(), dk0.clone(), dv0.clone()
    dq, _ = attention.backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv, pb.page_table, kv_len, **kw)
    ref_dq, _ = reference.paged_attention_backward(d_out, pb.q, ref_out, ref_lse, pb.k_pool, pb.v_pool, ref_dk,
                                                   ref_dv, pb.page_table, kv_len, **kw)
    assert spy.calls == [] and kernels.calls == 2 * calls, "the stand-in for FA4 ran both directions"
    assert_close_rel(dq, ref_dq, TOL["stand-in"], "dq")
    assert_close_rel(dk - dk0, ref_dk - dk0, TOL["stand-in"], "dk added")
    assert_close_rel(dv - dv0, ref_dv - dv0, TOL["stand-in"], "dv added")


def test_fa4_block_sparsity_with_latent_head_sizes():
    b, h, c, n_past, dk, dv, page = 1, 2, 16, 6, 96, 64, 8
    kv_len = c + n_past * page
    pb = make_problem(b, h, h, c, kv_len, dk, page, dtype=torch.float64, d_v=dv)
    kw = dict(scale=0.3, page_select=random_page_select(b, 1, c, kv_len, page, 8, 2), select_block=8)
    kernels = TorchFlash(sparse_blocks=(8, page))
    attention = Flash4Attention(kernels, fallback=None)
    out, lse = attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = reference.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    assert_close_rel(out, ref_out, TOL["stand-in"], "out")
    d_out = torch.randn_like(out)
    dk, dv, ref_dk, ref_dv = (torch.zeros_like(x) for x in (pb.k_pool, pb.v_pool, pb.k_pool, pb.v_pool))
    dq, _ = attention.backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv, pb.page_table, kv_len, **kw)
    ref_dq, _ = reference.paged_attention_backward(d_out, pb.q, ref_out, ref_lse, pb.k_pool, pb.v_pool, ref_dk,
                                                   ref_dv, pb.page_table, kv_len, **kw)
    assert kernels.sparse_calls == 2
    assert_close_rel(dq, ref_dq, TOL["stand-in"], "dq")
    assert_close_rel(dk, ref_dk, TOL["stand-in"], "dk")
    assert_close_rel(dv, ref_dv, TOL["stand-in"], "dv")


@pytest.mark.parametrize("what", ["gqa-dk-ne-dv", "not-a-multiple-of-8", "too-wide", "too-small"])
def test_head_sizes_fa4_does_not_run_go_to_the_fallback_in_both_directions(what):
    h, h_kv, dk, dv = {"gqa-dk-ne-dv": (4, 2, 96, 64), "not-a-multiple-of-8": (4, 2, 68, 68),
                       "too-wide": (2, 2, 264, 64), "too-small": (4, 2, 16, 16)}[what]
    pb = make_problem(1, h, h_kv, 8, 24, dk, 8, dtype=torch.float64, d_v=dv)
    spy = FallbackSpy()
    kernels = TorchFlash()
    kernels.min_head_dim = FA4_MIN_HEAD_DIM  # oomb's, not the stand-in's
    attention = Flash4Attention(kernels, fallback=spy)
    out, lse = attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 24, scale=0.3)
    dk_pool, dv_pool = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)
    attention.backward(torch.ones_like(out), pb.q, out, lse, pb.k_pool, pb.v_pool, dk_pool, dv_pool, pb.page_table,
                       24, scale=0.3)
    assert spy.calls == ["forward", "backward"] and kernels.calls == 0


def test_the_stand_in_refuses_what_fa4_refuses():
    # So the tests above would see a call handed to FA4 that it cannot run.
    q, k, v = torch.zeros(1, 8, 4, 24), torch.zeros(1, 8, 2, 24), torch.zeros(1, 8, 2, 16)
    layout = dataclasses.make_dataclass("Layout", [("varlen", bool)])(False)
    with pytest.raises(AssertionError, match="GQA backward requires head_dim == head_dim_v"):
        TorchFlash().backward(torch.zeros(1, 8, 4, 16), q, k, v, torch.zeros(1, 8, 4, 16), torch.zeros(1, 4, 8),
                              scale=1.0, window_left=None, layout=layout)
    with pytest.raises(AssertionError, match="not supported on SM90"):
        TorchFlash().forward(q[..., :20], k[..., :20], v, scale=1.0, window_left=None, layout=layout)


# --------------------------------------------------------------------------------------
# The package docstring says what each backend takes
# --------------------------------------------------------------------------------------

def test_package_docstring_states_what_each_backend_takes():
    doc = " ".join(oomb.kernels.__doc__.split())
    from oomb.kernels import launch

    # torch: any sizes.
    assert "``torch``: any Dk and Dv" in doc
    pb = make_problem(1, 2, 1, 4, 9, 5, 4, dtype=torch.float64, d_v=3)
    out, _ = reference.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 9, scale=0.3)
    assert out.shape[-1] == 3
    # triton: 1 .. 256 each, padded to a power of two >= 16.
    assert f"Dk and Dv each 1 .. {launch.MAX_HEAD_DIM}" in doc
    assert "padded to one (96 in 128, 192 in 256)" in doc
    assert (launch.head_block(96), launch.head_block(192)) == (128, 256)
    # fa4: FA4's rule, named, with the examples the docstring gives.
    assert "flash4_calls.fa4_supports_head_dims" in doc
    assert "on Hopper Dk and Dv each a multiple of 8 from 64 to 256" in doc
    assert all(fa4_supports_head_dims(9, d, d, grouped=True) for d in range(64, 257, 8))
    assert not any(fa4_supports_head_dims(9, d, d, grouped=True) for d in (4, 16, 56, 100, 264))
    assert "Dk != Dv only with as many KV heads as query heads" in doc
    assert fa4_supports_head_dims(9, 192, 128, grouped=False) and not fa4_supports_head_dims(9, 192, 128, True)
    assert "on Blackwell equal sizes, multiples of 8 from 64 to 128" in doc
    assert fa4_supports_head_dims(10, 128, 128, True) and not fa4_supports_head_dims(10, 136, 136, True)
    assert not fa4_supports_head_dims(10, 64, 32, grouped=False)


# --------------------------------------------------------------------------------------
# bf16 on the GPU
# --------------------------------------------------------------------------------------

GPU_CASES = [
    # h, h_kv, dk, dv, page, window
    pytest.param(16, 16, 192, 128, 128, None, id="deepseek-mla-dk192-dv128"),
    pytest.param(32, 8, 96, 96, 128, None, id="phi3-d96-gqa"),
    pytest.param(28, 4, 80, 80, 64, 1024, id="d80-page64-window"),
    pytest.param(8, 8, 256, 256, 128, None, id="d256"),
    pytest.param(28, 4, 128, 64, 128, None, id="dk128-dv64-tma"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("h,h_kv,dk,dv,page,window", GPU_CASES)
def test_triton_bf16_head_sizes_on_gpu(h, h_kv, dk, dv, page, window):
    from oomb.kernels import backward, forward

    c, kv_len = 2048, 8192
    pb = make_problem(1, h, h_kv, c, kv_len, dk, page, dtype=torch.bfloat16, device="cuda", d_v=dv)
    kw = dict(scale=dk**-0.5, sliding_window=window)
    q32, k32, v32 = pb.q.float(), pb.k_pool.float(), pb.v_pool.float()
    out, lse = forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = reference.paged_attention_forward(q32, k32, v32, pb.page_table, kv_len, **kw)
    assert_close_rel(out.float(), ref_out, TOL["gpu_bf16"], "out")
    assert_close_rel(lse, ref_lse, TOL["gpu_lse"], "lse")
    d_out = torch.randn_like(out)
    dk_pool, dv_pool = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)  # bf16, as the store's
    ref_dk, ref_dv = torch.zeros_like(k32), torch.zeros_like(v32)
    dq, _ = backward.paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk_pool, dv_pool,
                                              pb.page_table, kv_len, **kw)
    ref_dq, _ = reference.paged_attention_backward(d_out.float(), q32, ref_out, ref_lse, k32, v32, ref_dk, ref_dv,
                                                   pb.page_table, kv_len, **kw)
    assert_close_rel(dq.float(), ref_dq, TOL["gpu_bf16"], "dq")
    assert_close_rel(dk_pool.float(), ref_dk, TOL["gpu_bf16"], "dk")
    assert_close_rel(dv_pool.float(), ref_dv, TOL["gpu_bf16"], "dv")


def _fwd_bwd_seconds(dk, dv, h=32, h_kv=8, c=4096, kv_len=16384, page=128, reps=5):
    from oomb.kernels import backward, forward

    pb = make_problem(1, h, h_kv, c, kv_len, dk, page, dtype=torch.bfloat16, device="cuda", d_v=dv)
    d_out = torch.randn(1, h, c, dv, dtype=torch.bfloat16, device="cuda")
    dk_pool, dv_pool = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)

    def step():
        out, lse = forward.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, scale=0.1)
        backward.paged_attention_backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk_pool, dv_pool,
                                          pb.page_table, kv_len, scale=0.1)

    step()  # compiles
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


@pytest.mark.gpu
def test_padded_head_tiles_cost_about_what_their_tile_costs_on_gpu():
    # 96 and 80 run in 128-column tiles with masks and K/V through pointers, not TMA (launch.kv_descriptors):
    # about d=128's time, never much more (prints the numbers: pytest -s). If not, TMA boxes of 128 columns
    # over the 96-column rows (zero fill past the row) are the next thing to try. d=64 and d=128 themselves
    # run the unmasked code they ran before.
    base = _fwd_bwd_seconds(128, 128)
    for d in (96, 80):
        t = _fwd_bwd_seconds(d, d)
        print(f"fwd+bwd d={d}: {t * 1e3:.2f} ms, d=128: {base * 1e3:.2f} ms")
        assert t < 1.25 * base, f"d={d} took {t / base:.2f}x d=128's time in the same tile"
    mla = _fwd_bwd_seconds(192, 128, h=16, h_kv=16)
    print(f"fwd+bwd dk=192 dv=128 (16 heads): {mla * 1e3:.2f} ms")


@pytest.mark.gpu
@pytest.mark.parametrize("h,h_kv,dk,dv,docs,runs_on_fa4", [
    pytest.param(16, 16, 192, 128, None, True, id="deepseek-mla"),
    pytest.param(16, 16, 192, 128, 5, True, id="deepseek-mla-documents"),
    pytest.param(32, 8, 96, 96, None, True, id="phi3-d96-gqa"),
    pytest.param(32, 8, 192, 128, None, False, id="gqa-dk192-dv128-falls-back"),
])
def test_fa4_bf16_head_sizes_on_gpu(h, h_kv, dk, dv, docs, runs_on_fa4):
    from oomb.kernels import flash4_unavailable, get_backend
    from oomb.kernels.flash4_calls import FlashAttention4

    if (reason := flash4_unavailable()) is not None:
        pytest.skip(reason)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("these head sizes are handed to FA4 on Hopper")
    c, kv_len, page = 2048, 8192, 128
    pb = make_problem(1, h, h_kv, c, kv_len, dk, page, dtype=torch.bfloat16, device="cuda", d_v=dv)
    kw = dict(scale=dk**-0.5)
    if docs:
        kw["doc_start"] = random_doc_start(1, c, kv_len, docs, device="cuda")
    triton_backend = get_backend("triton", "cuda")
    calls = []
    spy = AttentionBackend("spy", lambda *a, **k: calls.append("forward") or triton_backend.forward(*a, **k),
                           lambda *a, **k: calls.append("backward") or triton_backend.backward(*a, **k))
    attention = Flash4Attention(FlashAttention4(), fallback=spy)
    q32, k32, v32 = pb.q.float(), pb.k_pool.float(), pb.v_pool.float()
    out, lse = attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = reference.paged_attention_forward(q32, k32, v32, pb.page_table, kv_len, **kw)
    assert_close_rel(out.float(), ref_out, TOL["gpu_bf16"], "out")
    assert_close_rel(lse, ref_lse, TOL["gpu_lse"], "lse")
    d_out = torch.randn_like(out)
    dk_pool, dv_pool = torch.zeros_like(k32), torch.zeros_like(v32)
    ref_dk, ref_dv = torch.zeros_like(k32), torch.zeros_like(v32)
    dq, _ = attention.backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk_pool, dv_pool, pb.page_table, kv_len,
                               **kw)
    ref_dq, _ = reference.paged_attention_backward(d_out.float(), q32, ref_out, ref_lse, k32, v32, ref_dk, ref_dv,
                                                   pb.page_table, kv_len, **kw)
    assert calls == ([] if runs_on_fa4 else ["forward", "backward"])
    assert_close_rel(dq.float(), ref_dq, TOL["gpu_bf16"], "dq")
    assert_close_rel(dk_pool, ref_dk, TOL["gpu_bf16"], "dk")
    assert_close_rel(dv_pool, ref_dv, TOL["gpu_bf16"], "dv")
