"""Page-sparse attention through FA4's block sparsity (kernels/flash4_sparse.py): the chosen pages gathered
with the chunk, the pairs of (query block, key block) in FA4's forward and backward forms, and the
gradients added back into the pages.

On CPU FA4 is the PyTorch stand-in (flash_standin.py), which reads the block lists with FA4's semantics
(stricter on full blocks); each case is compared with the reference backend in float32. The GPU test runs
FA4 itself.
"""

import dataclasses
import itertools

import pytest
import torch
from flash_standin import FallbackSpy, TorchFlash
from helpers import assert_close_rel
from paged_inputs import check_bf16_against_fp32, make_problem, random_doc_start, random_page_select

from oomb.kernels import flash4_calls, flash4_sparse, reference
from oomb.kernels.flash4 import Flash4Attention
from oomb.kernels.flash4_sparse import chosen_pages, page_sparse_keys

TOL = 1e-5  # float32 against the reference's float32 arithmetic

CASES = [
    # b, h, h_kv, h_sel, c, n_past, d, page, select_block, budget, block_q
    pytest.param(2, 4, 2, 1, 32, 10, 16, 8, 16, 3, 8, id="shared-gqa-padded-union"),
    pytest.param(1, 6, 2, 2, 24, 12, 8, 8, 8, 4, 8, id="per-head-gqa"),
    pytest.param(2, 3, 3, 3, 29, 9, 8, 4, 16, 2, 8, id="per-head-mha-ragged-chunk"),
    pytest.param(1, 4, 1, 1, 16, 3, 8, 8, 8, 3, 8, id="budget-covers-the-past-mqa"),
    pytest.param(2, 4, 2, 1, 20, 7, 8, 8, 21, 2, 8, id="one-list-for-the-chunk"),
    pytest.param(1, 4, 2, 2, 40, 9, 8, 8, 16, 3, 16, id="query-blocks-of-two-pages"),
    pytest.param(1, 2, 1, 1, 19, 6, 8, 8, 8, 2, 4, id="pages-of-two-query-blocks"),
]


def _with_common_page(sel: torch.Tensor) -> torch.Tensor:
    """Every list also chooses page 0 (in place of its smallest page): pages chosen by several query blocks."""
    sel = sel.clone()
    has_zero = (sel == 0).any(-1)
    sel[..., 0] = torch.where(has_zero, sel[..., 0], torch.zeros_like(sel[..., 0]))
    return sel


def _problem(b, h, h_kv, h_sel, c, n_past, d, page, select_block, budget, common=True):
    kv_len = c + n_past * page
    pb = make_problem(b, h, h_kv, c, kv_len, d, page, dtype=torch.float32)
    sel = random_page_select(b, h_sel, c, kv_len, page, select_block, budget)
    kw = dict(scale=d**-0.5, page_select=_with_common_page(sel) if common else sel, select_block=select_block)
    return pb, kw


def _compare(attention, pb, kw, tol=TOL):
    """Forward and backward of ``attention`` against the reference on the same inputs (gradients added into
    random pools)."""
    kv_len = pb.kv_len
    out, lse = attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    ref_out, ref_lse = reference.paged_attention_forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, kv_len, **kw)
    assert_close_rel(out, ref_out, tol, "out")
    assert_close_rel(lse, ref_lse, tol, "lse")
    d_out = torch.randn_like(out)
    dk0, dv0 = torch.randn_like(pb.k_pool), torch.randn_like(pb.v_pool)
    dk, dv, ref_dk, ref_dv = dk0.clone(), dv0.clone(), dk0.clone(), dv0.clone()
    dq, _ = attention.backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv, pb.page_table, kv_len, **kw)
    ref_dq, _ = reference.paged_attention_backward(d_out, pb.q, ref_out, ref_lse, pb.k_pool, pb.v_pool, ref_dk,
                                                   ref_dv, pb.page_table, kv_len, **kw)
    assert_close_rel(dq, ref_dq, tol, "dq")
    assert_close_rel(dk - dk0, ref_dk - dk0, tol, "dk added")
    assert_close_rel(dv - dv0, ref_dv - dv0, tol, "dv added")
    return dk, dk0


@pytest.mark.parametrize("b,h,h_kv,h_sel,c,n_past,d,page,select_block,budget,block_q", CASES)
def test_fa4_block_sparsity_matches_the_reference(b, h, h_kv, h_sel, c, n_past, d, page, select_block, budget,
                                                  block_q):
    pb, kw = _problem(b, h, h_kv, h_sel, c, n_past, d, page, select_block, budget)
    kernels = TorchFlash(sparse_blocks=(block_q, page))
    dk, dk0 = _compare(Flash4Attention(kernels, fallback=None), pb, kw)
    assert kernels.sparse_calls == 2, "both directions ran through the stand-in's block sparsity"
    used = set(pb.page_table.reshape(-1).tolist())
    for pid in range(dk.shape[0]):  # pages in no row's table keep their bits
        if pid not in used:
            assert torch.equal(dk[pid], dk0[pid])


def _expected_lists(page_select, n_past, c, heads, select_block, block_q, page):
    """A slow construction of the gathered pages and FA4's lists, from the definitions, with Python sets."""
    b_count, h_sel = page_select.shape[:2]
    u = min(n_past, page_select[0].numel())
    n_q, n_own = -(-c // block_q), -(-c // page)
    gathered, fwd = [], {}
    for b in range(b_count):
        chosen = sorted(set(page_select[b].reshape(-1).tolist()))
        order = (chosen + [p for p in range(n_past) if p not in chosen])[:u]
        gathered.append(order)
        for hq in range(heads):
            hs = hq // (heads // h_sel)
            for m in range(n_q):
                q_first, q_last = m * block_q, min((m + 1) * block_q, c) - 1
                past = sorted(order.index(p) for p in page_select[b, hs, q_first // select_block].tolist())
                mask, full = [], []
                for t in range(n_own):
                    k_first, k_last = t * page, min((t + 1) * page, c) - 1
                    if k_first > q_last:
                        continue
                    whole = k_last <= q_first and (t + 1) * page <= c
                    (full if whole else mask).append(u + t)
                fwd[b, hq, m] = (mask, past + full)
    bwd = {(b, hq, n): tuple([m for m in range(n_q) if n in fwd[b, hq, m][kind]] for kind in (0, 1))
           for b in range(b_count) for hq in range(heads) for n in range(u + n_own)}
    return gathered, fwd, bwd


def _read(lists, b, hq, row):
    """(mask, full) entries of one row of FA4's lists (broadcast batch and head dims read at 0)."""
    def entries(cnt, idx):
        bi, hi = (b if cnt.shape[0] > 1 else 0), (hq if cnt.shape[1] > 1 else 0)
        return idx[bi, hi, row, : cnt[bi, hi, row]].tolist()
    return entries(lists.mask_cnt, lists.mask_idx), entries(lists.full_cnt, lists.full_idx)


@pytest.mark.parametrize("b,heads,h_sel,c,n_past,page,select_block,budget,block_q", [
    (2, 4, 1, 29, 10, 4, 16, 3, 8),
    (1, 6, 3, 24, 9, 8, 8, 2, 8),
    (1, 2, 2, 17, 5, 8, 32, 5, 16),
])
def test_block_lists_match_a_slow_construction(b, heads, h_sel, c, n_past, page, select_block, budget, block_q):
    # Twice with other selections of the same shapes: the second call reuses the lists that depend on the shapes
    # alone (made once per shape, flash4_sparse._chunk_lists), which the first call's must not have changed.
    hits = flash4_sparse._chunk_lists.cache_info().hits
    for _ in range(2):
        _check_block_lists(b, heads, h_sel, c, n_past, page, select_block, budget, block_q)
    assert flash4_sparse._chunk_lists.cache_info().hits >= hits + 2  # both directions again


def _check_block_lists(b, heads, h_sel, c, n_past, page, select_block, budget, block_q):
    kv_len = c + n_past * page
    table = torch.randperm(b * (n_past + -(-c // page)) + 2)[: b * (n_past + -(-c // page))]
    table = table.view(b, -1).to(torch.int32)
    sel = _with_common_page(random_page_select(b, h_sel, c, kv_len, page, select_block, budget))
    keys = page_sparse_keys(table, kv_len, c, page, sel, select_block, block_q, heads)
    gathered, fwd, bwd = _expected_lists(sel, n_past, c, heads, select_block, block_q, page)

    u = len(gathered[0])
    assert keys.keys_per_row == u * page + c
    ids, slots = keys.page_ids.view(b, -1), keys.slots.view(b, -1)
    for row in range(b):
        positions = [p * page + s for p in gathered[row] for s in range(page)] + list(range(kv_len - c, kv_len))
        expect_ids = [int(table[row, pos // page]) for pos in positions]
        assert ids[row].tolist() == expect_ids and slots[row].tolist() == [pos % page for pos in positions]
    sparsity = keys.sparsity
    assert (sparsity.block_q, sparsity.block_kv) == (block_q, page)
    for (row, hq, m), expect in fwd.items():
        assert _read(sparsity.forward, row, hq, m) == expect, f"forward lists of row {row}, head {hq}, block {m}"
    for (row, hq, n), expect in bwd.items():
        assert _read(sparsity.backward, row, hq, n) == expect, f"backward lists of row {row}, head {hq}, block {n}"
    assert sparsity.forward.full_cnt.shape[1] == (1 if h_sel == 1 else heads)


def test_chosen_pages_come_first_then_the_others_without_repeats():
    sel = torch.tensor([[[[5, 7], [1, 7]]], [[[0, 2], [2, 3]]]], dtype=torch.int32)  # [B=2, 1, 2 blocks, K=2]
    pages, where = chosen_pages(sel, n_past=9)
    assert pages.tolist() == [[1, 5, 7, 0], [0, 2, 3, 1]]  # U = min(9, 4): the union, then unchosen pages
    for row in range(2):
        assert sorted(where[row].tolist()) == list(range(9))
        assert all(where[row, p] == i for i, p in enumerate(pages[row].tolist()))


class _Mutated(TorchFlash):
    """The stand-in handed block lists changed by ``mutate`` (direction, BlockSparsity) -> BlockSparsity."""

    def __init__(self, blocks, mutate):
        super().__init__(sparse_blocks=blocks)
        self.mutate = mutate

    def forward(self, *args, block_sparse=None, **kw):
        return super().forward(*args, block_sparse=self.mutate("forward", block_sparse), **kw)

    def backward(self, *args, block_sparse=None, **kw):
        return super().backward(*args, block_sparse=self.mutate("backward", block_sparse), **kw)


def _edit(sparsity, direction, **fields):
    lists = getattr(sparsity, direction)
    return dataclasses.replace(sparsity, **{direction: dataclasses.replace(lists, **fields)})


def _drop_diagonal(direction, s):  # each query block's last mask block (its diagonal) left out of the forward
    return _edit(s, "forward", mask_cnt=s.forward.mask_cnt - 1) if direction == "forward" else s


def _diagonal_as_full(direction, s):  # the mask blocks listed as full: no causal mask on them
    if direction != "forward":
        return s
    f = s.forward
    shape = f.full_cnt.shape
    mask_cnt, mask_idx = f.mask_cnt.expand(shape), f.mask_idx.expand(*shape, -1)
    cnt = f.full_cnt + mask_cnt
    idx = torch.zeros(*shape, int(cnt.max()), dtype=torch.int32)
    for i in itertools.product(*map(range, shape)):
        entries = f.full_idx[i][: f.full_cnt[i]].tolist() + mask_idx[i][: mask_cnt[i]].tolist()
        idx[i][: len(entries)] = torch.tensor(sorted(entries), dtype=torch.int32)
    return _edit(s, "forward", full_cnt=cnt, full_idx=idx, mask_cnt=torch.zeros_like(f.mask_cnt))


def _backward_misses_a_pair(direction, s):  # the first key block (a chosen page) forgets its query blocks
    if direction != "backward":
        return s
    cnt = s.backward.full_cnt.clone()
    cnt[..., 0] = 0
    return _edit(s, "backward", full_cnt=cnt)


@pytest.mark.parametrize("mutate", [_drop_diagonal, _diagonal_as_full, _backward_misses_a_pair])
def test_a_wrong_block_list_is_caught(mutate):
    pb, kw = _problem(2, 4, 2, 1, 32, 10, 16, 8, 16, 3)
    attention = Flash4Attention(_Mutated((8, 8), mutate), fallback=None)
    with pytest.raises(AssertionError, match="relative error"):
        _compare(attention, pb, kw)


def test_a_gathered_order_off_by_one_from_the_lists_is_caught(monkeypatch):
    pb, kw = _problem(2, 4, 2, 1, 32, 10, 16, 8, 16, 3)

    def shifted(page_select, n_past, page_union=None):  # each page gathered one block later than the lists say
        pages, where = chosen_pages(page_select, n_past, page_union)
        return pages.roll(1, dims=1), where

    monkeypatch.setattr(flash4_sparse, "chosen_pages", shifted)
    with pytest.raises(AssertionError, match="relative error"):
        _compare(Flash4Attention(TorchFlash(sparse_blocks=(8, 8)), fallback=None), pb, kw)


def _slot_of(pb, sel, shared_row):
    """The problem's pools as an offloaded store's slot holds them: each row's chosen pages and its chunk, compacted;
    the table sends every other page to ``shared_row(rows)`` (``rows``: the rows the slot holds)."""
    b, n_past = pb.q.shape[0], (pb.kv_len - pb.q.shape[2]) // pb.k_pool.shape[2]
    held, where = [], {}
    for row in range(b):
        for p in sorted(set(sel[row].reshape(-1).tolist())) + list(range(n_past, pb.page_table.shape[1])):
            where[row, p] = len(held)
            held.append(int(pb.page_table[row, p]))
    table = torch.full_like(pb.page_table, shared_row(len(held)))
    for (row, p), r in where.items():
        table[row, p] = r
    pools = {name: torch.cat([getattr(pb, name)[held], torch.randn_like(getattr(pb, name)[:1])])
             for name in ("k_pool", "v_pool")}  # and the shared row, holding no page
    return dataclasses.replace(pb, page_table=table, **pools), len(held)


def test_pages_a_slot_does_not_hold_share_a_row_that_takes_only_zeros():
    # An offloaded store's slot table sends every page it did not fetch to one row of its own
    # (oomb.cache.KVStore.fetch): the padding keys of a page-sparse gather all name it, and adding their zero
    # gradients by gather-add-write leaves the other rows' gradients whole and that row as it was.
    b, h, h_kv, c, n_past, d, page = 2, 4, 2, 16, 10, 8, 8
    pb, kw = _problem(b, h, h_kv, 1, c, n_past, d, page, 8, 3)  # U = 6; unions of at most 5 pages (common page)
    kernels = TorchFlash(sparse_blocks=(8, page))
    slot, shared = _slot_of(pb, kw["page_select"], shared_row=lambda held: held)
    dk, dk0 = _compare(Flash4Attention(kernels, fallback=None), slot, kw)
    assert kernels.sparse_calls == 2 and (slot.page_table == shared).any()
    assert torch.equal(dk[shared], dk0[shared])
    # A table that sends them to a row holding a chosen page breaks that: the padding keys' writes of the row
    # (its old value plus zero) and the chosen keys' (plus their gradient) race, and one is lost.
    slot, _ = _slot_of(pb, kw["page_select"], shared_row=lambda held: 0)
    with pytest.raises(AssertionError, match="dk added|dv added"):
        _compare(Flash4Attention(kernels, fallback=None), slot, kw)


def test_each_call_gets_only_its_own_directions_lists():
    pb, kw = _problem(2, 4, 2, 1, 32, 10, 16, 8, 16, 3)
    seen = []

    def record(direction, s):
        seen.append((direction, s.forward is not None, s.backward is not None))
        return s

    _compare(Flash4Attention(_Mutated((8, 8), record), fallback=None), pb, kw)
    assert seen == [("forward", True, False), ("backward", False, True)]
    with pytest.raises(ValueError, match="sideways"):
        page_sparse_keys(pb.page_table, pb.kv_len, 32, 8, kw["page_select"], 16, 8, 4, directions=("sideways",))


@pytest.mark.parametrize("what", ["older-kernels", "documents", "window", "select-block", "page-size"])
def test_selections_fa4_cannot_express_go_to_the_fallback_in_both_directions(what):
    b, h, h_kv, c, n_past, d, page = 1, 4, 2, 24, 8, 8, 8
    select_block = 4 if what == "select-block" else 8  # 4 splits FA4's query blocks of 8 between two lists
    pb, kw = _problem(b, h, h_kv, 1, c, n_past, d, page, select_block, 3)
    if what == "documents":
        kw["doc_start"] = random_doc_start(b, c, pb.kv_len, 3)
    if what == "window":
        kw["sliding_window"] = 40
    blocks = None if what == "older-kernels" else (8, 16 if what == "page-size" else page)
    spy, kernels = FallbackSpy(), TorchFlash(sparse_blocks=blocks)
    attention = Flash4Attention(kernels, fallback=spy)
    out, lse = attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, pb.kv_len, **kw)
    dk, dv = torch.zeros_like(pb.k_pool), torch.zeros_like(pb.v_pool)
    attention.backward(torch.ones_like(out), pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv, pb.page_table, pb.kv_len,
                       **kw)
    assert spy.calls == ["forward", "backward"] and kernels.calls == 0


GPU_CASES = [
    # c, kv_len, budget, select_block, h_sel
    pytest.param(4096, 32768, 64, 128, 1, id="shared"),
    pytest.param(4096, 32768, 64, 128, 4, id="per-head"),
    pytest.param(512, 65536, 16, 128, 1, id="padded-union"),
    pytest.param(1000, 1000 + 128 * 100, 32, 256, 1, id="ragged-chunk"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c,kv_len,budget,select_block,h_sel", GPU_CASES)
def test_fa4_block_sparsity_bf16_matches_the_reference_on_gpu(c, kv_len, budget, select_block, h_sel):
    from oomb.kernels import flash4_unavailable

    if (reason := flash4_unavailable()) is not None:
        pytest.skip(reason)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA4 block sparsity is offered on Hopper only")
    h, h_kv, d, page = 28, 4, 128, 128
    pb = make_problem(1, h, h_kv, c, kv_len, d, page, dtype=torch.bfloat16, device="cuda")
    sel = random_page_select(1, h_sel, c, kv_len, page, select_block, budget, device="cuda")
    kw = dict(scale=d**-0.5, page_select=_with_common_page(sel), select_block=select_block)
    spy = FallbackSpy()
    attention = Flash4Attention(flash4_calls.FlashAttention4(block_sparse=True), fallback=spy)
    check_bf16_against_fp32(attention, pb, kw)
    assert spy.calls == [], "FA4 ran both directions, not the fallback"


@pytest.mark.gpu
def test_building_the_block_lists_does_not_wait_for_the_gpu():
    # A host sync would empty the GPU's queue once per layer and chunk; the union's size is not read back.
    b, heads, c, n_past, page = 1, 28, 4096, 1024, 128
    kv_len = c + n_past * page
    table = torch.randperm(n_past + c // page, device="cuda").view(b, -1).to(torch.int32)
    sel = random_page_select(b, 4, c, kv_len, page, 128, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        keys = page_sparse_keys(table, kv_len, c, page, sel, 128, 128, heads)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert keys.keys_per_row == min(n_past, 4 * 32 * 64) * page + c


def test_a_capped_selection_gathers_only_its_cap_and_matches_the_reference():
    """Lists chosen among ``cap`` pages a row (PageSelection.chunk_pages) with page_union = cap x lists: FA4
    gathers that many past pages, not the past, and attends as the reference does."""
    b, h, h_kv, h_sel, c, n_past, d, page, select_block, budget, cap = 2, 4, 2, 2, 32, 12, 8, 8, 8, 2, 3
    pb, kw = _problem(b, h, h_kv, h_sel, c, n_past, d, page, select_block, budget, common=False)
    g = torch.Generator().manual_seed(3)
    sel = torch.empty_like(kw["page_select"])
    for row, head in itertools.product(range(b), range(h_sel)):
        among = torch.randperm(n_past, generator=g)[:cap]
        for blk in range(sel.shape[2]):
            sel[row, head, blk] = among[torch.randperm(cap, generator=g)[:budget]].sort().values
    kw["page_select"] = sel
    keys = page_sparse_keys(pb.page_table, pb.kv_len, c, page, sel, select_block, 8, h, page_union=cap * h_sel)
    assert keys.keys_per_row == min(n_past, cap * h_sel) * page + c  # 6 pages of 12, without the cap all 12
    uncapped = page_sparse_keys(pb.page_table, pb.kv_len, c, page, sel, select_block, 8, h)
    assert uncapped.keys_per_row == n_past * page + c
    kernels = TorchFlash(sparse_blocks=(8, page))
    _compare(Flash4Attention(kernels, fallback=None), pb, {**kw, "page_union": cap * h_sel})
    assert kernels.sparse_calls == 2


def test_a_selections_chosen_pages_are_made_once_for_its_forward_and_backward(monkeypatch):
    pb, kw = _problem(2, 4, 2, 1, 32, 10, 16, 8, 16, 3)
    made = []
    real = flash4_sparse.chosen_pages
    monkeypatch.setattr(flash4_sparse, "chosen_pages", lambda *a, **k: made.append(1) or real(*a, **k))
    attention = Flash4Attention(TorchFlash(sparse_blocks=(8, 8)), fallback=None)
    _compare(attention, pb, kw)  # exact against the reference with the kept pages
    assert len(made) == 1, "the backward reused the forward's chosen pages"
    kw["page_select"].add_(0)  # changed in place (its version moves): chosen again
    attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, pb.kv_len, **kw)
    assert len(made) == 2
    other = dict(kw, page_select=kw["page_select"].clone())  # another selection of the same shapes
    attention.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, pb.kv_len, **other)
    assert len(made) == 3
