"""dQ of paged attention in Triton (dense and page-sparse).

``_bwd_dq_kernel``: grid (row blocks, B * H_kv), rows laid out as in the forward (common.py); a
program loops over the visible key blocks (masked | full | masked runs), after its query block's
selected past pages under page selection. Not launched when the dK/dV kernel sums dQ itself
(``Tiles.dq_fused``, dkdv.py). Called by ``oomb.kernels.backward.paged_attention_backward``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oomb.kernels import launch
from oomb.kernels.common import (
    dims_mask,
    key_block_ranges,
    kv_coords,
    load_kv,
    row_masks,
    row_tile,
    tile_rows,
    visible_mask,
)
from oomb.kernels.tiles import Tiles


@triton.jit
def _dq_step(
    dq, q, do, lse2, delta,  # dQ accumulator [BM, BLOCK_DK] fp32; q [BM, BLOCK_DK], dO [BM, BLOCK_DV]; lse2, delta [BM]
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, DK]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, DV]
    K_DESC, V_DESC,  # TMA descriptors of the pools as [num_pages * H_kv * PAGE_SIZE, D] (USE_TMA)
    table_row,  # [>= n_pages] int32
    h_kv, s_page, s_head, s_slot, sv_page, sv_head, sv_slot,
    n0, q_pos, doc, kv_len, n_pages, window, qk_scale,
    H_KV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, USE_TMA: tl.constexpr,
    KV_SAME: tl.constexpr, DOT_PREC: tl.constexpr,
):
    n_pos = n0 + tl.arange(0, BLOCK_N)
    n_ok = n_pos < kv_len
    k_coord, v_coord = kv_coords(table_row, n0, n_pages, h_kv, s_page, s_head, s_slot, sv_page, sv_head, sv_slot,
                                 H_KV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_N, USE_TMA, KV_SAME)
    k = load_kv(K_POOL, K_DESC, k_coord, n_ok, MASK, USE_TMA, DK, BLOCK_DK)
    v = load_kv(V_POOL, V_DESC, v_coord, n_ok, MASK, USE_TMA, DV, BLOCK_DV)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASK:
        p = tl.where(visible_mask(n_pos, q_pos, doc, window, HAS_WINDOW, HAS_DOCS), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)


@triton.jit
def _dq_blocks(
    dq, q, do, lse2, delta,
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, DK]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, DV]
    K_DESC, V_DESC,  # TMA descriptors of the pools as [num_pages * H_kv * PAGE_SIZE, D] (USE_TMA)
    table_row,  # [>= n_pages] int32
    DOC_ROW,  # [C] int32 document starts of the sequence (HAS_DOCS)
    h_kv, s_page, s_head, s_slot, sv_page, sv_head, sv_slot,
    j_lo, j_hi, lo_key, m0, q0, row_end, kv_len, n_pages, window, qk_scale,
    G: tl.constexpr, H_KV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, USE_TMA: tl.constexpr,
    KV_SAME: tl.constexpr, DOT_PREC: tl.constexpr,
):
    q_pos = 0
    doc = 0
    if MASK:
        q_pos, doc = row_masks(DOC_ROW, m0, q0, row_end, G, BLOCK_M, HAS_DOCS)
    for j in range(j_lo, j_hi):
        dq = _dq_step(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, h_kv, s_page, s_head,
                      s_slot, sv_page, sv_head, sv_slot, lo_key + j * BLOCK_N, q_pos, doc, kv_len, n_pages, window,
                      qk_scale, H_KV, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_N, MASK, HAS_WINDOW, HAS_DOCS,
                      USE_TMA, KV_SAME, DOT_PREC)
    return dq


@triton.jit
def _dq_pages(
    dq, q, do, lse2, delta,
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, DK]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, DV]
    K_DESC, V_DESC,  # TMA descriptors of the pools as [num_pages * H_kv * PAGE_SIZE, D] (USE_TMA)
    table_row,  # [>= n_pages] int32
    DOC_ROW,  # [C] int32 document starts of the sequence (HAS_DOCS)
    sel_row,  # [n_sel] int32: the query block's selected past pages
    n_sel, h_kv, s_page, s_head, s_slot, sv_page, sv_head, sv_slot,
    m0, q0, row_end, kv_len, n_pages, qk_scale,
    G: tl.constexpr, H_KV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DOCS: tl.constexpr, USE_TMA: tl.constexpr, KV_SAME: tl.constexpr, DOT_PREC: tl.constexpr,
):
    q_pos = 0
    doc = 0
    if HAS_DOCS:
        q_pos, doc = row_masks(DOC_ROW, m0, q0, row_end, G, BLOCK_M, HAS_DOCS)
    for i in range(n_sel):
        page = tl.load(sel_row + i)
        for jj in tl.static_range(PAGE_SIZE // BLOCK_N):
            dq = _dq_step(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, h_kv, s_page, s_head,
                          s_slot, sv_page, sv_head, sv_slot, page * PAGE_SIZE + jj * BLOCK_N, q_pos, doc, kv_len,
                          n_pages, 0, qk_scale, H_KV, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_N,
                          HAS_DOCS, False, HAS_DOCS, USE_TMA, KV_SAME, DOT_PREC)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q,  # [B, H, C, DK]
    DO,  # [B, H, C, DV]
    LSE,  # [B, H, C] float32
    DELTA,  # [B, H, C] float32, contiguous
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, DK]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, DV]
    K_DESC,  # TMA descriptor of K_POOL as [num_pages * H_kv * PAGE_SIZE, DK], block [BLOCK_N, DK] (USE_TMA)
    V_DESC,  # same for V_POOL, block [BLOCK_N, DV]
    TABLE,  # [B, >= n_pages] int32
    DOC,  # [B, C] int32 document starts, contiguous (HAS_DOCS)
    SEL,  # [B, H_sel, n_qb, n_sel] int32 selected past pages (SPARSE)
    DQ,  # [B, H, C, DK] in Q's dtype, contiguous
    sq_b, sq_h, sq_c,
    sdo_b, sdo_h, sdo_c,
    sl_b, sl_h,
    s_page, s_head, s_slot,
    sv_page, sv_head, sv_slot,
    st_b,
    ss_b, ss_h, ss_q,
    C, kv_len, n_pages, lo_key, window, qk_scale, scale,
    sel_block, tiles_per_block, n_sel,
    H_KV: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, SPARSE: tl.constexpr, USE_TMA: tl.constexpr,
    KV_SAME: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_DK >= 16 and BLOCK_DV >= 16)  # tl.dot minimum
    tl.static_assert(DK <= BLOCK_DK and DV <= BLOCK_DV)
    tl.static_assert(not USE_TMA or (PAGE_SIZE % BLOCK_N == 0 and DK == BLOCK_DK and DV == BLOCK_DV))  # TMA boxes
    tl.static_assert(not SPARSE or (PAGE_SIZE % BLOCK_N == 0 and not HAS_WINDOW))
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest rows first
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    kv_head = pid_bh % H_KV
    h_kv = kv_head.to(tl.int64)
    q0 = kv_len - C
    qb, m0, row_end = row_tile(pid, C, sel_block, tiles_per_block, G, BLOCK_M, SPARSE)

    row_ok, c, g, _ = tile_rows(m0, q0, row_end, G, BLOCK_M)
    head = h_kv * G + g
    c64 = c.to(tl.int64)
    offs_dk = tl.arange(0, BLOCK_DK)
    q = tl.load(Q + b * sq_b + (head * sq_h + c64 * sq_c)[:, None] + offs_dk[None, :],
                mask=dims_mask(row_ok[:, None], DK, BLOCK_DK), other=0.0)
    do = tl.load(DO + b * sdo_b + (head * sdo_h + c64 * sdo_c)[:, None] + tl.arange(0, BLOCK_DV)[None, :],
                 mask=dims_mask(row_ok[:, None], DV, BLOCK_DV), other=0.0)
    lse2 = tl.load(LSE + b * sl_b + head * sl_h + c, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + b * (H_KV * G) * C + head * C + c, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)

    c_lo = tl.minimum(m0 // G, C - 1)
    c_hi = tl.minimum((tl.minimum(m0 + BLOCK_M, row_end) - 1) // G, C - 1)
    p_lo = q0 + c_lo
    p_hi = q0 + c_hi
    doc_row = DOC + b * C
    doc_lo = 0
    doc_hi = 0
    if HAS_DOCS:
        doc_lo = tl.load(doc_row + c_lo)
        doc_hi = tl.load(doc_row + c_hi)
    table_row = TABLE + b * st_b
    if SPARSE:
        dq = _dq_pages(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                       SEL + b * ss_b + h_kv * ss_h + qb * ss_q, n_sel, kv_head, s_page, s_head, s_slot,
                       sv_page, sv_head, sv_slot, m0, q0, row_end, kv_len, n_pages, qk_scale,
                       G, H_KV, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_M, BLOCK_N, HAS_DOCS, USE_TMA, KV_SAME,
                       DOT_PREC)
    j0, j1, j2, j3 = key_block_ranges(p_lo, p_hi, lo_key, window, doc_lo, doc_hi, BLOCK_N, HAS_WINDOW, HAS_DOCS)
    if HAS_WINDOW or HAS_DOCS:
        dq = _dq_blocks(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                        kv_head, s_page, s_head, s_slot, sv_page, sv_head, sv_slot, j0, j1, lo_key, m0, q0, row_end,
                        kv_len, n_pages, window, qk_scale, G, H_KV, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_M,
                        BLOCK_N, True, HAS_WINDOW, HAS_DOCS, USE_TMA, KV_SAME, DOT_PREC)
    dq = _dq_blocks(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                    kv_head, s_page, s_head, s_slot, sv_page, sv_head, sv_slot, j1, j2, lo_key, m0, q0, row_end,
                    kv_len, n_pages, window, qk_scale, G, H_KV, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_M,
                    BLOCK_N, False, HAS_WINDOW, HAS_DOCS, USE_TMA, KV_SAME, DOT_PREC)
    dq = _dq_blocks(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                    kv_head, s_page, s_head, s_slot, sv_page, sv_head, sv_slot, j2, j3, lo_key, m0, q0, row_end,
                    kv_len, n_pages, window, qk_scale, G, H_KV, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_M,
                    BLOCK_N, True, HAS_WINDOW, HAS_DOCS, USE_TMA, KV_SAME, DOT_PREC)
    dq = dq * scale
    dq_rows = b * (H_KV * G) * C * DK + (head * C + c64) * DK
    tl.store(DQ + dq_rows[:, None] + offs_dk[None, :], dq.to(DQ.dtype.element_ty),
             mask=dims_mask(row_ok[:, None], DK, BLOCK_DK))


def launch_dq(
    q: torch.Tensor,  # [B, H, C, Dk]
    d_out: torch.Tensor,  # [B, H, C, Dv]
    lse: torch.Tensor,  # [B, H, C] float32
    delta: torch.Tensor,  # [B, H, C] float32, contiguous
    k_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dk]
    v_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dv]
    page_table: torch.Tensor,  # [B, >= ceil(kv_len / page_size)] int32
    docs: torch.Tensor | None,  # [B, C] int32 document starts, contiguous
    sel: torch.Tensor | None,  # [B, H_sel, ceil(C / select_block), K] int32 selected past pages, contiguous
    *,
    kv_len: int,
    lo_key: int,
    window: int,
    scale: float,
    has_window: bool,
    select_block: int | None,
    t: Tiles,
) -> torch.Tensor:
    """Returns dq [B, H, C, Dk] in q.dtype."""
    b, h, c, d = q.shape
    d_v = v_pool.shape[-1]
    h_kv, page_size = k_pool.shape[1], k_pool.shape[2]
    g = h // h_kv
    n_pages = -(-kv_len // page_size)
    dq = launch.empty_buffer((b, h, c, d), q.dtype, q.device)
    block_n = t.dq_n if sel is None else min(t.dq_n, page_size)
    k_desc, v_desc, use_tma = launch.kv_descriptors(k_pool, v_pool, t, block_n)
    sel_strides, sel_block, tiles_per_block, n_sel = launch.sparse_grid_args(sel, c, g, t.dq_m, select_block)
    n_row_tiles = (triton.cdiv(c, select_block) * tiles_per_block if sel is not None
                   else triton.cdiv(c * g, t.dq_m))
    _bwd_dq_kernel[(n_row_tiles, b * h_kv)](
        q, d_out, lse, delta, k_pool, v_pool, k_desc, v_desc, page_table, docs if docs is not None else page_table,
        sel if sel is not None else page_table, dq,
        q.stride(0), q.stride(1), q.stride(2),
        d_out.stride(0), d_out.stride(1), d_out.stride(2),
        lse.stride(0), lse.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        page_table.stride(0),
        *sel_strides,
        c, kv_len, n_pages, lo_key, window, scale * launch.LOG2E, scale,
        sel_block, tiles_per_block, n_sel,
        H_KV=h_kv, G=g, DK=d, DV=d_v, BLOCK_DK=launch.head_block(d), BLOCK_DV=launch.head_block(d_v),
        PAGE_SIZE=page_size, BLOCK_M=t.dq_m, BLOCK_N=block_n,
        HAS_WINDOW=has_window, HAS_DOCS=docs is not None, SPARSE=sel is not None, USE_TMA=use_tma,
        KV_SAME=launch.kv_same(k_pool, v_pool), DOT_PREC=launch.dot_precision(q.dtype), num_warps=t.bwd_warps,
        num_stages=t.bwd_stages,
    )
    return dq
