"""dK/dV of dense paged attention in Triton, added into the store's gradient pages.

``_bwd_dkdv_kernel``: grid (key blocks, B * H_kv). A program owns the dK/dV of its key block for
all G query heads (rows of the whole group), so no two programs write the same slot: no atomics.
It read-modify-writes the gradient pools (they hold other chunks' gradients), fp32 accumulation,
stores in the pool's dtype. With ``Tiles.dq_fused`` (dense calls only) it also adds each row
tile's dS @ K into an fp32 dQ with atomics (FUSED_DQ) and the dQ kernel (dq.py) is not launched:
5 matmuls per (key block, row tile) instead of 4 here + 3 in the dQ kernel, FlashAttention-2's
scheme; the price is atomic traffic and a [BLOCK_M, Dk] fp32 tile more in registers.

``dkdv_blocks``, ``load_key_block`` and ``add_into_grad_pages`` serve the page-sparse dK/dV
kernel (sparse_backward.py) too. Called by ``oomb.kernels.backward.paged_attention_backward``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oomb.kernels import launch
from oomb.kernels.common import (
    count_le,
    dims_mask,
    dims_mask_t,
    key_pages,
    row_block_ranges,
    tile_rows,
    visible_mask,
)
from oomb.kernels.tiles import Tiles


@triton.jit
def dkdv_blocks(
    dk, dv, k, v,  # dK [BN, BLOCK_DK], dV [BN, BLOCK_DV] accumulators fp32; the key block's K, V tiles
    q_base,  # Q + b * sq_b
    do_base,  # DO + b * sdo_b
    lse_base,  # LSE + b * sl_b
    delta_base,  # DELTA + b * H * C
    doc_row,  # DOC + b * C
    dq_base,  # DQ_ACC + b * H * C * DK (FUSED_DQ)
    h_kv, sq_h, sq_c, sdo_h, sdo_c, sl_h,
    i_lo, i_hi, m_start, row_end, n_pos, q0, C, window, qk_scale,
    rot,  # the full run starts at its tile rot % (i_hi - i_lo) (FUSED_DQ)
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PREC: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    """Row tiles i_lo .. i_hi - 1 (rows m_start + i * BLOCK_M ..., below row_end) into dK, dV.

    FUSED_DQ: also adds each tile's dS @ K (unscaled) into the fp32 dQ rows at dq_base, contiguous
    [H, C, DK], with atomics: other key blocks' programs add into the same rows.
    """
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for i in range(i_lo, i_hi):
        tile = i
        if FUSED_DQ and not MASK:
            # Every key block before the chunk has the same full run (all row tiles): walked in the
            # same order, all running programs would add into the same dQ rows at the same time.
            tile = i_lo + (i - i_lo + rot) % (i_hi - i_lo)
        row_ok, c, g, q_pos = tile_rows(m_start + tile * BLOCK_M, q0, row_end, G, BLOCK_M)
        head = h_kv * G + g
        c64 = c.to(tl.int64)
        # Rows past the chunk load q = dO = 0 (and lse = delta = 0): they add exactly 0.
        qT = tl.load(q_base + (head * sq_h + c64 * sq_c)[None, :] + offs_dk[:, None],
                     mask=dims_mask_t(row_ok[None, :], DK, BLOCK_DK), other=0.0)
        lse2 = tl.load(lse_base + head * sl_h + c, mask=row_ok, other=0.0) * 1.4426950408889634
        sT = tl.dot(k, qT, input_precision=DOT_PREC) * qk_scale  # [BN, BM], log2 units
        pT = tl.math.exp2(sT - lse2[None, :])
        if MASK:
            doc = q_pos
            if HAS_DOCS:
                doc = tl.load(doc_row + c, mask=row_ok, other=0)
            vis = tl.trans(visible_mask(n_pos, q_pos, doc, window, HAS_WINDOW, HAS_DOCS))
            pT = tl.where(vis, pT, 0.0)
        do = tl.load(do_base + (head * sdo_h + c64 * sdo_c)[:, None] + offs_dv[None, :],
                     mask=dims_mask(row_ok[:, None], DV, BLOCK_DV), other=0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        delta = tl.load(delta_base + head * C + c, mask=row_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # [BN, BM]
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PREC)
        if FUSED_DQ:
            dq = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=DOT_PREC)  # [BM, BLOCK_DK]
            # Relaxed: the sums are read only after the kernel ends, so no ordering is needed.
            tl.atomic_add(dq_base + ((head * C + c64) * DK)[:, None] + offs_dk[None, :], dq,
                          mask=dims_mask(row_ok[:, None], DK, BLOCK_DK), sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_rows(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base,  # as in dkdv_blocks
    h_kv,  # KV head (interleaved rows, G > 1) or the query head itself (G == 1)
    sq_h, sq_c, sdo_h, sdo_c, sl_h,
    i0, i1, i2, i3, m_start, row_end, n_pos, q0, C, window, qk_scale, rot,
    G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PREC: tl.constexpr, FUSED_DQ: tl.constexpr,
):
    """The three runs of row tiles of row_block_ranges: causal diagonal (masked), full, edge (masked)."""
    dk, dv = dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, h_kv, sq_h, sq_c,
                         sdo_h, sdo_c, sl_h, i0, i1, m_start, row_end, n_pos, q0, C, window, qk_scale, rot,
                         G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, True, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    dk, dv = dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, h_kv, sq_h, sq_c,
                         sdo_h, sdo_c, sl_h, i1, i2, m_start, row_end, n_pos, q0, C, window, qk_scale, rot,
                         G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, False, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    if HAS_WINDOW or HAS_DOCS:
        dk, dv = dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, h_kv, sq_h,
                             sq_c, sdo_h, sdo_c, sl_h, i2, i3, m_start, row_end, n_pos, q0, C, window, qk_scale, rot,
                             G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, True, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    return dk, dv


@triton.jit
def add_into_grad_pages(
    DK_POOL,  # [num_pages, H_kv, PAGE_SIZE, DK] gradient pool, read-modify-written
    DV_POOL,  # [num_pages, H_kv, PAGE_SIZE, DV] gradient pool, read-modify-written
    dk, dv,  # [BN, BLOCK_DK], [BN, BLOCK_DV] fp32 sums of the key block
    table_row,  # [>= n_pages] int32
    n0, n_pages, h_kv, sg_page, sg_head, sg_slot, sgv_page, sgv_head, sgv_slot,
    kv_ok,  # [BN, 1] keys before kv_len
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_SAME: tl.constexpr,
):
    """Read-modify-write of one key block's gradient slots (they hold other chunks' sums)."""
    page, slot = key_pages(table_row, n0, n_pages, BLOCK_N, PAGE_SIZE)
    k_rows = page * sg_page + h_kv * sg_head + slot * sg_slot
    if KV_SAME:
        v_rows = k_rows
    else:
        v_rows = page * sgv_page + h_kv * sgv_head + slot * sgv_slot
    k_ptrs = k_rows[:, None] + tl.arange(0, BLOCK_DK)[None, :]
    k_ok = dims_mask(kv_ok, DK, BLOCK_DK)
    old_dk = tl.load(DK_POOL + k_ptrs, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(DK_POOL + k_ptrs, (old_dk + dk).to(DK_POOL.dtype.element_ty), mask=k_ok)
    v_ptrs = v_rows[:, None] + tl.arange(0, BLOCK_DV)[None, :]
    v_ok = dims_mask(kv_ok, DV, BLOCK_DV)
    old_dv = tl.load(DV_POOL + v_ptrs, mask=v_ok, other=0.0).to(tl.float32)
    tl.store(DV_POOL + v_ptrs, (old_dv + dv).to(DV_POOL.dtype.element_ty), mask=v_ok)


@triton.jit
def load_key_block(
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, DK]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, DV]
    table_row,  # [>= n_pages] int32
    n0, kv_len, n_pages, h_kv, s_page, s_head, s_slot, sv_page, sv_head, sv_slot,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_SAME: tl.constexpr,
):
    """A dK/dV program's keys n0 .. n0 + BLOCK_N - 1 of KV head h_kv: (positions, in-range mask [BN, 1],
    K [BN, BLOCK_DK] and V [BN, BLOCK_DV] tiles with keys past kv_len and columns past the head sizes read as 0)."""
    n_pos = n0 + tl.arange(0, BLOCK_N)
    kv_ok = (n_pos < kv_len)[:, None]
    page, slot = key_pages(table_row, n0, n_pages, BLOCK_N, PAGE_SIZE)
    k_rows = page * s_page + h_kv * s_head + slot * s_slot
    if KV_SAME:
        v_rows = k_rows
    else:
        v_rows = page * sv_page + h_kv * sv_head + slot * sv_slot
    k = tl.load(K_POOL + k_rows[:, None] + tl.arange(0, BLOCK_DK)[None, :], mask=dims_mask(kv_ok, DK, BLOCK_DK),
                other=0.0)
    v = tl.load(V_POOL + v_rows[:, None] + tl.arange(0, BLOCK_DV)[None, :], mask=dims_mask(kv_ok, DV, BLOCK_DV),
                other=0.0)
    return n_pos, kv_ok, k, v


@triton.jit
def _bwd_dkdv_kernel(
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
    DQ_ACC,  # [B, H, C, DK] float32, contiguous, zeroed: dS @ K summed over key blocks (FUSED_DQ)
    sq_b, sq_h, sq_c,
    sdo_b, sdo_h, sdo_c,
    sl_b, sl_h,
    s_page, s_head, s_slot,
    sv_page, sv_head, sv_slot,
    sg_page, sg_head, sg_slot,
    sgv_page, sgv_head, sgv_slot,
    st_b,
    C, kv_len, n_pages, lo_key, window, qk_scale, scale,
    H_KV: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, LOG2_C: tl.constexpr, DOT_PREC: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, FUSED_DQ: tl.constexpr, KV_SAME: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_DK >= 16 and BLOCK_DV >= 16)  # tl.dot minimum
    tl.static_assert(DK <= BLOCK_DK and DV <= BLOCK_DV)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    q0 = kv_len - C
    n0 = lo_key + pid_n * BLOCK_N
    n1 = tl.minimum(n0 + BLOCK_N, kv_len) - 1

    table_row = TABLE + b * st_b
    n_pos, kv_ok, k, v = load_key_block(K_POOL, V_POOL, table_row, n0, kv_len, n_pages, h_kv, s_page, s_head, s_slot,
                                        sv_page, sv_head, sv_slot, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N, PAGE_SIZE,
                                        KV_SAME)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    doc_row = DOC + b * C
    c_end = C
    c_full = C
    if HAS_DOCS:
        # Queries whose document starts at or before the block's last (first) key: a prefix of the chunk.
        c_end = count_le(doc_row, C, n1, LOG2_C)
        c_full = count_le(doc_row, C, n0, LOG2_C)
    q_base = Q + b * sq_b
    do_base = DO + b * sdo_b
    lse_base = LSE + b * sl_b
    delta_base = DELTA + b * (H_KV * G) * C
    dq_base = DQ_ACC + b * (H_KV * G) * C * DK
    if HEAD_MAJOR:
        # One query head at a time: row tiles of BLOCK_M consecutive positions of that head
        # (contiguous rows of Q and dO), the group's heads summed into the same dK/dV.
        i0, i1, i2, i3 = row_block_ranges(n0, n1, q0, C, window, c_end, c_full, 1, BLOCK_M, HAS_WINDOW, HAS_DOCS)
        for t in range(G):
            g = t
            if FUSED_DQ:
                # Full runs rotate by pid_n (see dkdv_blocks), so programs a chunk's worth of row tiles
                # apart would meet on the same tile: they start on different heads instead.
                g = (t + pid_n // tl.cdiv(C, BLOCK_M)) % G
            head = h_kv * G + g
            dk, dv = _dkdv_rows(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, head, sq_h,
                                sq_c, sdo_h, sdo_c, sl_h, i0, i1, i2, i3, 0, C, n_pos, q0, C, window, qk_scale, pid_n,
                                1, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    else:
        i0, i1, i2, i3 = row_block_ranges(n0, n1, q0, C, window, c_end, c_full, G, BLOCK_M, HAS_WINDOW, HAS_DOCS)
        dk, dv = _dkdv_rows(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, h_kv, sq_h,
                            sq_c, sdo_h, sdo_c, sl_h, i0, i1, i2, i3, 0, C * G, n_pos, q0, C, window, qk_scale, pid_n,
                            G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    # Add into the gradient pages; slots past kv_len are left as they are.
    add_into_grad_pages(DK_POOL, DV_POOL, dk * scale, dv, table_row, n0, n_pages, h_kv, sg_page, sg_head, sg_slot,
                        sgv_page, sgv_head, sgv_slot, kv_ok, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N, PAGE_SIZE, KV_SAME)


def launch_dkdv(
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
    *,
    kv_len: int,
    lo_key: int,
    window: int,
    scale: float,
    has_window: bool,
    t: Tiles,
    fused_dq: bool,
) -> torch.Tensor:
    """Adds dK/dV of every key block from ``lo_key`` on into the gradient pools. Returns the fp32
    [B, H, C, Dk] sum of dS @ K over key blocks (unscaled) when ``fused_dq``, else ``delta`` (unused)."""
    b, h, c, d = q.shape
    d_v = v_pool.shape[-1]
    h_kv, page_size = k_pool.shape[1], k_pool.shape[2]
    g = h // h_kv
    n_pages = -(-kv_len // page_size)
    # Every key block adds into it, so it starts at zero (not empty_buffer); delta stands in when unused.
    dq_acc = torch.zeros((b, h, c, d), dtype=torch.float32, device=q.device) if fused_dq else delta
    grid_kv = (triton.cdiv(kv_len - lo_key, t.dkdv_n), b * h_kv)
    _bwd_dkdv_kernel[grid_kv](
        q, d_out, lse, delta, k_pool, v_pool, dk_pool, dv_pool, page_table,
        docs if docs is not None else page_table, dq_acc,
        *launch.backward_strides(q, d_out, lse, k_pool, dk_pool, page_table, v_pool, dv_pool),
        c, kv_len, n_pages, lo_key, window, scale * launch.LOG2E, scale,
        H_KV=h_kv, G=g, DK=d, DV=d_v, BLOCK_DK=launch.head_block(d), BLOCK_DV=launch.head_block(d_v),
        PAGE_SIZE=page_size, BLOCK_M=t.dkdv_m, BLOCK_N=t.dkdv_n,
        HAS_WINDOW=has_window, HAS_DOCS=docs is not None, LOG2_C=c.bit_length(), DOT_PREC=launch.dot_precision(q.dtype),
        HEAD_MAJOR=t.dkdv_head_major, FUSED_DQ=fused_dq, KV_SAME=launch.kv_same(k_pool, v_pool, dk_pool, dv_pool),
        num_warps=t.bwd_warps, num_stages=t.bwd_stages,
    )
    return dq_acc
