"""The forward of paged attention in Triton: one launch, online softmax, the log-sum-exp saved.

``_fwd_kernel``: grid (row blocks, B * H_kv); a program owns one KV head and a block of rows of
the (query position, group head) axis (oomb/kernels/common.py draws the layout) and runs an
online softmax in exp2 over its key blocks: masked | full | masked runs over the visible keys,
after the block's selected past pages under page selection. The PyTorch reference with the same
signature is ``oomb.kernels.reference.paged_attention_forward``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oomb.kernels import launch, tiles
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


@triton.jit
def _fwd_step(
    acc, l_i, m_i, q,  # running state [BM, BLOCK_DV], [BM], [BM] fp32 (log2 units); q tile [BM, BLOCK_DK]
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
    """Online-softmax update of one row tile with the key block n0 .. n0 + BLOCK_N - 1."""
    n_pos = n0 + tl.arange(0, BLOCK_N)
    n_ok = n_pos < kv_len
    k_coord, v_coord = kv_coords(table_row, n0, n_pages, h_kv, s_page, s_head, s_slot, sv_page, sv_head, sv_slot,
                                 H_KV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_N, USE_TMA, KV_SAME)
    k = load_kv(K_POOL, K_DESC, k_coord, n_ok, MASK, USE_TMA, DK, BLOCK_DK)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
    if MASK:
        vis = visible_mask(n_pos, q_pos, doc, window, HAS_WINDOW, HAS_DOCS)
        s = tl.where(vis, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = load_kv(V_POOL, V_DESC, v_coord, n_ok, MASK, USE_TMA, DV, BLOCK_DV)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q,
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
    """Key blocks j_lo .. j_hi - 1 (keys lo_key + j * BLOCK_N ...)."""
    q_pos = 0
    doc = 0
    if MASK:
        q_pos, doc = row_masks(DOC_ROW, m0, q0, row_end, G, BLOCK_M, HAS_DOCS)
    for j in range(j_lo, j_hi):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row,
                                  h_kv, s_page, s_head, s_slot, sv_page, sv_head, sv_slot, lo_key + j * BLOCK_N, q_pos,
                                  doc, kv_len, n_pages, window, qk_scale, H_KV, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE,
                                  BLOCK_N, MASK, HAS_WINDOW, HAS_DOCS, USE_TMA, KV_SAME, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _fwd_pages(
    acc, l_i, m_i, q,
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
    """The selected past pages of a query block: wholly before every query, so only documents mask."""
    q_pos = 0
    doc = 0
    if HAS_DOCS:
        q_pos, doc = row_masks(DOC_ROW, m0, q0, row_end, G, BLOCK_M, HAS_DOCS)
    for i in range(n_sel):
        page = tl.load(sel_row + i)
        for jj in tl.static_range(PAGE_SIZE // BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row,
                                      h_kv, s_page, s_head, s_slot, sv_page, sv_head, sv_slot,
                                      page * PAGE_SIZE + jj * BLOCK_N, q_pos, doc, kv_len, n_pages, 0, qk_scale,
                                      H_KV, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_N,
                                      HAS_DOCS, False, HAS_DOCS, USE_TMA, KV_SAME, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q,  # [B, H, C, DK]
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, DK]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, DV]
    K_DESC,  # TMA descriptor of K_POOL as [num_pages * H_kv * PAGE_SIZE, DK], block [BLOCK_N, DK] (USE_TMA)
    V_DESC,  # same for V_POOL, block [BLOCK_N, DV]
    TABLE,  # [B, >= n_pages] int32
    SINKS,  # [H] float (read only when HAS_SINKS)
    DOC,  # [B, C] int32 document start of each query, contiguous (HAS_DOCS)
    SEL,  # [B, H_sel, n_qb, n_sel] int32 selected past pages (SPARSE)
    OUT,  # [B, H, C, DV] in Q's dtype
    LSE,  # [B, H, C] float32
    sq_b, sq_h, sq_c,
    s_page, s_head, s_slot,
    sv_page, sv_head, sv_slot,
    st_b,
    so_b, so_h, so_c,
    sl_b, sl_h,
    ss_b, ss_h, ss_q,
    C, kv_len, n_pages, lo_key, window, qk_scale,
    sel_block, tiles_per_block, n_sel,
    H_KV: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOCS: tl.constexpr, SPARSE: tl.constexpr,
    USE_TMA: tl.constexpr, KV_SAME: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_DK >= 16 and BLOCK_DV >= 16)  # tl.dot minimum
    tl.static_assert(DK <= BLOCK_DK and DV <= BLOCK_DV)
    tl.static_assert(not USE_TMA or (PAGE_SIZE % BLOCK_N == 0 and DK == BLOCK_DK and DV == BLOCK_DV))  # TMA boxes
    tl.static_assert(not SPARSE or (PAGE_SIZE % BLOCK_N == 0 and not HAS_WINDOW))
    # Rows near the end of the chunk see the most keys: launch them first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    kv_head = pid_bh % H_KV
    h_kv = kv_head.to(tl.int64)
    q0 = kv_len - C
    qb, m0, row_end = row_tile(pid, C, sel_block, tiles_per_block, G, BLOCK_M, SPARSE)

    row_ok, c, g, _ = tile_rows(m0, q0, row_end, G, BLOCK_M)
    head = h_kv * G + g  # int64 [BM]
    q = tl.load(Q + (b * sq_b + head * sq_h + c.to(tl.int64) * sq_c)[:, None] + tl.arange(0, BLOCK_DK)[None, :],
                mask=dims_mask(row_ok[:, None], DK, BLOCK_DK), other=0.0)

    if HAS_SINKS:
        # The sink is a key of logit sinks[h] and value 0: start from m = sink, l = 1.
        m_i = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        # A finite start (not -inf): a row that has seen no visible key yet gets p = 0, not NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    c_lo = tl.minimum(m0 // G, C - 1)
    c_hi = tl.minimum((tl.minimum(m0 + BLOCK_M, row_end) - 1) // G, C - 1)
    p_lo = q0 + c_lo
    p_hi = q0 + c_hi
    doc_row = DOC + b * C
    doc_lo = 0
    doc_hi = 0
    if HAS_DOCS:
        doc_lo = tl.load(doc_row + c_lo)  # starts are non-decreasing along the chunk
        doc_hi = tl.load(doc_row + c_hi)
    table_row = TABLE + b * st_b
    if SPARSE:
        acc, l_i, m_i = _fwd_pages(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                                   SEL + b * ss_b + h_kv * ss_h + qb * ss_q, n_sel, kv_head,
                                   s_page, s_head, s_slot, sv_page, sv_head, sv_slot,
                                   m0, q0, row_end, kv_len, n_pages, qk_scale,
                                   G, H_KV, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, BLOCK_M, BLOCK_N, HAS_DOCS,
                                   USE_TMA, KV_SAME, DOT_PREC)
    j0, j1, j2, j3 = key_block_ranges(p_lo, p_hi, lo_key, window, doc_lo, doc_hi, BLOCK_N, HAS_WINDOW, HAS_DOCS)
    if HAS_WINDOW or HAS_DOCS:
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                                    kv_head, s_page, s_head, s_slot, sv_page, sv_head, sv_slot, j0, j1, lo_key, m0,
                                    q0, row_end, kv_len, n_pages, window, qk_scale, G, H_KV, DK, DV, BLOCK_DK,
                                    BLOCK_DV, PAGE_SIZE, BLOCK_M, BLOCK_N,
                                    True, HAS_WINDOW, HAS_DOCS, USE_TMA, KV_SAME, DOT_PREC)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                                kv_head, s_page, s_head, s_slot, sv_page, sv_head, sv_slot, j1, j2, lo_key, m0, q0,
                                row_end, kv_len, n_pages, window, qk_scale, G, H_KV, DK, DV, BLOCK_DK, BLOCK_DV,
                                PAGE_SIZE, BLOCK_M, BLOCK_N, False, HAS_WINDOW, HAS_DOCS, USE_TMA, KV_SAME, DOT_PREC)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                                kv_head, s_page, s_head, s_slot, sv_page, sv_head, sv_slot, j2, j3, lo_key, m0, q0,
                                row_end, kv_len, n_pages, window, qk_scale, G, H_KV, DK, DV, BLOCK_DK, BLOCK_DV,
                                PAGE_SIZE, BLOCK_M, BLOCK_N, True, HAS_WINDOW, HAS_DOCS, USE_TMA, KV_SAME, DOT_PREC)

    # Every query sees at least its own key, so l_i > 0 on real rows.
    out = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log
    # Row addresses recomputed after the loops, not held in registers through them.
    row_ok, c, g, _ = tile_rows(m0, q0, row_end, G, BLOCK_M)
    head = h_kv * G + g
    o_rows = b * so_b + head * so_h + c.to(tl.int64) * so_c
    tl.store(OUT + o_rows[:, None] + tl.arange(0, BLOCK_DV)[None, :], out.to(OUT.dtype.element_ty),
             mask=dims_mask(row_ok[:, None], DV, BLOCK_DV))
    tl.store(LSE + b * sl_b + head * sl_h + c, lse, mask=row_ok)


def paged_attention_forward(
    q: torch.Tensor,  # [B, H, C, Dk]
    k_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dk]
    v_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dv]
    page_table: torch.Tensor,  # [B, >= ceil(kv_len / page_size)] int32
    kv_len: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [H]
    doc_start: torch.Tensor | None = None,  # [B, C]
    page_select: torch.Tensor | None = None,  # [B, H_sel, ceil(C / select_block), K] int32
    select_block: int | None = None,
    block_tokens: int | None = None,  # accepted for signature parity with the reference; unused
    page_union: int | None = None,  # as in the reference; unused
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B, H, C, Dv] in q.dtype, lse [B, H, C] float32)."""
    b, h, c, d, h_kv, page_size, n_pages = launch.check_args(q, k_pool, v_pool, page_table, kv_len, sliding_window,
                                                             sinks)
    d_v = v_pool.shape[-1]
    g = h // h_kv
    q, page_table = launch.last_dim_contiguous(q), launch.last_dim_contiguous(page_table)
    sinks = sinks.contiguous() if sinks is not None else None
    t = tiles.choose_tiles(launch.tile_head_dim(d, d_v), page_size, q.dtype)
    docs, sel = launch.visibility_args(q, h_kv, kv_len, page_size, sliding_window, doc_start, page_select, select_block)
    out = launch.empty_buffer((b, h, c, d_v), q.dtype, q.device)
    lse = launch.empty_buffer((b, h, c), torch.float32, q.device)
    lo_key, window = launch.window_args(kv_len, c, page_size, sliding_window)
    block_n = t.fwd_n
    if sel is not None:
        lo_key, block_n = kv_len - c, min(block_n, page_size)  # the past comes from the page lists
    k_desc, v_desc, use_tma = launch.kv_descriptors(k_pool, v_pool, t, block_n)
    sel_strides, sel_block, tiles_per_block, n_sel = launch.sparse_grid_args(sel, c, g, t.fwd_m, select_block)
    n_row_tiles = triton.cdiv(c, select_block) * tiles_per_block if sel is not None else triton.cdiv(c * g, t.fwd_m)
    _fwd_kernel[(n_row_tiles, b * h_kv)](
        q, k_pool, v_pool, k_desc, v_desc, page_table, sinks if sinks is not None else lse,
        docs if docs is not None else page_table, sel if sel is not None else page_table, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        *sel_strides,
        c, kv_len, n_pages, lo_key, window, scale * launch.LOG2E,
        sel_block, tiles_per_block, n_sel,
        H_KV=h_kv, G=g, DK=d, DV=d_v, BLOCK_DK=launch.head_block(d), BLOCK_DV=launch.head_block(d_v),
        PAGE_SIZE=page_size, BLOCK_M=t.fwd_m, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, HAS_DOCS=docs is not None,
        SPARSE=sel is not None, USE_TMA=use_tma, KV_SAME=launch.kv_same(k_pool, v_pool),
        DOT_PREC=launch.dot_precision(q.dtype), num_warps=t.fwd_warps, num_stages=t.fwd_stages,
    )
    return out, lse
