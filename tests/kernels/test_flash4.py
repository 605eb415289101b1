"""The ``fa4`` backend: pages gathered into FlashAttention-4's layouts, documents packed as its sequences,
dK/dV added back into the gradient pages, and what FA4 cannot express handed to the fallback.

On CPU FA4 itself is replaced by a PyTorch stand-in with its semantics (flash_standin.py), so these
tests check oomb's code around it against the reference backend in float64; the GPU tests run FA4.
"""

import pytest
import torch
from flash_standin import FallbackSpy, TorchFlash
from helpers import assert_close_rel
from paged_inputs import check_bf16_against_fp32, make_problem, random_doc_start, random_page_select

import oomb.kernels as kernels_package
from oomb.kernels import AttentionBackend, flash4, flash4_calls, flash4_unavailable, get_backend, reference
from oomb.kernels.flash4 import Flash4Attention, key_layout, key_segments

REFERENCE = AttentionBackend("torch", reference.paged_attention_forward, reference.paged_attention_backward)

CASES = [
    # b, h, h_kv, c, kv_len, d, page, window, docs
    pytest.param(1, 4, 2, 16, 64, 16, 8, None, None, id="gqa"),
    pytest.param(2, 3, 3, 13, 45, 8, 4, None, None, id="two-rows-ragged-mha"),
    pytest.param(1, 4, 1, 32, 32, 16, 16, None, None, id="first-chunk-mqa"),
    pytest.param(2, 4, 2, 20, 77, 8, 8, 11, None, id="window"),
    pytest.param(1, 4, 2, 24, 90, 8, 8, None, 5, id="documents"),
    pytest.param(2, 6, 2, 17, 70, 8, 8, None, 4, id="documents-two-rows"),
    pytest.param(2, 4, 2, 20, 77, 8, 8, 9, 6, id="documents-window"),
    pytest.param(1, 4, 2, 16, 64, 8, 8, None, 1, id="one-document"),
]


def _attention(fallback=REFERENCE):
    kernels = TorchFlash()
    return Flash4Attention(kernels, fallback=fallback), kernels


def _check_against_reference(attention, kernels, pb, kw, calls_per_direction=1):
    """Forward and backward of ``attention`` against the reference backend in float64 (gradients ADDED to random
    pools), the stand-in for FA4 having run ``calls_per_direction`` times each way."""
    kv_len = pb.kv_len
    out, lse = attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = reference.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    assert kernels.calls == calls_per_direction, "the stand-in for FA4 ran, not the fallback"
    assert_close_rel(out, ref_out, 1e-10, "out")
    assert_close_rel(lse, ref_lse, 1e-10, "lse")

    d_out = torch.randn_like(out)
    dk0, dv0 = torch.randn_like(pb.k_pool), torch.randn_like(pb.v_pool)  # gradients are ADDED to what is there
    dk, dv, ref_dk, ref_dv = dk0.clone(), dv0.clone(), dk0.clone(), dv0.clone()
    dq, d_sinks = attention.backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv, pb.page_table, kv_len, **kw)
    ref_dq = reference.paged_attention_backward(d_out, pb.q, ref_out, ref_lse, pb.k_pool, pb.v_pool, ref_dk,
                                                ref_dv, pb.page_table, kv_len, **kw)
    assert kernels.calls == 2 * calls_per_direction
    ref_dq, ref_d_sinks = ref_dq
    if kw.get("sinks") is None:
        assert d_sinks is None
    else:
        assert d_sinks.dtype == torch.float64
        assert_close_rel(d_sinks, ref_d_sinks, 1e-10, "d_sinks")
    assert_close_rel(dq, ref_dq, 1e-10, "dq")
    assert_close_rel(dk - dk0, ref_dk - dk0, 1e-10, "dk added")
    assert_close_rel(dv - dv0, ref_dv - dv0, 1e-10, "dv added")
    return dk, dk0, dv, dv0


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,window,docs", CASES)
def test_fa4_backend_matches_reference(b, h, h_kv, c, kv_len, d, page, window, docs):
    torch.manual_seed(0)
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, dtype=torch.float64)
    kw = dict(scale=d**-0.5, sliding_window=window)
    if docs:
        kw["doc_start"] = random_doc_start(b, c, kv_len, docs)
    attention, kernels = _attention()
    dk, dk0, dv, dv0 = _check_against_reference(attention, kernels, pb, kw)
    # Spare pages (in no row's table) and the padding slots of a ragged last page keep their bits.
    used = set(pb.page_table.reshape(-1).tolist())
    for pid in range(dk.shape[0]):
        if pid not in used:
            assert torch.equal(dk[pid], dk0[pid]) and torch.equal(dv[pid], dv0[pid])
    tail = kv_len % page
    if tail:
        last = pb.page_table[:, -1].long()
        assert torch.equal(dk[last, :, tail:], dk0[last, :, tail:])


def test_key_segments_cut_the_past_at_whole_pages_and_keep_the_chunk_whole():
    assert key_segments(77, 13, 8, 16) == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 77)]
    assert key_segments(77, 13, 8, 20) == key_segments(77, 13, 8, 16)  # whole pages: 20 keys -> 16
    assert key_segments(77, 20, 8, 16) == [(0, 16), (16, 32), (32, 48), (48, 77)]  # the chunk starts at 57
    assert key_segments(77, 13, 8, 64) == [(0, 64), (64, 77)]
    assert key_segments(77, 13, 8, 65) == [(0, 64), (64, 77)]
    assert key_segments(60, 13, 8, 64) == [(0, 60)]  # no cut inside the past: one call
    assert key_segments(16, 16, 8, 8) == [(0, 16)]  # the first chunk
    assert key_segments(24, 8, 8, 4) == [(0, 8), (8, 16), (16, 24)]  # segments of at least a page


SEGMENT_CASES = [
    # b, h, h_kv, c, kv_len, d, page, key_segment, segments
    pytest.param(1, 4, 2, 13, 77, 8, 8, 16, 5, id="gqa-ragged-chunk"),
    pytest.param(2, 3, 3, 16, 64, 8, 8, 24, 3, id="two-rows-mha-segments-of-three-pages"),
    pytest.param(1, 4, 1, 8, 80, 16, 8, 64, 2, id="mqa-long-last-segment"),
]


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,key_segment,segments", SEGMENT_CASES)
def test_a_long_past_attended_in_segments_matches_the_reference(b, h, h_kv, c, kv_len, d, page, key_segment,
                                                                  segments):
    torch.manual_seed(0)
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, dtype=torch.float64)
    kernels = TorchFlash()
    attention = Flash4Attention(kernels, fallback=REFERENCE, key_segment=key_segment)
    _check_against_reference(attention, kernels, pb, dict(scale=d**-0.5), calls_per_direction=segments)


@pytest.mark.parametrize("what", ["window", "documents", "page_select"])
def test_windows_documents_and_selections_are_not_cut_into_segments(what):
    torch.manual_seed(0)
    b, h, h_kv, c, kv_len, d, page = 1, 4, 2, 16, 80, 8, 8
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, dtype=torch.float64)
    kw = {"window": dict(sliding_window=70), "documents": dict(doc_start=random_doc_start(b, c, kv_len, 2)),
          "page_select": dict(page_select=random_page_select(b, 1, c, kv_len, page, 16, 3), select_block=16)}[what]
    kernels = TorchFlash(sparse_blocks=(8, 8))
    attention = Flash4Attention(kernels, fallback=REFERENCE, key_segment=16)
    _check_against_reference(attention, kernels, pb, dict(scale=d**-0.5, **kw))


def test_a_window_gathers_only_the_pages_it_can_see():
    table = torch.arange(10, dtype=torch.int32).view(1, 10)
    layout = key_layout(table, kv_len=80, q_len=8, page_size=8, sliding_window=9, doc_start=None)
    # queries 72..79 see keys from 64 on: pages 8 and 9 only
    assert layout.keys_per_row == 16 and sorted(set(layout.page_ids.tolist())) == [8, 9]


def test_documents_become_sequences_back_to_back():
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    # row 0: a document from 2 covers the chunk's first 2 queries, one from 14 the rest; row 1: one from 0
    doc_start = torch.tensor([[2, 2, 14, 14], [0, 0, 0, 0]], dtype=torch.int32)
    layout = key_layout(table, kv_len=16, q_len=4, page_size=4, sliding_window=None, doc_start=doc_start)
    assert layout.cu_seqlens_q.tolist() == [0, 2, 4, 8]
    assert layout.cu_seqlens_k.tolist() == [0, 12, 14, 30]  # keys 2..13, 14..15, then row 1's 0..15
    assert (layout.max_seqlen_q, layout.max_seqlen_k) == (4, 16)
    assert layout.page_ids[:12].tolist() == [0] * 2 + [1] * 4 + [2] * 4 + [3] * 2
    assert layout.page_ids[14:].tolist() == [4] * 4 + [5] * 4 + [6] * 4 + [7] * 4


SINK_CASES = [
    # b, h, h_kv, c, kv_len, d, page, window, docs, key_segment, page_select
    pytest.param(1, 4, 2, 16, 64, 16, 8, None, None, None, False, id="gqa"),
    pytest.param(2, 4, 2, 20, 77, 8, 8, 11, None, None, False, id="window"),
    pytest.param(2, 6, 2, 17, 70, 8, 8, None, 4, None, False, id="documents-two-rows"),
    pytest.param(1, 4, 2, 13, 77, 8, 8, None, None, 16, False, id="segments"),
    pytest.param(1, 4, 2, 16, 80, 8, 8, None, None, None, True, id="page-select"),
]


@pytest.mark.parametrize("b,h,h_kv,c,kv_len,d,page,window,docs,key_segment,page_select", SINK_CASES)
def test_sinks_join_the_softmax_around_fa4_in_every_kind_of_call(b, h, h_kv, c, kv_len, d, page, window, docs,
                                                                  key_segment, page_select):
    # GPT-OSS's per-head sinks: FA4 attends the keys, the sink is folded into out and lse, and its gradient is
    # taken from the row terms; the reference applies the sink inside its softmax.
    torch.manual_seed(0)
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, dtype=torch.float64, sinks=True)
    kw = dict(scale=d**-0.5, sinks=pb.sinks * 3, sliding_window=window)  # sinks large enough to matter
    if docs:
        kw["doc_start"] = random_doc_start(b, c, kv_len, docs)
    if page_select:
        kw.update(page_select=random_page_select(b, 1, c, kv_len, page, 16, 3), select_block=16)
    kernels = TorchFlash(sparse_blocks=(8, 8))
    segments = 1 if key_segment is None else len(key_segments(kv_len, c, page, key_segment))
    attention = Flash4Attention(kernels, fallback=REFERENCE, key_segment=key_segment or flash4.KEY_SEGMENT)
    _check_against_reference(attention, kernels, pb, kw, calls_per_direction=segments)


@pytest.mark.parametrize("what", ["page_select", "dtype"])
def test_what_fa4_cannot_express_goes_to_the_fallback_in_both_directions(what):
    torch.manual_seed(0)
    b, h, h_kv, c, kv_len, d, page = 1, 4, 2, 16, 64, 16, 8
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, dtype=torch.float16 if what == "dtype" else torch.float32)
    kw = dict(scale=d**-0.5)
    if what == "page_select":
        kw.update(page_select=random_page_select(b, 1, c, kv_len, page, 8, 2), select_block=8)
    spy = FallbackSpy()
    attention, kernels = _attention(fallback=spy)
    out, lse = attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    dk, dv = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)
    attention.backward(torch.ones_like(out), pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv, pb.page_table, kv_len, **kw)
    assert spy.calls == ["forward", "backward"] and kernels.calls == 0


def test_bad_inputs_are_refused_with_what_is_wrong():
    pb = make_problem(1, 4, 2, 16, 64, 16, 8, dtype=torch.float64)
    attention, _ = _attention()
    with pytest.raises(ValueError, match="kv_len"):
        attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table[:, :4], 64, scale=0.25)
    with pytest.raises(ValueError, match="does not fit pools"):
        attention.forward(pb.q[:, :3], pb.k_pool, pb.v_pool, pb.page_table, 64, scale=0.25)
    with pytest.raises(ValueError, match="newest part"):
        attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, 8, scale=0.25)


def test_fa4_is_refused_off_cuda_with_a_way_out():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("fa4", "cpu")
    if not torch.cuda.is_available():
        assert "CUDA" in flash4_unavailable()
        assert get_backend("auto", "cpu").name == "torch"


GPU_CASES = [
    # c, kv_len, window, docs
    pytest.param(4096, 32768, None, None, id="dense"),
    pytest.param(4096, 32768, None, 6, id="documents"),
    pytest.param(4096, 32768, 4096, None, id="window"),
    pytest.param(8192, 8192, None, None, id="first-chunk"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128], ids=["full", "sliding-128"])
def test_fa4_bf16_with_sinks_matches_the_reference_on_gpu(window):
    # GPT-OSS's attention layers: 64 query heads over 8 KV heads of 64, per-head sinks, full or a 128-token window.
    if (reason := flash4_unavailable()) is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    h, h_kv, d, page, c, kv_len = 64, 8, 64, 128, 2048, 8192
    pb = make_problem(1, h, h_kv, c, kv_len, d, page, dtype=torch.bfloat16, device="cuda", sinks=True)
    sinks = (pb.sinks.float() * 3).to(torch.bfloat16)
    kw = dict(scale=d**-0.5, sliding_window=window, sinks=sinks)
    check_bf16_against_fp32(get_backend("fa4", "cuda"), pb, kw, dict(kw, sinks=sinks.float()))


@pytest.mark.gpu
@pytest.mark.parametrize("c,kv_len,window,docs", GPU_CASES)
def test_fa4_bf16_matches_the_reference_on_gpu(c, kv_len, window, docs):
    if (reason := flash4_unavailable()) is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    h, h_kv, d, page = 28, 4, 128, 128
    pb = make_problem(1, h, h_kv, c, kv_len, d, page, dtype=torch.bfloat16, device="cuda")
    kw = dict(scale=d**-0.5, sliding_window=window)
    if docs:
        kw["doc_start"] = random_doc_start(1, c, kv_len, docs, device="cuda")
    check_bf16_against_fp32(get_backend("fa4", "cuda"), pb, kw)


@pytest.mark.gpu
def test_fa4_bf16_in_key_segments_matches_the_reference_on_gpu():
    # 4096 queries over 32K keys in four segments of 8192 (the default cuts from 256K keys on): FA4 without the
    # causal mask on the past's segments, its backward from the merged out and lse.
    if (reason := flash4_unavailable()) is not None:
        pytest.skip(reason)
    from oomb.kernels.flash4_calls import FlashAttention4

    torch.manual_seed(0)
    h, h_kv, d, page, c, kv_len = 28, 4, 128, 128, 4096, 32768
    pb = make_problem(1, h, h_kv, c, kv_len, d, page, dtype=torch.bfloat16, device="cuda")
    fa4 = Flash4Attention(FlashAttention4(), fallback=None, key_segment=8192)
    check_bf16_against_fp32(fa4, pb, dict(scale=d**-0.5))


@pytest.mark.parametrize("dtype,d,offset", [(torch.bfloat16, 128, 0), (torch.bfloat16, 6, 0),
                                            (torch.float32, 64, 0), (torch.float16, 64, 2)])
def test_gather_and_add_move_heads_as_words_or_as_they_are(dtype, d, offset):
    # Heads move as 8-byte words where they divide evenly, else element by element (odd head sizes, a pool
    # view whose offset is no whole word): the same tokens, bit for bit, and each gradient added once.
    from oomb.kernels.flash4 import _add_at, _gather
    from oomb.kernels.flash4_calls import KeyLayout

    torch.manual_seed(0)
    flat = torch.randn(offset + 6 * 2 * 4 * d).to(dtype)
    pool = flat[offset:].view(6, 2, 4, d)  # [pages, H_kv, page_size, D]
    page_ids = torch.tensor([3, 3, 0, 5, 1])
    slots = torch.tensor([0, 2, 1, 3, 3])
    layout = KeyLayout(page_ids, slots, keys_per_row=5)
    got = _gather(pool, layout, rows=1)
    assert torch.equal(got[0], pool[page_ids, :, slots])
    grad = torch.randn(1, 5, 2, d)
    expect = pool.clone()
    expect[page_ids, :, slots] += grad[0].to(dtype)
    _add_at(pool, layout, grad)
    assert torch.equal(pool, expect)


class _RecordingInterface:
    """flash_attn.cute.interface's two entry points, recording what oomb's wrapper passes them."""

    def __init__(self):
        self.calls = []

    def _flash_attn_fwd(self, q, k, v, **kw):
        self.calls.append(("forward", kw))
        return torch.zeros_like(q), torch.zeros(q.shape[:-1]), None

    def _flash_attn_bwd(self, q, k, v, out, d_out, lse, **kw):
        self.calls.append(("backward", kw))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def test_the_fa4_wrapper_hands_each_direction_its_own_block_lists(monkeypatch):
    """FlashAttention4 (the thin layer over flash-attn-4, otherwise only run on the GPU) built with the package
    replaced: it offers block sparsity only where asked, and each call passes FA4 its own direction's lists."""
    import sys
    import types

    from oomb.kernels.flash4_calls import FlashAttention4, KeyLayout
    from oomb.kernels.flash4_sparse import BlockLists, BlockSparsity

    interface = _RecordingInterface()
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    sparsity_module = types.ModuleType("flash_attn.cute.block_sparsity")
    sparsity_module.BlockSparseTensorsTorch = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.block_sparsity", sparsity_module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))

    assert FlashAttention4(block_sparse=False).block_sparse_blocks(128) is None
    # The default (kernels/__init__.py says so): offered unless the environment variable is "0".
    monkeypatch.delenv(flash4_calls.BLOCK_SPARSE_ENV, raising=False)
    assert FlashAttention4().block_sparse_blocks(128) == (128, 128)
    monkeypatch.setenv(flash4_calls.BLOCK_SPARSE_ENV, "0")
    assert FlashAttention4().block_sparse_blocks(128) is None
    doc = " ".join(kernels_package.__doc__.split())
    assert "Page-sparse selections run on FA4's block sparsity by default" in doc
    assert f"``{flash4_calls.BLOCK_SPARSE_ENV}=0`` turns it off" in doc
    fa4 = FlashAttention4(block_sparse=True)
    assert fa4.block_sparse_blocks(128) == (128, 128)
    assert fa4.block_sparse_blocks(256) is None

    def lists(value):
        t = torch.full((1, 1, 2), value, dtype=torch.int32)
        return BlockLists(t, t[..., None], t, t[..., None])

    sparsity = BlockSparsity(forward=lists(1), backward=lists(2), block_q=128, block_kv=128)
    q = torch.zeros(1, 4, 2, 8)
    layout = KeyLayout(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), keys_per_row=4)
    out, lse = fa4.forward(q, q, q, scale=1.0, window_left=None, layout=layout, block_sparse=sparsity)
    fa4.backward(out, q, q, q, out, lse, scale=1.0, window_left=None, layout=layout, block_sparse=sparsity)
    fa4.forward(q, q, q, scale=1.0, window_left=None, layout=layout, causal=False)
    (fwd, fwd_kw), (bwd, bwd_kw), (_, dense_kw) = interface.calls
    assert (fwd, bwd) == ("forward", "backward")
    assert int(fwd_kw["block_sparse_tensors"]["mask_block_cnt"][0, 0, 0]) == 1
    assert int(bwd_kw["block_sparse_tensors"]["mask_block_cnt"][0, 0, 0]) == 2
    assert fwd_kw["block_sparse_tensors"]["block_size"] == (128, 128)
    assert "block_sparse_tensors" not in dense_kw and dense_kw["causal"] is False
