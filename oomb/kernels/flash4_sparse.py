"""Page-sparse attention (``page_select``) as FlashAttention-4 block sparsity, for the ``fa4`` backend.

What flash-attn-4 4.0.0b40 offers (files under flash_attn/cute/, lines of that release)
-------------------------------------------------------------------------------------
- ``BlockSparseTensorsTorch`` (block_sparsity.py:39-49): ``mask_block_cnt``/``mask_block_idx`` and
  ``full_block_cnt``/``full_block_idx``, int32 on the GPU, plus ``block_size`` (q, kv) in tokens.
  ``_flash_attn_fwd`` and ``_flash_attn_bwd`` each take one as ``block_sparse_tensors``
  (interface.py:621, 2109).
- Forward (block_sparsity.py:294-386, 532-603): per (batch, query head, query block) the key blocks
  a query block visits: cnt [B, H, n_q_blocks], idx [B, H, n_q_blocks, n] with entries valid up to
  cnt. Batch and head dims may be 1 (broadcast, block_sparsity.py:360-371); the head dim counts
  QUERY heads (num_head). idx may be narrower than the key block count: FA4 reads entries
  0 .. cnt-1 only (block_sparsity.py:245-253, 374-379). "mask" blocks get the mask applied, "full"
  blocks skip ``mask_mod`` (block_sparse_utils.py:431-617); a block in both lists would be visited
  twice. Lists are walked from their last entry down, the first block walked also masking the
  key sequence's end (block_sparse_utils.py:163-233, 464-510): entries ascending.
- Block sizes: ``block_size[1]`` must equal the kernel's key tile on SM90 (no coarse key blocks:
  block_sparsity.py:555-564 with allow_kv_subtile only for SM100, interface.py:994;
  block_sparse_utils.py:301-305), ``block_size[0]`` a multiple of the query tile, the multiple being
  ``q_subtile_factor`` (block_sparsity.py:340-348). SM90 with head_dim <= 128 runs 128 x 128
  forward tiles (config.py:241-279, shrunk to fit the blocks by config.py:282-294, 673-686) and
  64 x 128 backward tiles for causal head_dim 65..128 (128 x 128 for <= 64; config.py:2994-3017),
  so blocks of (128, 128) serve both directions; ``get_sparse_q_block_size`` (block_sparsity.py:181-195)
  reads block_size[0] when given, else infers it from seqlen_q / n_q_blocks. Up to 128 those tiles depend on
  the key head size alone; oomb asks with the wider of the key and value sizes (Dk != Dv: latent attention),
  which covers both.
- Causal: ``causal=True`` needs no ``mask_mod`` (one given turns causal off, interface.py:279-300).
  Both SM90 and SM100 bind ``mask_causal`` into the mask of EVERY listed block, full ones too
  (flash_fwd_sm90.py:1158-1167 and block_sparse_utils.py:1805-1832 backward; flash_fwd_sm100.py:
  2618-2667), aligned bottom-right: key j is visible to query i when j <= i + seqlen_k - seqlen_q
  (mask.py:297-321). oomb relies on less: only blocks across the diagonal are listed as mask.
- GQA: sparse tensors are indexed by query head. A per-head list (head dim > 1) turns PackGQA off
  (interface.py:230-235, config.py:1574-1575, 1845-1846); with a head-broadcast list PackGQA maps
  its packed rows back to query blocks (block_sparse_utils.py:255-267).
- Backward (block_sparsity.py:389-411, 606-654; flash_bwd_sm90.py:1440-1560, 1930-2030): the same
  pairs transposed, per key block the query blocks that visit it: cnt [B, H, n_k_blocks],
  idx [B, H, n_k_blocks, n_q_blocks], block_size as in the forward (its q block a multiple of the
  backward's 64-row tile). dQ comes from these lists too, so they must name the forward's pairs
  exactly. A key block with no query block gets dK = dV = 0 written (flash_bwd_sm90.py:1534-1558).
  Deterministic mode needs ``dq_write_order`` (compute_dq_write_order, block_sparsity.py:80-148;
  interface.py:2511-2527), and the SM90 kernel has no deterministic block-sparse path at all
  (flash_bwd_sm90.py:2013-2016).
- Not combinable: block sparsity with varlen in the backward (interface.py:2124-2130; the forward
  wants cu_total_m_blocks, interface.py:966-979), with qv (interface.py:1015-1016), SM120 backward
  (interface.py:2155-2156). Windows combine in the kernels but oomb does not use them here.

How oomb uses it
----------------
Each row gathers the union of the pages its lists chose, ascending, then the chunk's own keys, so
one FA4 key block is one page (``page_size`` must equal FA4's key block)::

    gathered row:  | u_0 | u_1 | ... | u_{U-1} | chunk's own keys (C) |
                   chosen pages, then pages     key blocks U .. U + ceil(C / page) - 1
                   nobody chose (padding)       (C may end mid-page)

U = min(past pages, entries of one row's lists, the selection's cap on a chunk's pages where it has
one: PageSelection.chunk_pages, handed over as ``page_union``) is fixed by the shapes and settings, so
nothing waits for the GPU to learn how many pages were chosen (no .item(), no torch.unique). A row
that chose fewer fills
up with pages it did not choose; no list names them, so FA4 never reads them in attention and
writes zero gradients for them. Past keys all precede the chunk, so with bottom-right causality
(seqlen_k - seqlen_q = U * page) every query sees them: a chosen page is a full block. The chunk's
own blocks are full where every query of the query block sees the whole page, and mask blocks
across the diagonal (and the page holding the chunk's ragged end).

FA4's query block is its tile (``block_q``), each inheriting the list of the selection block it lies
in, so ``select_block`` must be a multiple of ``block_q`` (or cover the chunk: one list).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class BlockLists:
    """FA4's block lists of one direction: for each row block, the blocks it pairs with, ascending, valid up to
    the count. ``mask``: blocks the causal mask cuts (the chunk's own keys across the diagonal); ``full``: blocks
    every query of the pair sees whole. Head dim: 1 (one list for every head) or the query heads."""

    mask_cnt: torch.Tensor  # [B, H | 1, rows] int32
    mask_idx: torch.Tensor  # [B, H | 1, rows, width] int32
    full_cnt: torch.Tensor  # [B, H | 1, rows] int32
    full_idx: torch.Tensor  # [B, H | 1, rows, width] int32


@dataclass(frozen=True)
class BlockSparsity:
    """One page-sparse call's pairs of (query block, key block) over the gathered keys, in FA4's form for the
    forward, the backward, or both (a direction not asked for is None: a call reads only its own)."""

    forward: BlockLists | None  # rows: query blocks of block_q; entries: key blocks of block_kv
    backward: BlockLists | None  # rows: key blocks; entries: query blocks
    block_q: int
    block_kv: int


class SparseKeys(NamedTuple):
    """What one page-sparse call gathers (``page_ids``/``slots`` [B * keys_per_row], row after row) and its pairs."""

    page_ids: torch.Tensor
    slots: torch.Tensor
    keys_per_row: int
    sparsity: BlockSparsity


def chosen_pages(page_select: torch.Tensor, n_past: int,
                 page_union: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages [B, U] int64: each row's chosen past pages ascending, then pages nobody chose; where [B, n_past]
    int64: each past page's place in that order, a permutation per row). U = min(n_past, entries per row,
    ``page_union``: the most distinct pages a row's lists name where the selection capped them)."""
    b = page_select.shape[0]
    device = page_select.device
    u = min(n_past, page_select[0].numel(), page_select[0].numel() if page_union is None else page_union)
    chosen = torch.zeros(b, n_past, dtype=torch.bool, device=device)
    chosen.scatter_(1, page_select.reshape(b, -1).long(), True)
    # Chosen pages first, each at its rank among them; the others after, in order: a stable partition by
    # cumulative sums, with no sort and no data-dependent size.
    where = torch.where(chosen, chosen.cumsum(1) - 1, chosen.sum(1, keepdim=True) + (~chosen).cumsum(1) - 1)
    pages = torch.empty_like(where)
    pages.scatter_(1, where, torch.arange(n_past, device=device).expand(b, n_past))
    return pages[:, :u], where


def own_blocks(q_len: int, block_q: int, page_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, full) [n_q_blocks, ceil(q_len / page_size)] bool: which of the chunk's own pages each query block
    sees in part (the causal mask cuts them) and whole. The page holding a ragged end stays a mask block."""
    q0 = torch.arange(0, q_len, block_q, device=device)  # each query block's first query, in the chunk
    q_last = torch.clamp(q0 + block_q, max=q_len) - 1
    k0 = torch.arange(0, q_len, page_size, device=device)
    k_end = torch.clamp(k0 + page_size, max=q_len)
    seen = k0[None, :] <= q_last[:, None]
    whole = (k_end[None, :] - 1 <= q0[:, None]) & (k0 + page_size <= q_len)[None, :]
    return seen & ~whole, whole


def _own_widths(q_len: int, block_q: int, page_size: int) -> tuple[int, int, int]:
    """The most own pages one query block lists as mask and as full, and the most query blocks one own page
    lists as mask: own_blocks' row and column sums, in host arithmetic (the lists' widths, no device read)."""
    n_own = -(-q_len // page_size)
    mask = full = 0
    mask_of_page = [0] * n_own
    for q0 in range(0, q_len, block_q):
        q_last = min(q0 + block_q, q_len) - 1
        n_whole = min(q0 + 1, q_len) // page_size  # pages t with (t + 1) * page - 1 <= q0, none ragged
        n_seen = q_last // page_size + 1
        mask, full = max(mask, n_seen - n_whole), max(full, n_whole)
        for t in range(n_whole, n_seen):
            mask_of_page[t] += 1
    return mask, full, max(mask_of_page)


def compact(bits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cnt [...] int32, idx [..., width] int32): the positions of True along the last dim, ascending, zeros
    after the count. Every row must hold at most ``width`` (at least 1: FA4 gets no empty dimension)."""
    width = max(width, 1)
    n = bits.shape[-1]
    cnt = bits.sum(-1, dtype=torch.int32)
    col = torch.where(bits, bits.cumsum(-1) - 1, width)  # False entries go to a spare column, cut off below
    idx = torch.zeros(*bits.shape[:-1], width + 1, dtype=torch.int32, device=bits.device)
    idx.scatter_(-1, col, torch.arange(n, dtype=torch.int32, device=bits.device).expand(bits.shape))
    return cnt, idx[..., :width]


DIRECTIONS = ("forward", "backward")


@functools.lru_cache(maxsize=64)
def _chunk_lists(q_len: int, block_q: int, page_size: int, n_union: int, select_block: int, b: int, heads: int,
                 direction: str, device: torch.device) -> tuple:
    """What a call's lists hold that depends on the shapes alone, made once per shape (not per layer and chunk: each
    is several small kernels the host launches while the GPU waits): (the chunk's own blocks [n_q, n_own] as full
    bits, each FA4 query block's selection block [n_q], the direction's mask lists (cnt, idx) per head [B, heads,
    ...], the most own pages a query block lists as full). Read-only: FA4 only reads its lists, and the per-call
    tensors are built from these, never into them."""
    n_q = -(-q_len // block_q)
    own_mask, own_full = own_blocks(q_len, block_q, page_size, device)
    selection_block = torch.arange(n_q, device=device) * block_q // select_block  # one list: all 0
    mask = torch.cat([torch.zeros(n_q, n_union, dtype=torch.bool, device=device), own_mask], dim=1)
    max_mask, max_full, max_mask_of_page = _own_widths(q_len, block_q, page_size)
    if direction == "forward":
        cnt, idx = compact(mask, max_mask)
    else:
        cnt, idx = compact(mask.T, max_mask_of_page)
    mask_cnt, mask_idx = (x.expand(b, heads, *x.shape).contiguous() for x in (cnt, idx))
    return own_full, selection_block, mask_cnt, mask_idx, max_full


def block_sparsity(page_select: torch.Tensor, where: torch.Tensor, n_union: int, q_len: int, select_block: int,
                   block_q: int, page_size: int, num_heads: int, directions=DIRECTIONS) -> BlockSparsity:
    """The pairs of FA4 blocks over keys gathered as the module docstring draws them, listed for ``directions``
    (the others None: each attention call builds only the lists its kernel reads).

    ``where`` [B, n_past]: each past page's place among the gathered ones (chosen_pages); ``n_union``: U.
    Memory: [B, H_sel, ceil(C / block_q), U + ceil(C / page)] bools and their int64 cumulative sums, per call
    (a chunk of 16K queries over a past of 1M tokens in pages of 128: 128 x 8320 per row and list head).
    """
    if unknown := set(directions) - set(DIRECTIONS):
        raise ValueError(f"directions: {sorted(unknown)} are not among {DIRECTIONS}")
    b, h_sel, n_sel, _ = page_select.shape
    device = page_select.device
    n_q = -(-q_len // block_q)
    heads = 1 if h_sel == 1 else num_heads

    # The gathered key block of every listed page, then each FA4 query block's bits from its selection block.
    at = torch.gather(where.view(b, 1, 1, -1).expand(b, h_sel, n_sel, -1), 3, page_select.long())
    past = torch.zeros(b, h_sel, n_sel, n_union, dtype=torch.bool, device=device).scatter_(3, at, True)

    def per_head(x: torch.Tensor) -> torch.Tensor:
        # [B, H_sel, ...] -> [B, heads, ...]: FA4 indexes lists by query head; query head h reads KV head h // G.
        if x.shape[1] != heads:
            x = x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] > 1 else x.expand(b, heads, *x.shape[2:])
        return x.expand(b, *x.shape[1:]).contiguous()

    lists = {}
    for direction in directions:
        own_full, selection_block, mask_cnt, mask_idx, max_full = _chunk_lists(
            q_len, block_q, page_size, n_union, select_block, b, heads, direction, device)
        full = torch.cat([past[:, :, selection_block], own_full.expand(b, h_sel, n_q, own_full.shape[1])], dim=3)
        if direction == "forward":
            full_cnt, full_idx = compact(full, min(page_select.shape[3], n_union) + max_full)
        else:
            full_cnt, full_idx = compact(full.transpose(2, 3), n_q)
        lists[direction] = BlockLists(mask_cnt, mask_idx, per_head(full_cnt), per_head(full_idx))
    return BlockSparsity(lists.get("forward"), lists.get("backward"), block_q, page_size)


def page_sparse_keys(page_table: torch.Tensor, kv_len: int, q_len: int, page_size: int, page_select: torch.Tensor,
                     select_block: int, block_q: int, num_heads: int, directions=DIRECTIONS,
                     page_union: int | None = None,
                     chosen: tuple[torch.Tensor, torch.Tensor] | None = None) -> SparseKeys:
    """The keys one page-sparse call gathers (its chosen pages, then its chunk) and FA4's pairs over them, listed
    for ``directions`` (``page_union``: as in chosen_pages; ``chosen``: chosen_pages' result for these arguments,
    where the caller kept it from an earlier call of the same selection)."""
    b = page_table.shape[0]
    device = page_table.device
    q0 = kv_len - q_len  # the chunk starts on a page (check_visibility_args)
    pages, where = chosen if chosen is not None else chosen_pages(page_select, q0 // page_size, page_union)
    u = pages.shape[1]
    p0, n_own = q0 // page_size, -(-q_len // page_size)
    keys_per_row = u * page_size + q_len
    # Each gathered page's id for each of its slots; the chunk's own pages follow the chosen ones (it may end mid-page).
    page_ids = torch.cat([page_table.gather(1, pages), page_table[:, p0 : p0 + n_own]], dim=1).long()
    page_ids = page_ids.repeat_interleave(page_size, dim=1)[:, :keys_per_row]
    sparsity = block_sparsity(page_select, where, u, q_len, select_block, block_q, page_size, num_heads, directions)
    return SparseKeys(page_ids.reshape(-1), _slots(page_size, keys_per_row, b, device), keys_per_row, sparsity)


@functools.lru_cache(maxsize=64)
def _slots(page_size: int, keys_per_row: int, rows: int, device: torch.device) -> torch.Tensor:
    """[rows * keys_per_row]: each gathered key's slot in its page (every row's pages start on a page boundary)."""
    return (torch.arange(keys_per_row, device=device) % page_size).repeat(rows)
