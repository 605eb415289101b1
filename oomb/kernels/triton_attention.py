"""Paged attention of one chunk's queries over the K/V store, in Triton.

Same signatures and conventions as ``oomb.kernels.reference`` (read its docstring): the
queries are the newest C tokens, absolute positions kv_len-C .. kv_len-1; pools are
[num_pages, H_kv, page_size, D]; query head h reads KV head h // G; key j is visible to
query i when j <= i (and i - j < W with a sliding window); ``sinks`` join the softmax
denominator; lse is natural-log, sink included.

GQA layout. A program owns one KV head and a block of ROWS of the flattened
(query position, group head) axis, row = c * G + g, whose position is kv_len - C + c:

    rows    0   1 ... G-1 | G  G+1 ... 2G-1 | ...
    (c, g) (0,0)(0,1)     | (1,0)(1,1)      | ...

So every K/V tile a program loads serves all G query heads of its group (G times less
K/V traffic than a program per query head), and a block of BLOCK_M rows spans only
BLOCK_M / G positions, so the causal diagonal (masked work) is G times thinner. Looping
over heads inside a program would keep the K/V reuse too but multiply the register
footprint (G accumulators) or reload K/V per head.

Kernels (one launch each):
- ``_fwd_kernel``: grid (row blocks, B * H_kv); online softmax in exp2 over key blocks.
- ``_bwd_delta_kernel``: delta = rowsum(dO * O), fp32.
- ``_bwd_dkdv_kernel``: grid (key blocks, B * H_kv). A program owns the dK/dV of its key
  block for all G query heads (rows of the whole group), so no two programs write the
  same slot: no atomics. It read-modify-writes the gradient pools (they hold other
  chunks' gradients), fp32 accumulation, stores in the pool's dtype.
- ``_bwd_dq_kernel``: grid (row blocks, B * H_kv), loops over the visible key blocks.
- With ``Tiles.dq_fused`` (dense calls only) the dK/dV kernel also adds each row tile's
  dS @ K into an fp32 dQ with atomics (FUSED_DQ) and the dQ kernel is not launched: 5
  matmuls per (key block, row tile) instead of 4 there + 3 in the dQ kernel, FlashAttention-2's
  scheme; the price is atomic traffic and a [BLOCK_M, D] fp32 tile more in registers.

Key blocks: BLOCK_N keys from the first visible page on, page-aligned. A block inside one
page (page_size % BLOCK_N == 0, the usual case) needs one page id per block and can be read
with TMA (the pool seen as a 2D [num_pages * H_kv * page_size, D] tensor); otherwise a block
spans pages and every key looks up its own page id (any page_size works). Each loop over
blocks is split into masked | unmasked | masked runs (sliding-window edge, interior, causal
diagonal), so only edge blocks pay for masks. Slots past kv_len are never trusted (they may
hold NaN). Page ids must be distinct within the table (the store guarantees it): the dK/dV
pass writes pages in place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: pointer loads only
    TensorDescriptor = None

from oomb.kernels.reference import _first_visible_page, check_visibility_args

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------
# Shared @triton.jit helpers
# --------------------------------------------------------------------------------------


@triton.jit
def _kv_offsets(
    table_row,  # [>= n_pages] int32: this sequence's row of the page table
    n0,  # first key position of the block
    n_pages,
    head_off,  # int64: kv_head * stride_head
    s_page,
    s_slot,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """int64 element offsets [BLOCK_N] of keys n0 .. n0 + BLOCK_N - 1 of one KV head in a pool."""
    offs = tl.arange(0, BLOCK_N)
    if PAGE_SIZE % BLOCK_N == 0:
        # The block lies inside one page: one page id (a scalar load) per block.
        page = tl.load(table_row + n0 // PAGE_SIZE).to(tl.int64)
        rows = page * s_page + head_off + (n0 % PAGE_SIZE + offs) * s_slot
    else:
        # The block spans several pages: one page id per key (PAGE_SIZE is a constexpr, so // is cheap).
        pos = n0 + offs
        idx = pos // PAGE_SIZE
        page = tl.load(table_row + idx, mask=idx < n_pages, other=0).to(tl.int64)
        rows = page * s_page + head_off + (pos % PAGE_SIZE) * s_slot
    return rows


@triton.jit
def _key_block_ranges(p_lo, p_hi, lo_key, window, doc_lo, doc_hi,
                      BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Key blocks seen by query positions [p_lo, p_hi], split into masked | full | masked runs.

    Block j holds keys lo_key + j * BLOCK_N ...; returns (a, b, c, d): blocks [a, b) hold keys
    some row is too far from (window edge) or that precede some row's document (doc_lo / doc_hi:
    the smallest / largest document start of the rows), [b, c) are visible to every row (no
    mask), [c, d) cross the causal diagonal. Blocks >= d are above the diagonal for every row.
    """
    d = (p_hi - lo_key) // BLOCK_N + 1
    full_end = (p_lo + 1 - lo_key) // BLOCK_N  # blocks whose last key <= p_lo
    a = 0
    full_start = 0
    if HAS_WINDOW:
        a = tl.maximum(p_lo - window + 1 - lo_key, 0) // BLOCK_N
        full_start = tl.cdiv(tl.maximum(p_hi - window + 1 - lo_key, 0), BLOCK_N)  # first key >= p_hi - W + 1
    if HAS_DOCS:
        a = tl.maximum(a, tl.maximum(doc_lo - lo_key, 0) // BLOCK_N)
        full_start = tl.maximum(full_start, tl.cdiv(tl.maximum(doc_hi - lo_key, 0), BLOCK_N))
    b = tl.maximum(a, tl.minimum(full_start, full_end))
    c = tl.maximum(b, full_end)
    return a, b, c, d


@triton.jit
def _row_block_ranges(n0, n1, q0, C, window, c_end, c_full,
                      G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Row blocks that see keys [n0, n1] (n1 < kv_len), split into masked | full | masked runs.

    Row r = c * G + g has position q0 + c. With documents, only rows c < c_end have a document
    that starts at or before n1, and rows c < c_full one that starts at or before n0. Returns
    (a, b, c, d): row blocks [a, b) cross the causal diagonal, [b, c) see every key of the
    block, [c, d) reach the window edge or a document start.
    """
    a = (tl.maximum(n0 - q0, 0) * G) // BLOCK_M
    full_start = tl.cdiv(tl.maximum(n1 - q0, 0) * G, BLOCK_M)  # first row with position >= n1
    if HAS_WINDOW:
        d = tl.cdiv(tl.minimum(n1 + window - q0, C) * G, BLOCK_M)  # rows with position < n1 + W
        full_end = (tl.maximum(n0 + window - q0, 0) * G) // BLOCK_M  # rows with position < n0 + W
    else:
        d = tl.cdiv(C * G, BLOCK_M)
        full_end = d
    if HAS_DOCS:
        d = tl.minimum(d, tl.cdiv(c_end * G, BLOCK_M))
        full_end = tl.minimum(full_end, (c_full * G) // BLOCK_M)
    b = tl.maximum(a, tl.minimum(full_start, full_end))
    c = tl.minimum(tl.maximum(b, full_end), d)
    return a, b, c, d


@triton.jit
def _rows(m0, q0, row_end, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows m0 .. m0 + BLOCK_M - 1 of the (position, group head) axis: (ok, c, g, position)."""
    r = m0 + tl.arange(0, BLOCK_M)
    c = r // G
    g = r - c * G
    return r < row_end, c, g, q0 + c


@triton.jit
def _row_tile(pid, C, sel_block, tiles_per_block, G: tl.constexpr, BLOCK_M: tl.constexpr, SPARSE: tl.constexpr):
    """(query block, first row, end row) of a row-major program.

    Dense: row tiles of the whole chunk. Sparse: every selection block of ``sel_block``
    queries gets its own ``tiles_per_block`` tiles, so no tile mixes two page lists.
    """
    if SPARSE:
        qb = pid // tiles_per_block
        m0 = qb * sel_block * G + (pid % tiles_per_block) * BLOCK_M
        row_end = tl.minimum((qb + 1) * sel_block, C) * G
    else:
        qb = pid * 0
        m0 = pid * BLOCK_M
        row_end = C * G
    return qb, m0, row_end


@triton.jit
def _count_le(row_ptr, n, x, N_ITER: tl.constexpr):
    """Number of entries <= x in the non-decreasing int32 array row_ptr[0:n] (binary search)."""
    lo = n * 0
    hi = n + 0
    for _ in tl.static_range(N_ITER):
        mid = (lo + hi) // 2
        val = tl.load(row_ptr + tl.minimum(mid, n - 1))
        go = lo < hi
        le = val <= x
        lo = tl.where(go & le, mid + 1, lo)
        hi = tl.where(go & (val > x), mid, hi)
    return lo


@triton.jit
def _kv_coord(
    table_row,  # [>= n_pages] int32
    n0, n_pages, h_kv, s_page, s_head, s_slot,
    H_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Where keys n0 .. n0 + BLOCK_N - 1 of KV head h_kv live: a row of the pool seen as a 2D
    [num_pages * H_kv * PAGE_SIZE, D] tensor (TMA), or element offsets [BLOCK_N, D] (pointers)."""
    if USE_TMA:
        page = tl.load(table_row + n0 // PAGE_SIZE)  # the block lies inside one page
        coord = (page * H_KV + h_kv) * PAGE_SIZE + n0 % PAGE_SIZE
    else:
        rows = _kv_offsets(table_row, n0, n_pages, h_kv.to(tl.int64) * s_head, s_page, s_slot, BLOCK_N, PAGE_SIZE)
        coord = rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    return coord


@triton.jit
def _load_kv(POOL, DESC, coord, n_ok, MASK: tl.constexpr, USE_TMA: tl.constexpr):
    """A [BLOCK_N, D] K or V tile. With MASK, keys past kv_len read as 0: their slots may hold
    anything (NaN too), and 0 * NaN would leak into p @ v or dS @ K."""
    if USE_TMA:
        x = DESC.load([coord, 0])
        if MASK:
            x = tl.where(n_ok[:, None], x, 0.0)
    else:
        if MASK:
            x = tl.load(POOL + coord, mask=n_ok[:, None], other=0.0)
        else:
            x = tl.load(POOL + coord)
    return x


@triton.jit
def _visible(n_pos, q_pos, doc, window, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """[BM, BN] bool: key n visible to row m (causal, window, document)."""
    vis = n_pos[None, :] <= q_pos[:, None]
    if HAS_WINDOW:
        vis = vis & ((q_pos[:, None] - n_pos[None, :]) < window)
    if HAS_DOCS:
        vis = vis & (n_pos[None, :] >= doc[:, None])
    return vis


@triton.jit
def _row_masks(DOC_ROW, m0, q0, row_end, G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Per-row position and document start [BM] for masked blocks (recomputed rather than kept live)."""
    row_ok, c, _, q_pos = _rows(m0, q0, row_end, G, BLOCK_M)
    if HAS_DOCS:
        doc = tl.load(DOC_ROW + c, mask=row_ok, other=0)
    else:
        doc = q_pos
    return q_pos, doc


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------


@triton.jit
def _fwd_step(
    acc, l_i, m_i, q,  # running state [BM, D], [BM], [BM] fp32 (log2 units); q tile [BM, D]
    K_POOL, V_POOL, K_DESC, V_DESC, table_row,
    h_kv, s_page, s_head, s_slot,
    n0, q_pos, doc, kv_len, n_pages, window, qk_scale,
    H_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online-softmax update of one row tile with the key block n0 .. n0 + BLOCK_N - 1."""
    n_pos = n0 + tl.arange(0, BLOCK_N)
    n_ok = n_pos < kv_len
    coord = _kv_coord(table_row, n0, n_pages, h_kv, s_page, s_head, s_slot, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                      USE_TMA)
    k = _load_kv(K_POOL, K_DESC, coord, n_ok, MASK, USE_TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
    if MASK:
        vis = _visible(n_pos, q_pos, doc, window, HAS_WINDOW, HAS_DOCS)
        s = tl.where(vis, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = _load_kv(V_POOL, V_DESC, coord, n_ok, MASK, USE_TMA)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q,
    K_POOL, V_POOL, K_DESC, V_DESC, table_row, DOC_ROW,
    h_kv, s_page, s_head, s_slot,
    j_lo, j_hi, lo_key, m0, q0, row_end, kv_len, n_pages, window, qk_scale,
    G: tl.constexpr, H_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Key blocks j_lo .. j_hi - 1 (keys lo_key + j * BLOCK_N ...)."""
    q_pos = 0
    doc = 0
    if MASK:
        q_pos, doc = _row_masks(DOC_ROW, m0, q0, row_end, G, BLOCK_M, HAS_DOCS)
    for j in range(j_lo, j_hi):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row,
                                  h_kv, s_page, s_head, s_slot, lo_key + j * BLOCK_N, q_pos, doc, kv_len, n_pages,
                                  window, qk_scale, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                                  MASK, HAS_WINDOW, HAS_DOCS, USE_TMA, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _fwd_pages(
    acc, l_i, m_i, q,
    K_POOL, V_POOL, K_DESC, V_DESC, table_row, DOC_ROW, sel_row,  # sel_row: the block's K page indices
    n_sel, h_kv, s_page, s_head, s_slot,
    m0, q0, row_end, kv_len, n_pages, qk_scale,
    G: tl.constexpr, H_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DOCS: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The selected past pages of a query block: wholly before every query, so only documents mask."""
    q_pos = 0
    doc = 0
    if HAS_DOCS:
        q_pos, doc = _row_masks(DOC_ROW, m0, q0, row_end, G, BLOCK_M, HAS_DOCS)
    for i in range(n_sel):
        page = tl.load(sel_row + i)
        for jj in tl.static_range(PAGE_SIZE // BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row,
                                      h_kv, s_page, s_head, s_slot, page * PAGE_SIZE + jj * BLOCK_N, q_pos, doc,
                                      kv_len, n_pages, 0, qk_scale, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                                      HAS_DOCS, False, HAS_DOCS, USE_TMA, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q,  # [B, H, C, D]
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, D]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, D], same strides as K_POOL
    K_DESC,  # TMA descriptor of K_POOL as [num_pages * H_kv * PAGE_SIZE, D], block [BLOCK_N, D] (USE_TMA)
    V_DESC,  # same for V_POOL
    TABLE,  # [B, >= n_pages] int32
    SINKS,  # [H] float (read only when HAS_SINKS)
    DOC,  # [B, C] int32 document start of each query, contiguous (HAS_DOCS)
    SEL,  # [B, H_sel, n_qb, n_sel] int32 selected past pages (SPARSE)
    OUT,  # [B, H, C, D] in Q's dtype
    LSE,  # [B, H, C] float32
    sq_b, sq_h, sq_c,
    s_page, s_head, s_slot,
    st_b,
    so_b, so_h, so_c,
    sl_b, sl_h,
    ss_b, ss_h, ss_q,
    C, kv_len, n_pages, lo_key, window, qk_scale,
    sel_block, tiles_per_block, n_sel,
    H_KV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOCS: tl.constexpr, SPARSE: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)  # tl.dot minimum
    tl.static_assert(not USE_TMA or PAGE_SIZE % BLOCK_N == 0)  # a TMA box must not cross pages
    tl.static_assert(not SPARSE or (PAGE_SIZE % BLOCK_N == 0 and not HAS_WINDOW))
    # Rows near the end of the chunk see the most keys: launch them first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    kv_head = pid_bh % H_KV
    h_kv = kv_head.to(tl.int64)
    q0 = kv_len - C
    qb, m0, row_end = _row_tile(pid, C, sel_block, tiles_per_block, G, BLOCK_M, SPARSE)

    row_ok, c, g, _ = _rows(m0, q0, row_end, G, BLOCK_M)
    head = h_kv * G + g  # int64 [BM]
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (b * sq_b + head * sq_h + c.to(tl.int64) * sq_c)[:, None] + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    if HAS_SINKS:
        # The sink is a key of logit sinks[h] and value 0: start from m = sink, l = 1.
        m_i = tl.load(SINKS + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        # A finite start (not -inf): a row that has seen no visible key yet gets p = 0, not NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

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
                                   SEL + b * ss_b + h_kv * ss_h + qb * ss_q, n_sel,
                                   kv_head, s_page, s_head, s_slot, m0, q0, row_end, kv_len, n_pages, qk_scale,
                                   G, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, HAS_DOCS, USE_TMA, DOT_PREC)
    j0, j1, j2, j3 = _key_block_ranges(p_lo, p_hi, lo_key, window, doc_lo, doc_hi, BLOCK_N, HAS_WINDOW, HAS_DOCS)
    if HAS_WINDOW or HAS_DOCS:
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                                    kv_head, s_page, s_head, s_slot, j0, j1, lo_key, m0, q0, row_end, kv_len,
                                    n_pages, window, qk_scale, G, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N,
                                    True, HAS_WINDOW, HAS_DOCS, USE_TMA, DOT_PREC)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                                kv_head, s_page, s_head, s_slot, j1, j2, lo_key, m0, q0, row_end, kv_len,
                                n_pages, window, qk_scale, G, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N,
                                False, HAS_WINDOW, HAS_DOCS, USE_TMA, DOT_PREC)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                                kv_head, s_page, s_head, s_slot, j2, j3, lo_key, m0, q0, row_end, kv_len,
                                n_pages, window, qk_scale, G, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N,
                                True, HAS_WINDOW, HAS_DOCS, USE_TMA, DOT_PREC)

    # Every query sees at least its own key, so l_i > 0 on real rows.
    out = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log
    # Row addresses recomputed after the loops, not held in registers through them.
    row_ok, c, g, _ = _rows(m0, q0, row_end, G, BLOCK_M)
    head = h_kv * G + g
    o_rows = b * so_b + head * so_h + c.to(tl.int64) * so_c
    tl.store(OUT + o_rows[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + b * sl_b + head * sl_h + c, lse, mask=row_ok)


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------


@triton.jit
def _bwd_delta_kernel(
    OUT,  # [B, H, C, D]
    DO,  # [B, H, C, D]
    DELTA,  # [B, H, C] float32, contiguous
    so_b, so_h, so_c,
    sdo_b, sdo_h, sdo_c,
    C,
    H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (c < C)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    o = tl.load(OUT + b * so_b + h * so_h + c[:, None].to(tl.int64) * so_c + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + c[:, None].to(tl.int64) * sdo_c + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * C + c, delta, mask=c < C)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v,  # dK, dV accumulators [BN, D] fp32; the key block's K, V tiles [BN, D]
    q_base,  # Q + b * sq_b
    do_base,  # DO + b * sdo_b
    lse_base,  # LSE + b * sl_b
    delta_base,  # DELTA + b * H * C
    doc_row,  # DOC + b * C
    dq_base,  # DQ_ACC + b * H * C * D (FUSED_DQ)
    h_kv, sq_h, sq_c, sdo_h, sdo_c, sl_h,
    i_lo, i_hi, m_start, row_end, n_pos, q0, C, window, qk_scale,
    rot,  # the full run starts at its tile rot % (i_hi - i_lo) (FUSED_DQ)
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PREC: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    """Row tiles i_lo .. i_hi - 1 (rows m_start + i * BLOCK_M ..., below row_end) into dK, dV.

    FUSED_DQ: also adds each tile's dS @ K (unscaled) into the fp32 dQ rows at dq_base, contiguous
    [H, C, D], with atomics: other key blocks' programs add into the same rows.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    for i in range(i_lo, i_hi):
        tile = i
        if FUSED_DQ and not MASK:
            # Every key block before the chunk has the same full run (all row tiles): walked in the
            # same order, all running programs would add into the same dQ rows at the same time.
            tile = i_lo + (i - i_lo + rot) % (i_hi - i_lo)
        row_ok, c, g, q_pos = _rows(m_start + tile * BLOCK_M, q0, row_end, G, BLOCK_M)
        head = h_kv * G + g
        c64 = c.to(tl.int64)
        # Rows past the chunk load q = dO = 0 (and lse = delta = 0): they add exactly 0.
        qT = tl.load(q_base + (head * sq_h + c64 * sq_c)[None, :] + offs_d[:, None], mask=row_ok[None, :], other=0.0)
        lse2 = tl.load(lse_base + head * sl_h + c, mask=row_ok, other=0.0) * 1.4426950408889634
        sT = tl.dot(k, qT, input_precision=DOT_PREC) * qk_scale  # [BN, BM], log2 units
        pT = tl.math.exp2(sT - lse2[None, :])
        if MASK:
            doc = q_pos
            if HAS_DOCS:
                doc = tl.load(doc_row + c, mask=row_ok, other=0)
            vis = tl.trans(_visible(n_pos, q_pos, doc, window, HAS_WINDOW, HAS_DOCS))
            pT = tl.where(vis, pT, 0.0)
        do = tl.load(do_base + (head * sdo_h + c64 * sdo_c)[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        delta = tl.load(delta_base + head * C + c, mask=row_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # [BN, BM]
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PREC)
        if FUSED_DQ:
            dq = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=DOT_PREC)  # [BM, D]
            # Relaxed: the sums are read only after the kernel ends, so no ordering is needed.
            tl.atomic_add(dq_base + ((head * C + c64) * HEAD_DIM)[:, None] + offs_d[None, :], dq,
                          mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_rows(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base,
    h_kv,  # KV head (interleaved rows, G > 1) or the query head itself (G == 1)
    sq_h, sq_c, sdo_h, sdo_c, sl_h,
    i0, i1, i2, i3, m_start, row_end, n_pos, q0, C, window, qk_scale, rot,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PREC: tl.constexpr, FUSED_DQ: tl.constexpr,
):
    """The three runs of row tiles of _row_block_ranges: causal diagonal (masked), full, edge (masked)."""
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, h_kv, sq_h, sq_c,
                          sdo_h, sdo_c, sl_h, i0, i1, m_start, row_end, n_pos, q0, C, window, qk_scale, rot,
                          G, HEAD_DIM, BLOCK_M, True, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, h_kv, sq_h, sq_c,
                          sdo_h, sdo_c, sl_h, i1, i2, m_start, row_end, n_pos, q0, C, window, qk_scale, rot,
                          G, HEAD_DIM, BLOCK_M, False, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    if HAS_WINDOW or HAS_DOCS:
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, h_kv, sq_h,
                              sq_c, sdo_h, sdo_c, sl_h, i2, i3, m_start, row_end, n_pos, q0, C, window, qk_scale, rot,
                              G, HEAD_DIM, BLOCK_M, True, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    return dk, dv


@triton.jit
def _add_into_grad_pages(DK_POOL, DV_POOL, dk, dv, table_row, n0, n_pages, h_kv, sg_page, sg_head, sg_slot, kv_ok,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Read-modify-write of one key block's gradient slots (they hold other chunks' sums)."""
    g_rows = _kv_offsets(table_row, n0, n_pages, h_kv * sg_head, sg_page, sg_slot, BLOCK_N, PAGE_SIZE)
    g_ptrs = g_rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    old_dk = tl.load(DK_POOL + g_ptrs, mask=kv_ok, other=0.0).to(tl.float32)
    tl.store(DK_POOL + g_ptrs, (old_dk + dk).to(DK_POOL.dtype.element_ty), mask=kv_ok)
    old_dv = tl.load(DV_POOL + g_ptrs, mask=kv_ok, other=0.0).to(tl.float32)
    tl.store(DV_POOL + g_ptrs, (old_dv + dv).to(DV_POOL.dtype.element_ty), mask=kv_ok)


@triton.jit
def _key_block(K_POOL, V_POOL, table_row, n0, kv_len, n_pages, h_kv, s_page, s_head, s_slot,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """A dK/dV program's keys n0 .. n0 + BLOCK_N - 1 of KV head h_kv: (positions, in-range mask [BN, 1],
    K and V tiles [BN, D] with keys past kv_len read as 0)."""
    n_pos = n0 + tl.arange(0, BLOCK_N)
    kv_ok = (n_pos < kv_len)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    rows = _kv_offsets(table_row, n0, n_pages, h_kv * s_head, s_page, s_slot, BLOCK_N, PAGE_SIZE)
    k = tl.load(K_POOL + rows[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V_POOL + rows[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)
    return n_pos, kv_ok, k, v


@triton.jit
def _bwd_dkdv_kernel(
    Q,  # [B, H, C, D]
    DO,  # [B, H, C, D]
    LSE,  # [B, H, C] float32
    DELTA,  # [B, H, C] float32, contiguous
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, D]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, D], same strides as K_POOL
    DK_POOL,  # [num_pages, H_kv, PAGE_SIZE, D], accumulated into (read-modify-write)
    DV_POOL,  # [num_pages, H_kv, PAGE_SIZE, D], same strides as DK_POOL
    TABLE,  # [B, >= n_pages] int32
    DOC,  # [B, C] int32 document starts, contiguous (HAS_DOCS)
    DQ_ACC,  # [B, H, C, D] float32, contiguous, zeroed: dS @ K summed over key blocks (FUSED_DQ)
    sq_b, sq_h, sq_c,
    sdo_b, sdo_h, sdo_c,
    sl_b, sl_h,
    s_page, s_head, s_slot,
    sg_page, sg_head, sg_slot,
    st_b,
    C, kv_len, n_pages, lo_key, window, qk_scale, scale,
    H_KV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, LOG2_C: tl.constexpr, DOT_PREC: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, FUSED_DQ: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)  # tl.dot minimum
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    h_kv = (pid_bh % H_KV).to(tl.int64)
    q0 = kv_len - C
    n0 = lo_key + pid_n * BLOCK_N
    n1 = tl.minimum(n0 + BLOCK_N, kv_len) - 1

    table_row = TABLE + b * st_b
    n_pos, kv_ok, k, v = _key_block(K_POOL, V_POOL, table_row, n0, kv_len, n_pages, h_kv, s_page, s_head, s_slot,
                                    HEAD_DIM, BLOCK_N, PAGE_SIZE)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    doc_row = DOC + b * C
    c_end = C
    c_full = C
    if HAS_DOCS:
        # Queries whose document starts at or before the block's last (first) key: a prefix of the chunk.
        c_end = _count_le(doc_row, C, n1, LOG2_C)
        c_full = _count_le(doc_row, C, n0, LOG2_C)
    q_base = Q + b * sq_b
    do_base = DO + b * sdo_b
    lse_base = LSE + b * sl_b
    delta_base = DELTA + b * (H_KV * G) * C
    dq_base = DQ_ACC + b * (H_KV * G) * C * HEAD_DIM
    if HEAD_MAJOR:
        # One query head at a time: row tiles of BLOCK_M consecutive positions of that head
        # (contiguous rows of Q and dO), the group's heads summed into the same dK/dV.
        i0, i1, i2, i3 = _row_block_ranges(n0, n1, q0, C, window, c_end, c_full, 1, BLOCK_M, HAS_WINDOW, HAS_DOCS)
        for t in range(G):
            g = t
            if FUSED_DQ:
                # Full runs rotate by pid_n (see _dkdv_blocks), so programs a chunk's worth of row tiles
                # apart would meet on the same tile: they start on different heads instead.
                g = (t + pid_n // tl.cdiv(C, BLOCK_M)) % G
            head = h_kv * G + g
            dk, dv = _dkdv_rows(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, head, sq_h,
                                sq_c, sdo_h, sdo_c, sl_h, i0, i1, i2, i3, 0, C, n_pos, q0, C, window, qk_scale, pid_n,
                                1, HEAD_DIM, BLOCK_M, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    else:
        i0, i1, i2, i3 = _row_block_ranges(n0, n1, q0, C, window, c_end, c_full, G, BLOCK_M, HAS_WINDOW, HAS_DOCS)
        dk, dv = _dkdv_rows(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, dq_base, h_kv, sq_h,
                            sq_c, sdo_h, sdo_c, sl_h, i0, i1, i2, i3, 0, C * G, n_pos, q0, C, window, qk_scale, pid_n,
                            G, HEAD_DIM, BLOCK_M, HAS_WINDOW, HAS_DOCS, DOT_PREC, FUSED_DQ)
    # Add into the gradient pages; slots past kv_len are left as they are.
    _add_into_grad_pages(DK_POOL, DV_POOL, dk * scale, dv, table_row, n0, n_pages, h_kv, sg_page, sg_head, sg_slot,
                         kv_ok, HEAD_DIM, BLOCK_N, PAGE_SIZE)


@triton.jit
def _dkdv_group(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, h_kv, sq_h, sq_c, sdo_h, sdo_c, sl_h,
    c_lo, c_hi, n_pos, q0, C, qk_scale,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    MASK: tl.constexpr, HAS_DOCS: tl.constexpr, DOT_PREC: tl.constexpr, HEAD_MAJOR: tl.constexpr,
):
    """Queries c_lo .. c_hi - 1 of every query head of the group into one key block's dK, dV.

    No fused dQ under page selection: delta_base (dq_base) and 0 (rot) are placeholders.
    """
    if HEAD_MAJOR:
        n_tiles = tl.cdiv(c_hi - c_lo, BLOCK_M)
        for g in range(G):
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, delta_base,
                                  h_kv * G + g, sq_h, sq_c, sdo_h, sdo_c, sl_h, 0, n_tiles, c_lo, c_hi, n_pos, q0, C,
                                  0, qk_scale, 0, 1, HEAD_DIM, BLOCK_M, MASK, False, HAS_DOCS, DOT_PREC, False)
    else:
        n_tiles = tl.cdiv((c_hi - c_lo) * G, BLOCK_M)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, delta_base, h_kv, sq_h,
                              sq_c, sdo_h, sdo_c, sl_h, 0, n_tiles, c_lo * G, c_hi * G, n_pos, q0, C, 0, qk_scale, 0,
                              G, HEAD_DIM, BLOCK_M, MASK, False, HAS_DOCS, DOT_PREC, False)
    return dk, dv


@triton.jit
def _bwd_dkdv_sparse_kernel(
    Q, DO, LSE, DELTA, K_POOL, V_POOL, DK_POOL, DV_POOL, TABLE,  # as in _bwd_dkdv_kernel
    DOC,  # [B, C] int32 document starts, contiguous (HAS_DOCS)
    HITS,  # [B, H_sel, n_items, n_qb] int8: 1 where query block qb attends page p (past: selected; chunk: causal)
    ORDER,  # [B, H_sel, n_items] int32: the pages, most-attended first
    COUNT,  # [B, H_sel, n_items] int32: how many query blocks attend ORDER's pages (non-increasing)
    sq_b, sq_h, sq_c,
    sdo_b, sdo_h, sdo_c,
    sl_b, sl_h,
    s_page, s_head, s_slot,
    sg_page, sg_head, sg_slot,
    st_b,
    sh_b, sh_h, sh_p,
    so_b, so_h,
    n_bh, C, kv_len, n_pages, n_qb, sel_block, qk_scale, scale,
    H_KV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DOCS: tl.constexpr, DOT_PREC: tl.constexpr, HEAD_MAJOR: tl.constexpr,
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
        n_pos, kv_ok, k, v = _key_block(K_POOL, V_POOL, table_row, n0, kv_len, n_pages, h_kv, s_page, s_head,
                                        s_slot, HEAD_DIM, BLOCK_N, PAGE_SIZE)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
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
                                         G, HEAD_DIM, BLOCK_M, True, HAS_DOCS, DOT_PREC, HEAD_MAJOR)
                else:
                    dk, dv = _dkdv_group(dk, dv, k, v, q_base, do_base, lse_base, delta_base, doc_row, h_kv, sq_h,
                                         sq_c, sdo_h, sdo_c, sl_h, c_lo, c1, n_pos, q0, C, qk_scale,
                                         G, HEAD_DIM, BLOCK_M, HAS_DOCS, HAS_DOCS, DOT_PREC, HEAD_MAJOR)
                n_hit += 1
        if n_hit > 0:
            _add_into_grad_pages(DK_POOL, DV_POOL, dk * scale, dv, table_row, n0, n_pages, h_kv, sg_page, sg_head,
                                 sg_slot, kv_ok, HEAD_DIM, BLOCK_N, PAGE_SIZE)


@triton.jit
def _dq_step(
    dq, q, do, lse2, delta,  # dQ accumulator [BM, D] fp32; q, dO [BM, D]; lse2 (log2 units), delta [BM] fp32
    K_POOL, V_POOL, K_DESC, V_DESC, table_row,
    h_kv, s_page, s_head, s_slot,
    n0, q_pos, doc, kv_len, n_pages, window, qk_scale,
    H_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    n_pos = n0 + tl.arange(0, BLOCK_N)
    n_ok = n_pos < kv_len
    coord = _kv_coord(table_row, n0, n_pages, h_kv, s_page, s_head, s_slot, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                      USE_TMA)
    k = _load_kv(K_POOL, K_DESC, coord, n_ok, MASK, USE_TMA)
    v = _load_kv(V_POOL, V_DESC, coord, n_ok, MASK, USE_TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BM, BN]
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    if MASK:
        p = tl.where(_visible(n_pos, q_pos, doc, window, HAS_WINDOW, HAS_DOCS), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)


@triton.jit
def _dq_blocks(
    dq, q, do, lse2, delta,
    K_POOL, V_POOL, K_DESC, V_DESC, table_row, DOC_ROW,
    h_kv, s_page, s_head, s_slot,
    j_lo, j_hi, lo_key, m0, q0, row_end, kv_len, n_pages, window, qk_scale,
    G: tl.constexpr, H_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    q_pos = 0
    doc = 0
    if MASK:
        q_pos, doc = _row_masks(DOC_ROW, m0, q0, row_end, G, BLOCK_M, HAS_DOCS)
    for j in range(j_lo, j_hi):
        dq = _dq_step(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, h_kv, s_page, s_head,
                      s_slot, lo_key + j * BLOCK_N, q_pos, doc, kv_len, n_pages, window, qk_scale,
                      H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_N, MASK, HAS_WINDOW, HAS_DOCS, USE_TMA, DOT_PREC)
    return dq


@triton.jit
def _dq_pages(
    dq, q, do, lse2, delta,
    K_POOL, V_POOL, K_DESC, V_DESC, table_row, DOC_ROW, sel_row,
    n_sel, h_kv, s_page, s_head, s_slot,
    m0, q0, row_end, kv_len, n_pages, qk_scale,
    G: tl.constexpr, H_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DOCS: tl.constexpr, USE_TMA: tl.constexpr, DOT_PREC: tl.constexpr,
):
    q_pos = 0
    doc = 0
    if HAS_DOCS:
        q_pos, doc = _row_masks(DOC_ROW, m0, q0, row_end, G, BLOCK_M, HAS_DOCS)
    for i in range(n_sel):
        page = tl.load(sel_row + i)
        for jj in tl.static_range(PAGE_SIZE // BLOCK_N):
            dq = _dq_step(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, h_kv, s_page, s_head,
                          s_slot, page * PAGE_SIZE + jj * BLOCK_N, q_pos, doc, kv_len, n_pages, 0, qk_scale,
                          H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_N, HAS_DOCS, False, HAS_DOCS, USE_TMA, DOT_PREC)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q,  # [B, H, C, D]
    DO,  # [B, H, C, D]
    LSE,  # [B, H, C] float32
    DELTA,  # [B, H, C] float32, contiguous
    K_POOL,  # [num_pages, H_kv, PAGE_SIZE, D]
    V_POOL,  # [num_pages, H_kv, PAGE_SIZE, D], same strides as K_POOL
    K_DESC,  # TMA descriptor of K_POOL as [num_pages * H_kv * PAGE_SIZE, D], block [BLOCK_N, D] (USE_TMA)
    V_DESC,  # same for V_POOL
    TABLE,  # [B, >= n_pages] int32
    DOC,  # [B, C] int32 document starts, contiguous (HAS_DOCS)
    SEL,  # [B, H_sel, n_qb, n_sel] int32 selected past pages (SPARSE)
    DQ,  # [B, H, C, D] in Q's dtype, contiguous
    sq_b, sq_h, sq_c,
    sdo_b, sdo_h, sdo_c,
    sl_b, sl_h,
    s_page, s_head, s_slot,
    st_b,
    ss_b, ss_h, ss_q,
    C, kv_len, n_pages, lo_key, window, qk_scale, scale,
    sel_block, tiles_per_block, n_sel,
    H_KV: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, SPARSE: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)  # tl.dot minimum
    tl.static_assert(not USE_TMA or PAGE_SIZE % BLOCK_N == 0)  # a TMA box must not cross pages
    tl.static_assert(not SPARSE or (PAGE_SIZE % BLOCK_N == 0 and not HAS_WINDOW))
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest rows first
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    kv_head = pid_bh % H_KV
    h_kv = kv_head.to(tl.int64)
    q0 = kv_len - C
    qb, m0, row_end = _row_tile(pid, C, sel_block, tiles_per_block, G, BLOCK_M, SPARSE)

    row_ok, c, g, _ = _rows(m0, q0, row_end, G, BLOCK_M)
    head = h_kv * G + g
    c64 = c.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sq_b + (head * sq_h + c64 * sq_c)[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * sdo_b + (head * sdo_h + c64 * sdo_c)[:, None] + offs_d[None, :], mask=row_ok[:, None],
                 other=0.0)
    lse2 = tl.load(LSE + b * sl_b + head * sl_h + c, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + b * (H_KV * G) * C + head * C + c, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

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
                       m0, q0, row_end, kv_len, n_pages, qk_scale,
                       G, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, HAS_DOCS, USE_TMA, DOT_PREC)
    j0, j1, j2, j3 = _key_block_ranges(p_lo, p_hi, lo_key, window, doc_lo, doc_hi, BLOCK_N, HAS_WINDOW, HAS_DOCS)
    if HAS_WINDOW or HAS_DOCS:
        dq = _dq_blocks(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                        kv_head, s_page, s_head, s_slot, j0, j1, lo_key, m0, q0, row_end, kv_len, n_pages, window,
                        qk_scale, G, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N,
                        True, HAS_WINDOW, HAS_DOCS, USE_TMA, DOT_PREC)
    dq = _dq_blocks(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                    kv_head, s_page, s_head, s_slot, j1, j2, lo_key, m0, q0, row_end, kv_len, n_pages, window,
                    qk_scale, G, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N,
                    False, HAS_WINDOW, HAS_DOCS, USE_TMA, DOT_PREC)
    dq = _dq_blocks(dq, q, do, lse2, delta, K_POOL, V_POOL, K_DESC, V_DESC, table_row, doc_row,
                    kv_head, s_page, s_head, s_slot, j2, j3, lo_key, m0, q0, row_end, kv_len, n_pages, window,
                    qk_scale, G, H_KV, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N,
                    True, HAS_WINDOW, HAS_DOCS, USE_TMA, DOT_PREC)
    dq = dq * scale
    dq_rows = b * (H_KV * G) * C * HEAD_DIM + (head * C + c64) * HEAD_DIM
    tl.store(DQ + dq_rows[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch settings of the four kernels (M = rows of (position, head), N = keys)."""

    fwd_m: int
    fwd_n: int
    fwd_warps: int
    fwd_stages: int
    dkdv_m: int  # rows per step of the dK/dV loop
    dkdv_n: int  # keys owned by one dK/dV program
    dq_m: int  # rows owned by one dQ program
    dq_n: int  # keys per step of the dQ loop
    bwd_warps: int
    bwd_stages: int
    delta_c: int = 64
    tma: bool = False  # K/V tiles of the forward and dQ loops through TMA descriptors (Hopper+)
    # dK/dV row tiles of one query head at a time (contiguous Q/dO rows) instead of rows that
    # interleave the GQA group's heads position by position.
    dkdv_head_major: bool = False
    # Dense calls: dQ summed inside the dK/dV kernel (fp32 atomics, 5 matmuls per tile pair instead
    # of 4 + 3) and no dQ kernel, so dq_m/dq_n go unused; page-selected calls ignore it. The atomics
    # make dQ's summation order, so its last bits, vary from run to run. With d=128 on sm_90a the
    # extra fp32 tile spills inside the row loops at dkdv_m=64, not at 32 (offline ptxas, not timed).
    dq_fused: bool = False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_tiles(head_dim: int, page_size: int, dtype: torch.dtype) -> Tiles:
    """Tiles for one problem class; a module-level function so tests and tuning can replace it.

    Any power-of-two key block >= 16 works with any page size (a block inside one page, or
    whole pages with one page id per key); a block inside one page is the cheaper case and the
    only one TMA serves. Register use was checked offline (ptxas for sm_90a, no GPU): these
    settings do not spill inside loops; speed is not measured yet.
    """
    if _interpreting():
        # The interpreter costs ~ms per block iteration whatever the tile: small tiles, few programs.
        return Tiles(16, 16, 1, 1, 16, 16, 16, 16, 1, 1, delta_c=16, dkdv_head_major=True)
    if dtype == torch.float32:
        # Exact fp32 products run on FMA units, not tensor cores: a correctness path with small tiles.
        return Tiles(32, 32, 8, 2, 16, 32, 32, 32, 8, 2)
    # Key blocks of the forward/dQ loops stay inside one page when pages are large enough (one page id
    # per block, TMA); small or odd pages get 128-key blocks with a page id per key instead.
    fwd_n = min(128, page_size) if page_size >= 64 and page_size & (page_size - 1) == 0 else 128
    # dQ loop over 128-key blocks where a page holds them: bwd 296 vs 278 TFLOP/s with 64 (H200, kv 64K,
    # page 128, results/h200/2026-12-02-tune-attention-64k.json); 64 elsewhere (not measured).
    dq_n = 128 if page_size % 128 == 0 else 64
    # d=128, bf16/fp16, measured on the H200 for a non-paged kernel (see FACTS.md): forward 128/128,
    # 8 warps, 3 stages; backward 8 warps, 3 stages. d=64 uses the same (4 warps spill).
    # dK/dV: one query head at a time in 64-row tiles: the kernel 22.3 -> 14.9 ms, forward+backward
    # 323 -> 395 TFLOP/s (H200, kv 64K, page 128, 28/4 heads; 32-row head-major tiles 16.9 ms,
    # interleaved 64-row tiles 24.0 ms; results/h200/2026-12-02-tune-attention-64k-run3.json).
    return Tiles(128, fwd_n, 8, 3, 64, 128, 128, dq_n, 8, 3, tma=True, dkdv_head_major=True)


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


def _check(q, k_pool, v_pool, page_table, kv_len, sliding_window, sinks):
    b, h, c, d = q.shape
    num_pages, h_kv, page_size, d_kv = k_pool.shape
    if v_pool.shape != k_pool.shape or v_pool.stride() != k_pool.stride():
        raise ValueError(f"v_pool {tuple(v_pool.shape)} must match k_pool {tuple(k_pool.shape)} in shape and strides")
    if d_kv != d or h % h_kv:
        raise ValueError(f"q {tuple(q.shape)} does not fit pools {tuple(k_pool.shape)}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if k_pool.stride(-1) != 1:
        raise ValueError("pools must be contiguous in head_dim")
    if not 0 < c <= kv_len:
        raise ValueError(f"the chunk ({c} queries) must be the newest part of kv_len={kv_len}")
    n_pages = -(-kv_len // page_size)
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be int32 [B, n]; got {page_table.dtype} {tuple(page_table.shape)}")
    if page_table.shape[1] < n_pages:
        raise ValueError(f"page_table has {page_table.shape[1]} columns, kv_len={kv_len} needs {n_pages}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"sinks must be [H]={h}, got {tuple(sinks.shape)}")
    return b, h, c, d, h_kv, page_size, n_pages


def _window_args(kv_len, c, page_size, sliding_window):
    """(lo_key, window): keys before lo_key are never visible; window clamped so int32 math cannot overflow."""
    lo_key = _first_visible_page(kv_len, c, page_size, sliding_window) * page_size
    window = 0 if sliding_window is None else min(sliding_window, kv_len + 1)
    return lo_key, window


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (the reference's semantics); 16-bit inputs are exact in tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer a kernel must fill (tests replace this to poison them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _kv_descriptors(k_pool, v_pool, tiles: Tiles, block_n: int):
    """TMA descriptors of the pools as [num_pages * H_kv * page_size, D], or the pools themselves
    (placeholders the kernel never reads) when TMA does not apply."""
    num_pages, h_kv, page_size, d = k_pool.shape
    usable = (
        tiles.tma
        and TensorDescriptor is not None
        and page_size % block_n == 0
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and k_pool.data_ptr() % 16 == 0
        and v_pool.data_ptr() % 16 == 0
        and (_interpreting() or (k_pool.is_cuda and torch.cuda.get_device_capability(k_pool.device)[0] >= 9))
    )
    if not usable:
        return k_pool, v_pool, False
    rows = num_pages * h_kv * page_size
    k_desc = TensorDescriptor(k_pool, [rows, d], [d, 1], [block_n, d])
    v_desc = TensorDescriptor(v_pool, [rows, d], [d, 1], [block_n, d])
    return k_desc, v_desc, True


def _visibility_args(q, h_kv, kv_len, page_size, sliding_window, doc_start, page_select, select_block):
    """Kernel arguments for documents and page selection (placeholders when absent)."""
    b, h, c, _ = q.shape
    check_visibility_args(q, h_kv, kv_len, page_size, doc_start, page_select, select_block)
    docs = None if doc_start is None else doc_start.to(torch.int32).contiguous()
    sel = None
    if page_select is not None:
        if sliding_window is not None:
            raise ValueError("page selection does not combine with a sliding window: window layers read only the "
                             "pages inside their window already")
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page-sparse attention needs a power-of-two page_size >= 16, got {page_size}")
        sel = page_select.contiguous()
    return docs, sel


def _sparse_grid_args(sel, c, g, block_m, select_block):
    """(sel strides, select_block, tiles per block, K) for the row-major kernels; dense: zeros."""
    if sel is None:
        return (0, 0, 0), 0, 0, 0
    tiles_per_block = triton.cdiv(min(select_block, c) * g, block_m)
    s_h = sel.stride(1) if sel.shape[1] > 1 else 0  # one selection shared by every KV head
    return (sel.stride(0), s_h, sel.stride(2)), select_block, tiles_per_block, sel.shape[3]


def paged_attention_forward(
    q: torch.Tensor,  # [B, H, C, D]
    k_pool: torch.Tensor,  # [num_pages, H_kv, page_size, D]
    v_pool: torch.Tensor,  # [num_pages, H_kv, page_size, D]
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B, H, C, D] in q.dtype, lse [B, H, C] float32)."""
    b, h, c, d, h_kv, page_size, n_pages = _check(q, k_pool, v_pool, page_table, kv_len, sliding_window, sinks)
    g = h // h_kv
    q, page_table = _last_dim_contiguous(q), _last_dim_contiguous(page_table)
    sinks = sinks.contiguous() if sinks is not None else None
    t = choose_tiles(d, page_size, q.dtype)
    docs, sel = _visibility_args(q, h_kv, kv_len, page_size, sliding_window, doc_start, page_select, select_block)
    out = _empty((b, h, c, d), q.dtype, q.device)
    lse = _empty((b, h, c), torch.float32, q.device)
    lo_key, window = _window_args(kv_len, c, page_size, sliding_window)
    block_n = t.fwd_n
    if sel is not None:
        lo_key, block_n = kv_len - c, min(block_n, page_size)  # the past comes from the page lists
    k_desc, v_desc, use_tma = _kv_descriptors(k_pool, v_pool, t, block_n)
    sel_strides, sel_block, tiles_per_block, n_sel = _sparse_grid_args(sel, c, g, t.fwd_m, select_block)
    n_row_tiles = triton.cdiv(c, select_block) * tiles_per_block if sel is not None else triton.cdiv(c * g, t.fwd_m)
    _fwd_kernel[(n_row_tiles, b * h_kv)](
        q, k_pool, v_pool, k_desc, v_desc, page_table, sinks if sinks is not None else lse,
        docs if docs is not None else page_table, sel if sel is not None else page_table, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        *sel_strides,
        c, kv_len, n_pages, lo_key, window, scale * LOG2E,
        sel_block, tiles_per_block, n_sel,
        H_KV=h_kv, G=g, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=t.fwd_m, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, HAS_DOCS=docs is not None,
        SPARSE=sel is not None, USE_TMA=use_tma,
        DOT_PREC=_dot_precision(q.dtype), num_warps=t.fwd_warps, num_stages=t.fwd_stages,
    )
    return out, lse


def _page_hits(sel: torch.Tensor, n_past: int, c: int, select_block: int, page_size: int) -> torch.Tensor:
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


def paged_attention_backward(
    d_out: torch.Tensor,  # [B, H, C, D]
    q: torch.Tensor,  # [B, H, C, D]
    out: torch.Tensor,  # [B, H, C, D]
    lse: torch.Tensor,  # [B, H, C] float32
    k_pool: torch.Tensor,  # [num_pages, H_kv, page_size, D]
    v_pool: torch.Tensor,  # [num_pages, H_kv, page_size, D]
    dk_pool: torch.Tensor,  # [num_pages, H_kv, page_size, D], accumulated into
    dv_pool: torch.Tensor,  # [num_pages, H_kv, page_size, D], accumulated into
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Adds dK/dV of every visible page into dk_pool/dv_pool (only pages some query attends are written).

    Returns (dq [B, H, C, D] in q.dtype, d_sinks [H] float32 or None).
    """
    b, h, c, d, h_kv, page_size, n_pages = _check(q, k_pool, v_pool, page_table, kv_len, sliding_window, sinks)
    g = h // h_kv
    if dk_pool.shape != k_pool.shape or dv_pool.shape != k_pool.shape or dv_pool.stride() != dk_pool.stride():
        raise ValueError("dk_pool and dv_pool must match k_pool's shape and each other's strides")
    if dk_pool.stride(-1) != 1:
        raise ValueError("gradient pools must be contiguous in head_dim")
    q, d_out, out = _last_dim_contiguous(q), _last_dim_contiguous(d_out), _last_dim_contiguous(out)
    lse, page_table = _last_dim_contiguous(lse), _last_dim_contiguous(page_table)
    t = choose_tiles(d, page_size, q.dtype)
    docs, sel = _visibility_args(q, h_kv, kv_len, page_size, sliding_window, doc_start, page_select, select_block)
    lo_key, window = _window_args(kv_len, c, page_size, sliding_window)
    if sel is not None:
        lo_key = kv_len - c  # dQ's dense loop covers the chunk's own keys; the past comes from the page lists
    has_window = sliding_window is not None
    prec = _dot_precision(q.dtype)
    doc_arg = docs if docs is not None else page_table

    delta = _empty((b, h, c), torch.float32, q.device)
    _bwd_delta_kernel[(triton.cdiv(c, t.delta_c), b * h)](
        out, d_out, delta,
        out.stride(0), out.stride(1), out.stride(2),
        d_out.stride(0), d_out.stride(1), d_out.stride(2),
        c, H=h, HEAD_DIM=d, BLOCK_C=t.delta_c,
    )

    common = (
        q.stride(0), q.stride(1), q.stride(2),
        d_out.stride(0), d_out.stride(1), d_out.stride(2),
        lse.stride(0), lse.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        dk_pool.stride(0), dk_pool.stride(1), dk_pool.stride(2),
        page_table.stride(0),
    )
    fused_dq = sel is None and t.dq_fused
    if sel is None:
        # Every key block adds into it, so it starts at zero (not _empty); delta stands in when unused.
        dq_acc = torch.zeros((b, h, c, d), dtype=torch.float32, device=q.device) if fused_dq else delta
        grid_kv = (triton.cdiv(kv_len - lo_key, t.dkdv_n), b * h_kv)
        _bwd_dkdv_kernel[grid_kv](
            q, d_out, lse, delta, k_pool, v_pool, dk_pool, dv_pool, page_table, doc_arg, dq_acc,
            *common,
            c, kv_len, n_pages, lo_key, window, scale * LOG2E, scale,
            H_KV=h_kv, G=g, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=t.dkdv_m, BLOCK_N=t.dkdv_n,
            HAS_WINDOW=has_window, HAS_DOCS=docs is not None, LOG2_C=c.bit_length(), DOT_PREC=prec,
            HEAD_MAJOR=t.dkdv_head_major, FUSED_DQ=fused_dq, num_warps=t.bwd_warps, num_stages=t.bwd_stages,
        )
    else:
        hits = _page_hits(sel, lo_key // page_size, c, select_block, page_size)
        count, order = hits.sum(dim=-1, dtype=torch.int32).sort(dim=-1, descending=True, stable=True)
        order, count = order.to(torch.int32).contiguous(), count.contiguous()
        block_n = min(t.dkdv_n, page_size)
        per_head = hits.shape[1] > 1  # else one selection shared by every KV head
        _bwd_dkdv_sparse_kernel[(hits.shape[2] * (page_size // block_n) * b * h_kv,)](
            q, d_out, lse, delta, k_pool, v_pool, dk_pool, dv_pool, page_table, doc_arg, hits, order, count,
            *common,
            hits.stride(0), hits.stride(1) if per_head else 0, hits.stride(2),
            order.stride(0), order.stride(1) if per_head else 0,
            b * h_kv, c, kv_len, n_pages, hits.shape[3], select_block, scale * LOG2E, scale,
            H_KV=h_kv, G=g, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=t.dkdv_m, BLOCK_N=block_n,
            HAS_DOCS=docs is not None, DOT_PREC=prec, HEAD_MAJOR=t.dkdv_head_major,
            num_warps=t.bwd_warps, num_stages=t.bwd_stages,
        )

    if fused_dq:
        dq = dq_acc.mul_(scale).to(q.dtype)
    else:
        dq = _empty((b, h, c, d), q.dtype, q.device)
        block_n = t.dq_n if sel is None else min(t.dq_n, page_size)
        k_desc, v_desc, use_tma = _kv_descriptors(k_pool, v_pool, t, block_n)
        sel_strides, sel_block, tiles_per_block, n_sel = _sparse_grid_args(sel, c, g, t.dq_m, select_block)
        n_row_tiles = (triton.cdiv(c, select_block) * tiles_per_block if sel is not None
                       else triton.cdiv(c * g, t.dq_m))
        _bwd_dq_kernel[(n_row_tiles, b * h_kv)](
            q, d_out, lse, delta, k_pool, v_pool, k_desc, v_desc, page_table, doc_arg,
            sel if sel is not None else page_table, dq,
            q.stride(0), q.stride(1), q.stride(2),
            d_out.stride(0), d_out.stride(1), d_out.stride(2),
            lse.stride(0), lse.stride(1),
            k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            page_table.stride(0),
            *sel_strides,
            c, kv_len, n_pages, lo_key, window, scale * LOG2E, scale,
            sel_block, tiles_per_block, n_sel,
            H_KV=h_kv, G=g, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=t.dq_m, BLOCK_N=block_n,
            HAS_WINDOW=has_window, HAS_DOCS=docs is not None, SPARSE=sel is not None, USE_TMA=use_tma,
            DOT_PREC=prec, num_warps=t.bwd_warps, num_stages=t.bwd_stages,
        )

    d_sinks = None
    if sinks is not None:
        # The sink is a key of logit `sink` and value 0: dS_sink = P_sink * (0 - delta).
        p_sink = torch.exp(sinks.float().view(1, h, 1) - lse)
        d_sinks = -(p_sink * delta).sum(dim=(0, 2))
    return dq, d_sinks
