"""dK/dV of page-sparse paged attention in Triton: selected past pages and the chunk's own, one launch.

``_bwd_dkdv_sparse_kernel``: a program owns one key block of one page of one KV head and visits
only the query blocks that attend the page (a [B, H_sel, pages, query blocks] hit map), pages
most-attended first; pages nobody attends are neither read nor written. The forward and dQ of a
page-selected call are the row-major kernels of forward.py and dq.py with ``SPARSE``. Called by
``oomb.kernels.backward.paged_attention_backward``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oomb.kernels import launch
from oomb.kernels.dkdv import add_into_grad_pages, dkdv_blocks, load_key_block
from oomb.kernels.tiles import Tiles


@triton.jit
def _dkdv_group(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row,  # as in dkdv.dkdv_blocks
    h_kv, sq_h, sq_c, sdo_h, sdo_c, sl_h,
    c_lo, c_hi, n_pos, q0, C, qk_scale,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, MASK: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PREC: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
):
    """Queries c_lo .. c_hi - 1 of every query head of the group into one key block's dK, dV.

    No fused dQ under page selection: delta_base (dq_base) and 0 (rot) are placeholders.
    """
    if HEAD_MAJOR:
        n_tiles = tl.cdiv(c_hi - c_lo, BLOCK_M)
        for g in range(G):
            dk, dv = dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, delta_base,
                                 h_kv * G + g, sq_h, sq_c, sdo_h, sdo_c, sl_h, 0, n_tiles, c_lo, c_hi, n_pos, q0, C,
                                 0, qk_scale, 0, 1, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, MASK, False, HAS_DOCS,
                                 DOT_PREC, False)
    else:
        n_tiles = tl.cdiv((c_hi - c_lo) * G, BLOCK_M)
        dk, dv = dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, delta_base, h_kv, sq_h,
                             sq_c, sdo_h, sdo_c, sl_h, 0, n_tiles, c_lo * G, c_hi * G, n_pos, q0, C, 0, qk_scale, 0,
                             G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, MASK, False, HAS_DOCS, DOT_PREC, False)
    return dk, dv


@triton.jit
def _bwd_dkdv_sparse_kernel(
    Q,  # [B, H, C, DK]
    DO,  # [B, H, C, DV]
    LSE,  # [B, H, C] float32
    DELTA,  # [B, H, C] float32, contiguous
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, DK]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, DV]
    DK_POOL,  # [num_pages, H_kv, PAGE_SIZE, DK], accumulated into (read-modify-write)
    DV_POOL,  # [num_pages, H_kv, PAGE_SIZE, DV], accumulated into (read-modify-write)
    TABLE,  # [B, >= n_pages] int32
    DOC,  # [B, C] int32 document starts, contiguous (HAS_DOCS)
    HITS,  # [B, H_sel, n_items, n_qb] int8: 1 where query block qb attends page p (past: selected; chunk: causal)
    ORDER,  # [B, H_sel, n_items] int32: the pages, most-attended first
    COUNT,  # [B, H_sel, n_items] int32: how many query blocks attend ORDER's pages (non-increasing)
    sq_b, sq_h, sq_c,
    sdo_b, sdo_h, sdo_c,
    sl_b, sl_h,
    s_page, s_head, s_slot,
    sv_page, sv_head, sv_slot,
    sg_page, sg_head, sg_slot,
    sgv_page, sgv_head, sgv_slot,
    st_b,
    sh_b, sh_h, sh_p,
    so_b, so_h,
    n_bh, C, kv_len, n_pages, n_qb, sel_block, qk_scale, scale,
    H_KV: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DOCS: tl.constexpr, DOT_PREC: tl.constexpr, HEAD_MAJOR: tl.constexpr, KV_SAME: tl.constexpr,
):
    """dK/dV under page selection, of the selected past pages and the chunk's own pages in one launch.

    A program owns one key block of one page of one KV head and visits only the query blocks that
    attend the page. The work per page is uneven: a past page is selected by a few query blocks
    (or, a sink or recent page, by all), a chunk page by every later block. Programs therefore take
    the pages most-attended first (ORDER), KV heads innermost, so the long programs start first and
    the short ones fill the tail; the chunk's own pages in a launch of their own made a single wave
    bounded by its longest program. Pages nobody attends are neither read nor written.
    """
    tl.static_assert(PAGE_SIZE % BLOCK_N == 0)
    BLOCKS_PER_PAGE: tl.constexpr = PAGE_SIZE // BLOCK_N
    pid = tl.program_id(0)
    pid_bh = pid % n_bh
    rank = pid // n_bh
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    o_off = b * so_b + h_kv * so_h + rank // BLOCKS_PER_PAGE
    page_idx = tl.load(ORDER + o_off)
    n_att = tl.load(COUNT + o_off)
    q0 = kv_len - C
    n0 = page_idx * PAGE_SIZE + (rank % BLOCKS_PER_PAGE) * BLOCK_N
    n1 = n0 + BLOCK_N - 1
    if (n_att > 0) & (n0 < kv_len):
        hits_row = HITS + b * sh_b + h_kv * sh_h + page_idx * sh_p
        table_row = TABLE + b * st_b
        # Masked: the chunk's last page may be partly filled.
        n_pos, kv_ok, k, v = load_key_block(K_POOL, V_POOL, table_row, n0, kv_len, n_pages, h_kv, s_page, s_head,
                                            s_slot, sv_page, sv_head, sv_slot, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                                            PAGE_SIZE, KV_SAME)
        dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        q_base = Q + b * sq_b
        do_base = DO + b * sdo_b
        lse_base = LSE + b * sl_b
        delta_base = DELTA + b * (H_KV * G) * C
        doc_row = DOC + b * C
        n_hit = n_qb * 0
        for qb in range(n_qb):
            c0 = qb * sel_block
            hit = tl.load(hits_row + qb) != 0
            if HAS_DOCS:
                hit = hit & (tl.load(doc_row + c0) <= n1)  # the block's earliest document starts after these keys
            if hit:
                c1 = tl.minimum(c0 + sel_block, C)
                c_lo = tl.maximum(c0, n0 - q0)  # a chunk page: queries before its first key see none of it
                if q0 + c_lo < n1:  # some query precedes a key of the block: the causal diagonal
                    dk, dv = _dkdv_group(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, h_kv, sq_h,
                                         sq_c, sdo_h, sdo_c, sl_h, c_lo, c1, n_pos, q0, C, qk_scale,
                                         G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, True, HAS_DOCS, DOT_PREC, HEAD_MAJOR)
                else:
                    dk, dv = _dkdv_group(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, h_kv, sq_h,
                                         sq_c, sdo_h, sdo_c, sl_h, c_lo, c1, n_pos, q0, C, qk_scale,
                                         G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, HAS_DOCS, HAS_DOCS, DOT_PREC,
                                         HEAD_MAJOR)
                n_hit += 1
        if n_hit > 0:
            add_into_grad_pages(DK_POOL, DV_POOL, dk * scale, dv, table_row, n0, n_pages, h_kv, sg_page, sg_head,
                                sg_slot, sgv_page, sgv_head, sgv_slot, kv_ok, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                                PAGE_SIZE, KV_SAME)


def page_hits(sel: torch.Tensor, n_past: int, c: int, select_block: int, page_size: int) -> torch.Tensor:
    """[B, H_sel, n_past + ceil(C / page), n_qb] int8: 1 where query block qb attends page p.

    Past pages: where the block selected the page. The chunk's own pages: where the block holds a
    query at or after the page's first key (causal).
    """
    bsz, h_sel, n_qb, _ = sel.shape
    n_chunk = triton.cdiv(c, page_size)
    hits = torch.zeros(bsz, h_sel, n_past + n_chunk, n_qb, dtype=torch.int8, device=sel.device)
    hits[:, :, :n_past].transpose(2, 3).scatter_(3, sel.long(), 1)
    last_query = torch.clamp((torch.arange(n_qb, device=sel.device) + 1) * select_block, max=c) - 1
    first_key = torch.arange(n_chunk, device=sel.device) * page_size
    hits[:, :, n_past:] = (last_query[None, :] >= first_key[:, None]).to(torch.int8)
    return hits


def launch_sparse_dkdv(
    q: torch.Tensor,  # [B, H, C, Dk]
    d_out: torch.Tensor,  # [B, H, C, Dv]
    lse: torch.Tensor,  # [B, H, C] float32
    delta: torch.Tensor,  # [B, H, C] float32, contiguous
    k_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dk]
    v_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dv]
    dk_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dk], accumulated into
    dv_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dv], accumulated into
    page_table: torch.Tensor,  # [B, >= ceil(kv_len / page_size)] int32
    docs: torch.Tensor | None,  # [B, C] int32 document starts, contiguous
    sel: torch.Tensor,  # [B, H_sel, ceil(C / select_block), K] int32 selected past pages, contiguous
    *,
    kv_len: int,
    select_block: int,
    scale: float,
    t: Tiles,
) -> None:
    """Adds dK/dV of the selected past pages and of the chunk's own pages into the gradient pools."""
    b, h, c, d = q.shape
    d_v = v_pool.shape[-1]
    h_kv, page_size = k_pool.shape[1], k_pool.shape[2]
    g = h // h_kv
    n_pages = -(-kv_len // page_size)
    hits = page_hits(sel, (kv_len - c) // page_size, c, select_block, page_size)
    count, order = hits.sum(dim=-1, dtype=torch.int32).sort(dim=-1, descending=True, stable=True)
    order, count = order.to(torch.int32).contiguous(), count.contiguous()
    block_n = min(t.dkdv_n, page_size)
    per_head = hits.shape[1] > 1  # else one selection shared by every KV head
    _bwd_dkdv_sparse_kernel[(hits.shape[2] * (page_size // block_n) * b * h_kv,)](
        q, d_out, lse, delta, k_pool, v_pool, dk_pool, dv_pool, page_table,
        docs if docs is not None else page_table, hits, order, count,
        *launch.backward_strides(q, d_out, lse, k_pool, dk_pool, page_table, v_pool, dv_pool),
        hits.stride(0), hits.stride(1) if per_head else 0, hits.stride(2),
        order.stride(0), order.stride(1) if per_head else 0,
        b * h_kv, c, kv_len, n_pages, hits.shape[3], select_block, scale * launch.LOG2E, scale,
        H_KV=h_kv, G=g, DK=d, DV=d_v, BLOCK_DK=launch.head_block(d), BLOCK_DV=launch.head_block(d_v),
        PAGE_SIZE=page_size, BLOCK_M=t.dkdv_m, BLOCK_N=block_n,
        HAS_DOCS=docs is not None, DOT_PREC=launch.dot_precision(q.dtype), HEAD_MAJOR=t.dkdv_head_major,
        KV_SAME=launch.kv_same(k_pool, v_pool, dk_pool, dv_pool), num_warps=t.bwd_warps, num_stages=t.bwd_stages,
    )
