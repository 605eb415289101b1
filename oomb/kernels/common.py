"""@triton.jit helpers shared by the paged attention kernels: key and row addressing, masks.

The kernels (forward.py, backward.py, dkdv.py, sparse_backward.py, dq.py) have the
signatures and conventions of ``oomb.kernels.reference`` (read its docstring): the queries
are the newest C tokens, absolute positions kv_len-C .. kv_len-1; key pools are
[num_pages, H_kv, page_size, Dk] and value pools [num_pages, H_kv, page_size, Dv]; query
head h reads KV head h // G; key j is visible to query i when j <= i (and i - j < W with a
sliding window); ``sinks`` join the softmax denominator; lse is natural-log, sink included.

Head sizes. Keys (and queries) and values have their own sizes DK and DV (constexprs), each
held in tiles of BLOCK_DK / BLOCK_DV columns: the next power of two >= 16 (tl.arange and
tl.dot need one). Where a size is padded (96 in 128, 192 in 256, 24 in 32) loads read the
columns past it as 0 and stores skip them: zero columns of q and K add nothing to q @ K^T,
and zero columns of V and dO give zero columns of out, dQ, dK, dV that are never stored.
Where BLOCK_D == D (the power-of-two sizes) ``dims_mask`` adds no mask at all.

GQA layout. A program owns one KV head and a block of ROWS of the flattened
(query position, group head) axis, row = c * G + g, whose position is kv_len - C + c:

    rows    0   1 ... G-1 | G  G+1 ... 2G-1 | ...
    (c, g) (0,0)(0,1)     | (1,0)(1,1)      | ...

So every K/V tile a program loads serves all G query heads of its group (G times less
K/V traffic than a program per query head), and a block of BLOCK_M rows spans only
BLOCK_M / G positions, so the causal diagonal (masked work) is G times thinner. Looping
over heads inside a program would keep the K/V reuse too but multiply the register
footprint (G accumulators) or reload K/V per head.

Key blocks: BLOCK_N keys from the first visible page on, page-aligned. A block inside one
page (page_size % BLOCK_N == 0, the usual case) needs one page id per block and can be read
with TMA (each pool seen as a 2D [num_pages * H_kv * page_size, D] tensor; unpadded head
sizes only, launch.kv_descriptors); otherwise a block
spans pages and every key looks up its own page id (any page_size works). Each loop over
blocks is split into masked | unmasked | masked runs (sliding-window edge, interior, causal
diagonal), so only edge blocks pay for masks. Slots past kv_len are never trusted (they may
hold NaN). The pages a call attends must have distinct ids in the table (the store guarantees it:
oomb.cache.KVStore.fetch): the dK/dV pass writes pages in place.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def key_pages(
    table_row,  # [>= n_pages] int32: this sequence's row of the page table
    n0,  # first key position of the block
    n_pages,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """(page ids int64: a scalar when the block lies inside one page, else [BLOCK_N]; slots [BLOCK_N]) of keys
    n0 .. n0 + BLOCK_N - 1. Looked up once per block for the K and the V pool (and their gradient pools)."""
    offs = tl.arange(0, BLOCK_N)
    if PAGE_SIZE % BLOCK_N == 0:
        # The block lies inside one page: one page id (a scalar load) per block.
        page = tl.load(table_row + n0 // PAGE_SIZE).to(tl.int64)
        slot = n0 % PAGE_SIZE + offs
    else:
        # The block spans several pages: one page id per key (PAGE_SIZE is a constexpr, so // is cheap).
        pos = n0 + offs
        idx = pos // PAGE_SIZE
        page = tl.load(table_row + idx, mask=idx < n_pages, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
    return page, slot


@triton.jit
def kv_offsets(
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
    page, slot = key_pages(table_row, n0, n_pages, BLOCK_N, PAGE_SIZE)
    return page * s_page + head_off + slot * s_slot


@triton.jit
def dims_mask(ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The mask of a [rows, BLOCK_D] tile: ``ok`` ([rows, 1] or [1, 1]) and, where the head size is padded
    (D < BLOCK_D), the real columns. ``ok`` itself when D == BLOCK_D: the power-of-two sizes pay nothing."""
    if D < BLOCK_D:
        return ok & (tl.arange(0, BLOCK_D) < D)[None, :]
    else:
        return ok


@triton.jit
def dims_mask_t(ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """``dims_mask`` of a transposed [BLOCK_D, cols] tile (``ok`` [1, cols])."""
    if D < BLOCK_D:
        return ok & (tl.arange(0, BLOCK_D) < D)[:, None]
    else:
        return ok


@triton.jit
def key_block_ranges(p_lo, p_hi, lo_key, window, doc_lo, doc_hi,
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
def row_block_ranges(n0, n1, q0, C, window, c_end, c_full,
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
def tile_rows(m0, q0, row_end, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows m0 .. m0 + BLOCK_M - 1 of the (position, group head) axis: (ok, c, g, position)."""
    r = m0 + tl.arange(0, BLOCK_M)
    c = r // G
    g = r - c * G
    return r < row_end, c, g, q0 + c


@triton.jit
def row_tile(pid, C, sel_block, tiles_per_block, G: tl.constexpr, BLOCK_M: tl.constexpr, SPARSE: tl.constexpr):
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
def count_le(
    row_ptr,  # [>= n] int32, non-decreasing
    n, x, N_ITER: tl.constexpr,
):
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
def kv_coords(
    table_row,  # [>= n_pages] int32
    n0, n_pages, h_kv,
    s_page, s_head, s_slot,  # K pool strides
    sv_page, sv_head, sv_slot,  # V pool strides
    H_KV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, KV_SAME: tl.constexpr,
):
    """Where keys n0 .. n0 + BLOCK_N - 1 of KV head h_kv live in the K and the V pool: (k, v) rows of the pools
    seen as 2D [num_pages * H_kv * PAGE_SIZE, D] tensors (TMA: one row index serves both), or element offsets
    [BLOCK_N, BLOCK_DK] and [BLOCK_N, BLOCK_DV] (pointers), from one page-table lookup. KV_SAME (the pools
    share head size and strides, the common case): one set of offsets serves both."""
    if USE_TMA:
        page = tl.load(table_row + n0 // PAGE_SIZE)  # the block lies inside one page
        k_coord = (page * H_KV + h_kv) * PAGE_SIZE + n0 % PAGE_SIZE
        v_coord = k_coord
    elif KV_SAME:
        rows = kv_offsets(table_row, n0, n_pages, h_kv.to(tl.int64) * s_head, s_page, s_slot, BLOCK_N, PAGE_SIZE)
        k_coord = rows[:, None] + tl.arange(0, BLOCK_DK)[None, :]
        v_coord = k_coord
    else:
        page, slot = key_pages(table_row, n0, n_pages, BLOCK_N, PAGE_SIZE)
        h64 = h_kv.to(tl.int64)
        k_rows = page * s_page + h64 * s_head + slot * s_slot
        v_rows = page * sv_page + h64 * sv_head + slot * sv_slot
        k_coord = k_rows[:, None] + tl.arange(0, BLOCK_DK)[None, :]
        v_coord = v_rows[:, None] + tl.arange(0, BLOCK_DV)[None, :]
    return k_coord, v_coord


@triton.jit
def load_kv(
    POOL,  # [num_pages, H_kv, PAGE_SIZE, D] K or V pool (pointer loads)
    DESC,  # TMA descriptor of POOL as [num_pages * H_kv * PAGE_SIZE, D] (USE_TMA; only where D == BLOCK_D)
    coord, n_ok, MASK: tl.constexpr, USE_TMA: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """A [BLOCK_N, BLOCK_D] K or V tile, columns past D read as 0. With MASK, keys past kv_len read as 0: their
    slots may hold anything (NaN too), and 0 * NaN would leak into p @ v or dS @ K."""
    if USE_TMA:
        x = DESC.load([coord, 0])
        if MASK:
            x = tl.where(n_ok[:, None], x, 0.0)
    else:
        if MASK:
            x = tl.load(POOL + coord, mask=dims_mask(n_ok[:, None], D, BLOCK_D), other=0.0)
        elif D < BLOCK_D:
            x = tl.load(POOL + coord, mask=dims_mask(tl.full([1, 1], True, tl.int1), D, BLOCK_D), other=0.0)
        else:
            x = tl.load(POOL + coord)
    return x


@triton.jit
def visible_mask(n_pos, q_pos, doc, window, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """[BM, BN] bool: key n visible to row m (causal, window, document)."""
    vis = n_pos[None, :] <= q_pos[:, None]
    if HAS_WINDOW:
        vis = vis & ((q_pos[:, None] - n_pos[None, :]) < window)
    if HAS_DOCS:
        vis = vis & (n_pos[None, :] >= doc[:, None])
    return vis


@triton.jit
def row_masks(
    DOC_ROW,  # [C] int32 document starts of one sequence (HAS_DOCS)
    m0, q0, row_end, G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DOCS: tl.constexpr,
):
    """Per-row position and document start [BM] for masked blocks (recomputed rather than kept live)."""
    row_ok, c, _, q_pos = tile_rows(m0, q0, row_end, G, BLOCK_M)
    if HAS_DOCS:
        doc = tl.load(DOC_ROW + c, mask=row_ok, other=0)
    else:
        doc = q_pos
    return q_pos, doc
