"""Attention of one chunk's queries over a paged K/V store, in plain PyTorch.

This is the CPU path and the oracle for the Triton kernels, which share these
signatures. Conventions (the same for every backend):

- ``q`` [B, H, C, Dk] holds the queries of the NEWEST chunk in the store: absolute
  positions ``kv_len - C .. kv_len - 1``. Keys are every stored token 0 .. kv_len-1
  (the chunk's own keys included, already written to its pages).
- Head sizes: queries and keys have Dk, values and the output Dv. Dk == Dv is the common
  case; latent attention (DeepSeek-V2/V3's MLA: Dk = 192, Dv = 128) has Dk != Dv. The
  ``scale`` is given, never derived from Dk.
- Pools: ``k_pool`` and ``dk_pool`` [num_pages, H_kv, page_size, Dk], ``v_pool`` and
  ``dv_pool`` [num_pages, H_kv, page_size, Dv]; ``page_table`` [B, >= ceil(kv_len/page_size)]
  int32 maps a sequence's page index to a page id (the same for keys and values).
- ``out`` and ``d_out`` [B, H, C, Dv]; ``dq`` [B, H, C, Dk]; ``lse`` [B, H, C].
- GQA: query head h reads KV head h // (H // H_kv), as transformers' repeat_kv does.
- Mask: key position j is visible to query position i when j <= i, and, with a
  ``sliding_window`` W, when i - j < W (transformers' convention).
- ``sinks`` [H] (GPT-OSS): a per-head logit that joins the softmax denominator and
  contributes no value.
- ``doc_start`` [B, C] (packed documents): the position of the first token of each
  query's document; keys before it are invisible (tokens of different documents never
  attend to each other). Non-decreasing along C.
- ``page_select`` [B, H_sel, ceil(C / select_block), K] int32 (page-sparse attention):
  for each block of ``select_block`` queries, the K past pages (sequence page indices,
  all < (kv_len - C) / page_size) it attends; other past pages are invisible to it. The
  chunk's own pages are always attended. H_sel is 1 (one selection for every head) or
  H_kv (per KV head). Needs the chunk to start on a page.
- Arithmetic in float32 (float64 for float64 inputs, the tests' oracle).
- ``lse`` [B, H, C] float32: natural-log sum of exp over the visible keys (and the sink).

Memory is bounded: keys are visited in blocks of pages with an online-softmax merge,
so the largest temporary is [B, H, C, block_tokens] float32, never [C, kv_len].
``block_tokens`` is chosen so one such block is about ``_BLOCK_BYTES``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from oomb.cache.layout import first_visible_page, tiles_to_tokens, tokens_to_tiles

# Score block budget: about 4 fp32 [B, H, C, block] temporaries live in the backward at once.
# Larger on CUDA, where fewer, larger blocks keep the GPU busy between launches.
_BLOCK_BYTES = {"cpu": 128 * 2**20, "cuda": 512 * 2**20}


def _block_pages(q: torch.Tensor, page_size: int, block_tokens: int | None) -> int:
    b, h, c, _ = q.shape
    if block_tokens is None:
        budget = _BLOCK_BYTES.get(q.device.type, _BLOCK_BYTES["cpu"])
        block_tokens = max(page_size, budget // (4 * b * h * c))
    return max(1, block_tokens // page_size)


def _key_blocks(kv_len: int, q_len: int, page_size: int, first_page: int, always_mask: bool, step: int):
    """(first page, end page, needs a mask) of each key block to visit, from ``first_page`` on.

    Pages wholly before the first query position are visible to every query (unless a
    window, a document start or a page selection cuts them: ``always_mask``), so those
    blocks skip the mask; the rest are masked.
    """
    n_pages = -(-kv_len // page_size)
    boundary = (kv_len - q_len) // page_size  # pages [0, boundary) hold only keys < every query position
    p0 = first_page
    while p0 < n_pages:
        p1 = min(p0 + step, n_pages, boundary) if p0 < boundary else min(p0 + step, n_pages)
        yield p0, p1, p0 >= boundary or always_mask
        p0 = p1


@contextlib.contextmanager
def _tf32_for(dtype: torch.dtype, device: torch.device):
    """Let fp32 matmuls use TF32 on CUDA when the inputs are bf16/fp16.

    bf16 and fp16 values are exact in TF32, so q @ k^T loses nothing; probabilities
    keep 10 mantissa bits (bf16 flash kernels keep 8). fp32 inputs stay full fp32.
    """
    if device.type != "cuda" or dtype == torch.float32:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic in fp32, or fp64 for fp64 inputs (tests use fp64 as the oracle)."""
    return torch.promote_types(dtype, torch.float32)


def _gather_block(pool: torch.Tensor, page_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pool[page_ids] for page_ids [B, n] -> [B, H_kv, n * page_size, D] in ``dtype``."""
    return tiles_to_tokens(pool[page_ids.long()]).to(dtype)


@dataclass
class _Visibility:
    """Which keys each row of the grouped layout (row r = g * C + c) sees, beyond causality."""

    q_pos_rows: torch.Tensor  # [G*C] absolute position of each row
    kv_len: int
    sliding_window: int | None
    doc_start_rows: torch.Tensor | None  # [B, 1, G*C] first key of each row's document
    selected: torch.Tensor | None  # [B, H_sel, G*C, n_past_pages] bool: past pages each row attends
    first_page: int  # pages before it are invisible to every row

    def mask(self, p0: int, p1: int, page_size: int) -> torch.Tensor:
        """[rows, T] or [B, H_sel|1, rows, T] bool for the keys of pages [p0, p1)."""
        k_pos = torch.arange(p0 * page_size, p1 * page_size, device=self.q_pos_rows.device)
        q_pos = self.q_pos_rows
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < self.kv_len)
        if self.sliding_window is not None:
            visible &= (q_pos[:, None] - k_pos[None, :]) < self.sliding_window
        if self.doc_start_rows is not None:
            visible = visible & (k_pos >= self.doc_start_rows[..., None])
        if self.selected is not None:
            n_past = self.selected.shape[-1]
            if p0 < n_past:  # blocks never straddle the chunk's first page (_key_blocks splits there)
                rows_pages = self.selected[..., p0:p1].repeat_interleave(page_size, dim=-1)
                visible = visible & rows_pages
        return visible


def _visibility(q, kv_heads, kv_len, page_size, sliding_window, doc_start, page_select, select_block) -> _Visibility:
    b, h, c, _ = q.shape
    g = h // kv_heads
    q_pos_rows = torch.arange(kv_len - c, kv_len, device=q.device).repeat(g)  # row g*C + i -> position i
    doc_rows = None
    first_doc = 0
    if doc_start is not None:
        doc_rows = doc_start.to(q.device, torch.int64).repeat(1, g).unsqueeze(1)  # [B, 1, G*C]
        first_doc = int(doc_start[:, 0].min())  # non-decreasing: the first query has the smallest
    selected = None
    if page_select is not None:
        n_past = (kv_len - c) // page_size
        bitmap = torch.zeros(*page_select.shape[:3], max(n_past, 1), dtype=torch.bool, device=q.device)
        bitmap.scatter_(-1, page_select.to(q.device, torch.int64), True)
        qb_of_c = torch.arange(c, device=q.device) // select_block
        selected = bitmap[:, :, qb_of_c, :n_past].repeat(1, 1, g, 1)  # [B, H_sel, G*C, n_past]
    first_page = first_visible_page(kv_len, c, page_size, sliding_window, first_doc)
    return _Visibility(q_pos_rows, kv_len, sliding_window, doc_rows, selected, first_page)


def check_paged_args(q, k_pool, page_table, kv_len, sliding_window, v_pool=None) -> int:
    """Shapes and ranges every backend needs of a call over paged keys; returns the pages kv_len spans.

    q [B, H, C, Dk] against k_pool [num_pages, H_kv, page_size, Dk] and, when given, v_pool
    [num_pages, H_kv, page_size, Dv] (any Dv: the values' head size may differ from the keys')."""
    if q.dim() != 4 or k_pool.dim() != 4:
        raise ValueError(f"q must be [B, H, C, Dk] and k_pool [num_pages, H_kv, page_size, Dk]; got q "
                         f"{tuple(q.shape)}, k_pool {tuple(k_pool.shape)}")
    b, h, c, d = q.shape
    _, h_kv, page_size, d_kv = k_pool.shape
    if h % h_kv:
        raise ValueError(f"q {tuple(q.shape)} does not fit pools {tuple(k_pool.shape)}: its {h} heads are not a "
                         f"multiple of the pools' {h_kv} KV heads")
    if d_kv != d:
        raise ValueError(f"q {tuple(q.shape)} does not fit pools {tuple(k_pool.shape)}: q's head size {d} must equal "
                         f"k_pool's {d_kv} (queries and keys share Dk; values may differ)")
    if v_pool is not None and (v_pool.dim() != 4 or v_pool.shape[:3] != k_pool.shape[:3]):
        raise ValueError(f"v_pool {tuple(v_pool.shape)} must be [num_pages, H_kv, page_size, Dv] with k_pool's "
                         f"first three sizes {tuple(k_pool.shape[:3])} (any Dv)")
    if not 0 < c <= kv_len:
        raise ValueError(f"the chunk ({c} queries) must be the newest part of kv_len={kv_len}")
    n_pages = -(-kv_len // page_size)
    if page_table.dim() != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [B, n] with B={b}; got {tuple(page_table.shape)}")
    if page_table.shape[1] < n_pages:
        raise ValueError(f"page_table has {page_table.shape[1]} columns, kv_len={kv_len} needs {n_pages}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return n_pages


def check_visibility_args(q, kv_heads, kv_len, page_size, doc_start, page_select, select_block) -> None:
    """Shapes and ranges of doc_start / page_select (shared by every backend)."""
    b, h, c, _ = q.shape
    if doc_start is not None:
        if doc_start.shape != (b, c) or doc_start.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"doc_start must be an integer [B, C]={b, c} tensor, got "
                             f"{doc_start.dtype} {tuple(doc_start.shape)}")
    if page_select is not None:
        if select_block is None or select_block <= 0:
            raise ValueError("page_select needs select_block > 0 (queries per selection block)")
        if (kv_len - c) % page_size:
            raise ValueError(f"page_select needs the chunk to start on a page (kv_len - C = {kv_len - c}, "
                             f"page_size = {page_size})")
        n_qb = -(-c // select_block)
        if (page_select.dim() != 4 or page_select.shape[0] != b or page_select.shape[1] not in (1, kv_heads)
                or page_select.shape[2] != n_qb or page_select.dtype != torch.int32):
            raise ValueError(f"page_select must be int32 [B, 1 or H_kv, ceil(C / select_block), K] = "
                             f"[{b}, 1|{kv_heads}, {n_qb}, K], got {page_select.dtype} {tuple(page_select.shape)}")


def check_backward_args(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool) -> None:
    """Shapes of a backward call's tensors beyond the forward's (shared by every backend): out and d_out
    [B, H, C, Dv], lse [B, H, C], dk_pool like k_pool and dv_pool like v_pool."""
    b, h, c, _ = q.shape
    out_shape = (b, h, c, v_pool.shape[-1])
    if tuple(out.shape) != out_shape or tuple(d_out.shape) != out_shape:
        raise ValueError(f"out {tuple(out.shape)} and d_out {tuple(d_out.shape)} must be [B, H, C, Dv] = {out_shape}")
    if tuple(lse.shape) != (b, h, c):
        raise ValueError(f"lse {tuple(lse.shape)} must be [B, H, C] = {(b, h, c)}")
    if dk_pool.shape != k_pool.shape or dv_pool.shape != v_pool.shape:
        raise ValueError(f"dk_pool {tuple(dk_pool.shape)} and dv_pool {tuple(dv_pool.shape)} must match k_pool "
                         f"{tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)}")


def _block_scores(qg, k_pool, v_pool, page_table, p0, p1, masked, vis: _Visibility, scale):
    """Keys and values of pages [p0, p1) in qg's dtype, and the scaled scores with invisible keys at -inf."""
    ids = page_table[:, p0:p1]
    k = _gather_block(k_pool, ids, qg.dtype)
    v = _gather_block(v_pool, ids, qg.dtype)
    s = (qg @ k.transpose(-1, -2)) * scale
    if masked:
        s = s.masked_fill(~vis.mask(p0, p1, k_pool.shape[2]), -math.inf)
    return k, v, s


def _group(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, C, ...] -> [B, H_kv, G*C, ...]: the G query heads of a KV head as one row block."""
    b, h, c = x.shape[:3]
    return x.reshape(b, kv_heads, (h // kv_heads) * c, *x.shape[3:])


def _sink_logits(sinks: torch.Tensor, batch: int, kv_heads: int, q_len: int) -> torch.Tensor:
    """sinks [H] -> [B, H_kv, G*C], aligned with _group's row order."""
    g = sinks.numel() // kv_heads
    per_row = sinks.to(_acc_dtype(sinks.dtype)).view(1, kv_heads, g, 1).expand(batch, kv_heads, g, q_len)
    return per_row.reshape(batch, kv_heads, g * q_len)


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
    block_tokens: int | None = None,
    page_union: int | None = None,  # the most distinct pages one row's lists name (fa4 sizes its gather by it); unused
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B, H, C, Dv] in q.dtype, lse [B, H, C] float32)."""
    b, h, c, _ = q.shape
    h_kv, page_size, d_v = k_pool.shape[1], k_pool.shape[2], v_pool.shape[-1]
    check_paged_args(q, k_pool, page_table, kv_len, sliding_window, v_pool)
    check_visibility_args(q, h_kv, kv_len, page_size, doc_start, page_select, select_block)
    vis = _visibility(q, h_kv, kv_len, page_size, sliding_window, doc_start, page_select, select_block)
    acc_dtype = _acc_dtype(q.dtype)
    qg = _group(q, h_kv).to(acc_dtype)
    rows = qg.shape[2]

    if sinks is not None:
        m = _sink_logits(sinks, b, h_kv, c).to(acc_dtype)
        l = torch.ones_like(m)  # exp(sink - m) with m = sink
    else:
        m = torch.full((b, h_kv, rows), -math.inf, device=q.device, dtype=acc_dtype)
        l = torch.zeros((b, h_kv, rows), device=q.device, dtype=acc_dtype)
    acc = torch.zeros((b, h_kv, rows, d_v), device=q.device, dtype=acc_dtype)

    step = _block_pages(q, page_size, block_tokens)
    always_mask = sliding_window is not None or doc_start is not None or page_select is not None
    with _tf32_for(q.dtype, q.device):
        for p0, p1, masked in _key_blocks(kv_len, c, page_size, vis.first_page, always_mask, step):
            k, v, s = _block_scores(qg, k_pool, v_pool, page_table, p0, p1, masked, vis, scale)
            m_new = torch.maximum(m, s.amax(dim=-1))
            # Rows that have seen no visible key yet keep m = -inf; shift by 0 there to avoid inf - inf.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + p @ v
            m = m_new
    # Every query sees at least its own key, so l > 0.
    out = acc / l.unsqueeze(-1)
    lse = m + torch.log(l)
    return out.reshape(b, h, c, d_v).to(q.dtype), lse.reshape(b, h, c).to(acc_dtype)


def paged_attention_backward(
    d_out: torch.Tensor,  # [B, H, C, Dv]
    q: torch.Tensor,  # [B, H, C, Dk]
    out: torch.Tensor,  # [B, H, C, Dv]
    lse: torch.Tensor,  # [B, H, C] float32
    k_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dk]
    v_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dv]
    dk_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dk], accumulated into
    dv_pool: torch.Tensor,  # [num_pages, H_kv, page_size, Dv], accumulated into
    page_table: torch.Tensor,  # [B, >= ceil(kv_len / page_size)] int32
    kv_len: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [H]
    doc_start: torch.Tensor | None = None,  # [B, C]
    page_select: torch.Tensor | None = None,  # [B, H_sel, ceil(C / select_block), K] int32
    select_block: int | None = None,
    block_tokens: int | None = None,
    page_union: int | None = None,  # the most distinct pages one row's lists name (fa4 sizes its gather by it); unused
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Adds dK/dV of every visible page into dk_pool/dv_pool.

    Returns (dq [B, H, C, Dk] in q.dtype, d_sinks [H] float32 (fp64 for fp64 q) or None).
    """
    b, h, c, d = q.shape
    h_kv, page_size = k_pool.shape[1], k_pool.shape[2]
    check_paged_args(q, k_pool, page_table, kv_len, sliding_window, v_pool)
    check_backward_args(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool)
    check_visibility_args(q, h_kv, kv_len, page_size, doc_start, page_select, select_block)
    vis = _visibility(q, h_kv, kv_len, page_size, sliding_window, doc_start, page_select, select_block)
    acc_dtype = _acc_dtype(q.dtype)
    qg = _group(q, h_kv).to(acc_dtype)
    dog = _group(d_out, h_kv).to(acc_dtype)
    lse_g = _group(lse, h_kv).to(acc_dtype)
    delta = (dog * _group(out, h_kv).to(acc_dtype)).sum(dim=-1)  # [B, H_kv, G*C] = rowsum(dO * O) over Dv
    dq = torch.zeros_like(qg)

    step = _block_pages(q, page_size, block_tokens)
    always_mask = sliding_window is not None or doc_start is not None or page_select is not None
    with _tf32_for(q.dtype, q.device):
        for p0, p1, masked in _key_blocks(kv_len, c, page_size, vis.first_page, always_mask, step):
            k, v, s = _block_scores(qg, k_pool, v_pool, page_table, p0, p1, masked, vis, scale)
            p = torch.exp(s - lse_g.unsqueeze(-1))  # masked keys: exp(-inf) = 0
            ids = page_table[:, p0:p1]
            dv = p.transpose(-1, -2) @ dog  # [B, H_kv, T, Dv], summed over the group's heads
            ds = p * (dog @ v.transpose(-1, -2) - delta.unsqueeze(-1))
            dq += (ds @ k) * scale
            dk = (ds.transpose(-1, -2) @ qg) * scale
            flat_ids = ids.reshape(-1).long()
            dk_pool.index_add_(0, flat_ids, tokens_to_tiles(dk, page_size).to(dk_pool.dtype))
            dv_pool.index_add_(0, flat_ids, tokens_to_tiles(dv, page_size).to(dv_pool.dtype))

    d_sinks = None
    if sinks is not None:
        # The sink is a key with logit `sink` and value 0: dS_sink = P_sink * (0 - delta).
        p_sink = torch.exp(_sink_logits(sinks, b, h_kv, c) - lse_g)
        d_sinks = -(p_sink * delta).reshape(b, h, c).sum(dim=(0, 2))
    return dq.reshape(b, h, c, d).to(q.dtype), d_sinks

