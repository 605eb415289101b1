"""Paged attention through FlashAttention-4 (the ``fa4`` backend; Hopper and Blackwell GPUs).

FA4 attends contiguous keys and values and its backward takes no page table, so each call
gathers the keys and values its queries can see out of the pages into FA4's layout (one copy
of about kv_len x H_kv x (Dk + Dv) elements, linear in the context where the attention is
quadratic), and the backward adds FA4's dK/dV back into the gradient pages through the same
page ids. Documents packed into a row become FA4's variable-length sequences: each document's
queries in the chunk over its keys from its first token, bottom-right causal, as in the
reference (kernels/reference.py, whose conventions hold here too).

The gathered copy and FA4's dK/dV for it grow with the keys a call sees (about 8 KiB per key for
Qwen2.5-7B). Past ``key_segment`` keys a dense call without documents or a window attends its past in
segments of that many keys, each seen whole (no causal mask), and the chunk with the rest of the past
causally; the outputs merge by their log-sum-exps. Each segment's backward runs against the merged
output and log-sum-exp, which is FA4's backward over that segment's share of the softmax: the dQ of the
segments add up to the whole call's, and each segment's dK/dV are the whole call's for its keys. So a
call's workspace is bounded by ``key_segment`` plus the chunk at any context length.

Page-sparse selections (``page_select``) become FA4's block sparsity over the union of the chosen
pages and the chunk's own keys (kernels/flash4_sparse.py) where the kernels object offers it
(``block_sparse_blocks``) and the call fits its blocks. What FA4 cannot express here goes to the
fallback backend (the Triton kernels on a GPU): per-head sinks, 32-bit inputs, head sizes FA4
lacks (``fa4_supports_head_dims``: on Hopper, sizes off multiples of 8 or above 256, and key and
value sizes that differ under GQA), and selections with documents, a window, or pages and selection
blocks off FA4's blocks. The choice depends only on the call's arguments, which forward and backward
share, so an output and its gradient always come from the same kernels.

The kernels are an object with ``forward``/``backward`` (``FlashAttention4`` wraps
flash-attn-4's functions); tests give a PyTorch stand-in with FA4's semantics to check the
gathering, packing and scattering on CPU against the reference backend.
"""

from __future__ import annotations

import collections
import os
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from oomb.cache.layout import first_visible_page
from oomb.kernels import flash4_sparse
from oomb.kernels.flash4_sparse import BlockLists, BlockSparsity, page_sparse_keys
from oomb.kernels.reference import check_backward_args, check_paged_args, check_visibility_args

# The flash-attn-4 release this adapter was written and measured against: it calls the
# package's forward and backward functions below its autograd wrapper (oomb runs its own
# backward), which a later release may change.
FLASH4_VERSION = "4.0.0b40"

# FA4's block sparsity runs the page-sparse calls where it can (Hopper): its GPU tests passed on the H200 and a
# sparse 128K step of Qwen2.5-7B took 17.2 s on it against 19.8 s on the Triton kernels the day before, though
# recomputing more (docs/benchmarks.md).
# This variable set to "0" keeps page-sparse calls on the Triton kernels.
BLOCK_SPARSE_ENV = "OOMB_FA4_BLOCK_SPARSE"

# Keys of the past one dense call gathers at a time (module docstring): 2 GiB of Qwen2.5-7B's gathered keys,
# values and their gradients. Contexts up to 256K (all the measured steps of docs/benchmarks.md) run in one call.
KEY_SEGMENT = 262144


@dataclass(frozen=True)
class KeyLayout:
    """Which stored keys one call gathers, and how FA4 sees them.

    ``page_ids``/``slots`` [T] locate each gathered key in the pools, row after row. Without
    documents every row gathers the same ``keys_per_row`` keys (FA4's batched layout); with
    documents each (row, document) is one of FA4's variable-length sequences, queries and keys
    back to back (``cu_seqlens_*``, int32 on the device).

    Every key some query sees is named once: a dense layout names each visible key, a page-sparse one its
    chosen pages and then the other past pages (a permutation of the past, chosen_pages), which pad the
    gather and no query sees. Through a table that sends the pages a store does not hold to one row
    (oomb.cache.KVStore.fetch), padding keys may share that row.
    """

    page_ids: torch.Tensor
    slots: torch.Tensor
    keys_per_row: int | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None


def fa4_supports_head_dims(arch: int, head_dim: int, head_dim_v: int, grouped: bool) -> bool:
    """Whether oomb hands FlashAttention-4 (FLASH4_VERSION) a call with key head size ``head_dim`` (queries' too)
    and value head size ``head_dim_v`` on a GPU of major compute capability ``arch`` (9: Hopper, 10: Blackwell);
    ``grouped``: more query heads than KV heads (GQA, MQA). Forward and backward alike: an output and its
    gradient come from the same kernels. What it refuses goes to the fallback (the Triton kernels).

    What flash-attn-4 4.0.0b40 takes (files under flash_attn/cute/ of its wheel, lines of that release):
    - Hopper (SM90): Dk and Dv each from 8 to 256 and a multiple of 8 (16 bytes of bf16/fp16), Dk != Dv
      included: ``_validate_head_dims`` (interface.py:134-146), called by the forward (interface.py:789-792) and
      the backward (interface.py:2315-2317). Sizes off a multiple of 16 are padded to FA4's tiles and
      predicated (flash_fwd.py:81-89, flash_bwd_sm90.py:84-92); the tiles for head_dim > 128 come from
      config.py:241-279 (forward) and select_sm90_bwd_tile (backward).
      But the SM90 backward asserts head_dim == head_dim_v when there are more query heads than KV heads
      (flash_bwd_sm90.py:122-123, "GQA backward requires head_dim == head_dim_v"): GQA or MQA with Dk != Dv
      falls back. DeepSeek-V2/V3-style latent attention (Dk 192, Dv 128) reaches attention with as many KV
      heads as query heads, so it runs on FA4.
    - Blackwell (SM100/SM110): b40 validates both sizes 8..128 (multiples of 8), (192, 128) and (256, 256)
      (interface.py:147-151), with more conditions in its SM100 backward (flash_bwd_sm100.py:255-275); oomb has
      run FA4 there only with equal sizes up to 128, so that is what it hands it.
    """
    if min(head_dim, head_dim_v) < 8 or head_dim % 8 or head_dim_v % 8:
        return False
    if arch == 9:
        return max(head_dim, head_dim_v) <= 256 and (head_dim == head_dim_v or not grouped)
    return head_dim == head_dim_v <= 128


class FlashKernels(Protocol):
    """FA4's two calls, in its layouts: q [B, C, H, Dk], k [B, S, H_kv, Dk] and v [B, S, H_kv, Dv], or (varlen)
    q [T_q, H, Dk], k [T_k, H_kv, Dk] and v [T_k, H_kv, Dv]; out and d_out with Dv, dq with Dk; lse [B, H, C]
    or [H, T_q]. Causal, aligned bottom-right per sequence;
    ``window_left`` keys before each query's own (None: unlimited); ``causal=False``: every key seen (a segment
    of the past, batched layout, no window). The backward takes the forward's out and lse and computes its
    gradients from them (as FA4 does), not from a softmax over the keys it is given.

    ``supports_head_dims(head_dim, head_dim_v, grouped)``: whether it runs these key and value head sizes (with
    more query heads than KV heads where ``grouped``).

    ``block_sparse_blocks(head_dim)``: the (query, key) block sizes in tokens of FA4's block sparsity, or None
    where it is not offered (asked with the wider of the key and value head sizes). Optional: a kernels object
    without it never receives ``block_sparse``, which is only passed to kernels that offer it (batched layout,
    no window): the pairs of blocks attended (flash4_sparse.BlockSparsity), causal within the listed mask
    blocks."""

    dtypes: tuple[torch.dtype, ...]

    def supports_head_dims(self, head_dim: int, head_dim_v: int, grouped: bool) -> bool: ...

    def block_sparse_blocks(self, head_dim: int) -> tuple[int, int] | None: ...

    def forward(self, q, k, v, *, scale: float, window_left: int | None, layout: KeyLayout,
                block_sparse: BlockSparsity | None = None, causal: bool = True): ...

    def backward(self, d_out, q, k, v, out, lse, *, scale: float, window_left: int | None, layout: KeyLayout,
                 block_sparse: BlockSparsity | None = None, causal: bool = True): ...


class FlashAttention4:
    """flash-attn-4's forward and backward (``pip install 'oomb[fa4]'``)."""

    dtypes = (torch.bfloat16, torch.float16)

    def __init__(self, block_sparse: bool | None = None) -> None:
        """``block_sparse``: offer FA4's block sparsity for page-sparse calls (None: unless the environment
        variable named by BLOCK_SPARSE_ENV is "0")."""
        from flash_attn.cute import interface  # the CUTLASS DSL import takes a few seconds: only when asked
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        self._fa = interface
        self._sparse_tensors = BlockSparseTensorsTorch
        self._arch = torch.cuda.get_device_capability()[0]
        self._offers_block_sparse = os.environ.get(BLOCK_SPARSE_ENV) != "0" if block_sparse is None else block_sparse

    def supports_head_dims(self, head_dim: int, head_dim_v: int, grouped: bool) -> bool:
        return fa4_supports_head_dims(self._arch, head_dim, head_dim_v, grouped)

    def block_sparse_blocks(self, head_dim: int) -> tuple[int, int] | None:
        """(128, 128) on Hopper up to head_dim 128: FA4's forward tile there is 128 x 128 and its causal backward
        tile 64 x 128 (128 x 128 up to 64), so these blocks serve both (flash4_sparse's docstring). Not on
        Blackwell (its forward's two query tiles per block want q blocks of 256, unmeasured here), nor in
        deterministic mode, which FA4's SM90 block-sparse backward lacks; nor where turned off (BLOCK_SPARSE_ENV)."""
        if (not self._offers_block_sparse or self._arch != 9 or head_dim > 128
                or torch.are_deterministic_algorithms_enabled()):
            return None
        return 128, 128

    def _sparse_arguments(self, sparsity: BlockSparsity | None, direction: str) -> dict:
        """FA4's ``block_sparse_tensors`` argument of one direction ("forward" or "backward"), or nothing."""
        if sparsity is None:
            return {}
        lists: BlockLists = getattr(sparsity, direction)
        return dict(block_sparse_tensors=self._sparse_tensors(
            mask_block_cnt=lists.mask_cnt, mask_block_idx=lists.mask_idx, full_block_cnt=lists.full_cnt,
            full_block_idx=lists.full_idx, block_size=(sparsity.block_q, sparsity.block_kv)))

    @staticmethod
    def _varlen(layout: KeyLayout) -> dict:
        return dict(cu_seqlens_q=layout.cu_seqlens_q, cu_seqlens_k=layout.cu_seqlens_k,
                    max_seqlen_q=layout.max_seqlen_q, max_seqlen_k=layout.max_seqlen_k)

    def forward(self, q, k, v, *, scale, window_left, layout, block_sparse=None, causal=True):
        sparse = self._sparse_arguments(block_sparse, "forward")
        out, lse = self._fa._flash_attn_fwd(
            q, k, v, softmax_scale=scale, causal=causal, window_size_left=window_left,
            window_size_right=None if window_left is None else 0, return_lse=True, **self._varlen(layout), **sparse,
        )[:2]
        return out, lse

    def backward(self, d_out, q, k, v, out, lse, *, scale, window_left, layout, block_sparse=None, causal=True):
        # FA4's backward sums dQ (and GQA's dK/dV) with atomic adds, in no fixed order unless asked; PyTorch's
        # switch for reproducible runs asks (the Triton kernels are deterministic either way).
        sparse = self._sparse_arguments(block_sparse, "backward")
        dq, dk, dv = self._fa._flash_attn_bwd(
            q, k, v, out, d_out, lse, softmax_scale=scale, causal=causal, window_size_left=window_left,
            window_size_right=None if window_left is None else 0,
            deterministic=torch.are_deterministic_algorithms_enabled(), **self._varlen(layout), **sparse,
        )[:3]
        return dq, dk, dv


def key_range(page_table: torch.Tensor, first: int, end: int, page_size: int) -> KeyLayout:
    """Every row's keys ``first`` .. ``end`` - 1 (FA4's batched layout)."""
    tokens = torch.arange(first, end, device=page_table.device)
    page_ids = page_table[:, tokens // page_size].long().reshape(-1)
    slots = (tokens % page_size).repeat(page_table.shape[0])
    return KeyLayout(page_ids, slots, keys_per_row=end - first)


def key_segments(kv_len: int, q_len: int, page_size: int, segment: int) -> list[tuple[int, int]]:
    """The (first, end) key ranges a dense call attends one at a time: the past cut at multiples of ``segment``
    (rounded down to whole pages) up to the chunk's first key, the last range holding the rest of the past and
    the chunk. One range where no cut falls inside the past."""
    step = max(page_size, segment // page_size * page_size)
    q0 = kv_len - q_len
    cuts = list(range(step, q0 + 1, step))
    starts = [0, *cuts]
    return list(zip(starts, [*cuts, kv_len], strict=True))


def key_layout(page_table: torch.Tensor, kv_len: int, q_len: int, page_size: int, sliding_window: int | None,
               doc_start: torch.Tensor | None) -> KeyLayout:
    """The keys the chunk's queries (the newest ``q_len`` of ``kv_len``) can see, and FA4's sequences."""
    device = page_table.device
    first_key = first_visible_page(kv_len, q_len, page_size, sliding_window) * page_size
    if doc_start is None:
        return key_range(page_table, first_key, kv_len, page_size)

    # Each row's documents in the chunk: where doc_start changes. One host transfer per call.
    starts = doc_start.to(torch.int64)
    new_doc = torch.ones_like(starts, dtype=torch.bool)
    new_doc[:, 1:] = starts[:, 1:] != starts[:, :-1]
    rows, cols = new_doc.nonzero(as_tuple=True)
    found = torch.stack([rows, cols, starts[rows, cols]]).tolist()
    q0 = kv_len - q_len
    cu_q, cu_k, tokens = [0], [0], []
    max_q = max_k = 0
    for i, (row, col, doc) in enumerate(zip(*found, strict=True)):
        last = i + 1 == len(found[0]) or found[0][i + 1] != row
        end = q_len if last else found[1][i + 1]  # the document's last query in the chunk, plus one
        key0 = max(doc, first_key)  # a window may hide the document's first keys
        n_q, n_k = end - col, q0 + end - key0
        cu_q.append(row * q_len + end)
        cu_k.append(cu_k[-1] + n_k)
        max_q, max_k = max(max_q, n_q), max(max_k, n_k)
        tokens.append(torch.arange(key0, q0 + end, device=device) + row * kv_len)
    flat = torch.cat(tokens)  # row * kv_len + position
    row_of, pos = flat // kv_len, flat % kv_len
    page_ids = page_table[row_of, pos // page_size].long()

    def as_tensor(x):
        return torch.tensor(x, dtype=torch.int32, device=device)

    return KeyLayout(page_ids, pos % page_size, cu_seqlens_q=as_tensor(cu_q), cu_seqlens_k=as_tensor(cu_k),
                     max_seqlen_q=max_q, max_seqlen_k=max_k)


def _words(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` with each head's values viewed as 8-byte words where they divide evenly. PyTorch's indexing
    kernels move one element per thread step: a bf16 head of 128 values moves in 32 steps instead of 128 (the
    gather and scatter took 0.28 s of a 64K step of Qwen2.5-7B on an H200 when moved as bf16)."""
    if pool.element_size() >= 8 or pool.shape[-1] * pool.element_size() % 8:
        return pool
    try:
        return pool.view(torch.int64)
    except RuntimeError:  # a view whose strides or offset do not divide into words
        return pool


def _gather(pool: torch.Tensor, layout: KeyLayout, rows: int) -> torch.Tensor:
    """[T, H_kv, D] (varlen) or [B, S, H_kv, D] of the pool's tokens the layout names."""
    x = _words(pool)[layout.page_ids, :, layout.slots].view(pool.dtype)
    return x if layout.varlen else x.view(rows, layout.keys_per_row, *x.shape[1:])


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """A float32 (or float64) copy of ``x`` to accumulate segments in: never ``x`` itself, which is added to."""
    return x.to(torch.promote_types(x.dtype, torch.float32), copy=True)


def _add_at(pool: torch.Tensor, layout: KeyLayout, grad: torch.Tensor) -> None:
    """Adds ``grad`` (the gathered keys' gradients, any leading shape) into the pool's tokens the layout names, by
    gathering, adding and writing back: each key a query sees is named once (KeyLayout), and the keys that share
    a place (page-sparse padding in a store's row for pages it does not hold) carry zero gradients to a row that
    nothing reads back. An accumulating put would sort every index first (about 0.28 ms a call in a 32K-token
    step on an H100)."""
    words = _words(pool)
    where = (layout.page_ids, slice(None), layout.slots)
    gathered = words[where].view(pool.dtype)
    gathered += grad.reshape(-1, *grad.shape[-2:]).to(pool.dtype)
    words[where] = gathered.view(words.dtype)


def backward_workspace_bytes(batch: int, keys: int, kv_heads: int, head_dim: int, itemsize: int,
                             merged_queries: int = 0) -> int:
    """What a backward call holds beside the layer's own tensors, for the memory plan: ``keys`` keys (at most
    KEY_SEGMENT of the past and the chunk; a page-sparse call: the pages its lists name and the chunk) gathered
    out of the pages, K and V, their dK and dV, and float32 dK/dV accumulators (GQA): 8 copies of
    [keys, H_kv, D] in 16-bit units; a segmented past adds the merged output and dQ of ``merged_queries``
    query rows (query heads x tokens) in float32."""
    return 8 * batch * keys * kv_heads * head_dim * itemsize + 2 * merged_queries * head_dim * 4


class Flash4Attention:
    """The ``fa4`` backend's forward and backward over the paged store (signatures of kernels/reference.py)."""

    def __init__(self, kernels: FlashKernels, fallback, key_segment: int = KEY_SEGMENT) -> None:
        self.kernels = kernels
        self.fallback = fallback  # an AttentionBackend: what FA4 cannot express
        self.key_segment = key_segment  # keys of the past one dense call gathers at a time (module docstring)
        # A selection's chosen pages (flash4_sparse.chosen_pages), kept for the next calls of the same selection: a
        # layer's forward and backward in stage 2 read the same page lists, and each recomputation costs the host
        # a dozen kernel launches. Keyed by the selection tensor's identity, checked through a weak reference (a
        # freed selection's id may be reused), and by the past's length and the union's bound.
        self._chosen: collections.OrderedDict = collections.OrderedDict()

    _CHOSEN_KEPT = 64  # selections whose chosen pages are kept (a chunk's layers, with room)

    def _chosen_pages(self, page_select: torch.Tensor, n_past: int, page_union: int | None):
        key = (id(page_select), n_past, page_union)
        kept = self._chosen.get(key)
        if kept is not None and kept[0]() is page_select and kept[1] == page_select._version:
            self._chosen.move_to_end(key)
            return kept[2]
        chosen = flash4_sparse.chosen_pages(page_select, n_past, page_union)
        self._chosen[key] = (weakref.ref(page_select), page_select._version, chosen)
        while len(self._chosen) > self._CHOSEN_KEPT:
            self._chosen.popitem(last=False)
        return chosen

    def expresses(self, q: torch.Tensor, k_pool: torch.Tensor, *, sinks=None, sliding_window=None, doc_start=None,
                  page_select=None, select_block=None, v_pool: torch.Tensor | None = None) -> bool:
        """Whether FA4 runs this call; from its arguments alone, so forward and backward agree. ``v_pool``: for the
        value head size (None: the key head size)."""
        head_dim_v = q.shape[-1] if v_pool is None else v_pool.shape[-1]
        return (sinks is None and q.dtype in self.kernels.dtypes
                and self.kernels.supports_head_dims(q.shape[-1], head_dim_v, grouped=q.shape[1] != k_pool.shape[1])
                and (page_select is None
                     or self._sparse_blocks(q, k_pool, sliding_window, doc_start, select_block, head_dim_v)
                     is not None))

    def _sparse_blocks(self, q, k_pool, sliding_window, doc_start, select_block,
                       head_dim_v: int | None = None) -> tuple[int, int] | None:
        """FA4's (query, key) blocks for a page-sparse call, or None where its block sparsity cannot express it:
        kernels without it, documents (FA4 has no varlen block-sparse backward), a window (the Triton kernels
        refuse it with a selection too), pages of another size than its key block, and selection blocks that
        split one of its query blocks between two page lists. Asked with the wider head size: FA4's tiles grow
        with either."""
        offered = getattr(self.kernels, "block_sparse_blocks", None)  # absent on kernels objects before it
        head_dim = max(q.shape[-1], q.shape[-1] if head_dim_v is None else head_dim_v)
        blocks = offered(head_dim) if offered is not None else None
        if blocks is None or sliding_window is not None or doc_start is not None or not select_block:
            return None
        block_q, block_kv = blocks
        one_list = select_block >= q.shape[2]
        if k_pool.shape[2] != block_kv or (select_block % block_q and not one_list):
            return None
        return blocks

    def _prepare(self, q, k_pool, page_table, kv_len, sliding_window, doc_start, page_select, select_block,
                 direction: str, page_union: int | None = None):
        """(the keys to gather, FA4's left window, the block pairs of a page-sparse call for ``direction``
        ("forward" or "backward") or None)."""
        _, h, c, _ = q.shape
        page_size = k_pool.shape[2]
        window_left = None if sliding_window is None else min(sliding_window, kv_len + 1) - 1
        if page_select is None:
            return key_layout(page_table, kv_len, c, page_size, sliding_window, doc_start), window_left, None
        block_q, _ = self._sparse_blocks(q, k_pool, sliding_window, doc_start, select_block)
        chosen = self._chosen_pages(page_select, (kv_len - c) // page_size, page_union)
        keys = page_sparse_keys(page_table, kv_len, c, page_size, page_select, select_block, block_q, h,
                                directions=(direction,), page_union=page_union, chosen=chosen)
        layout = KeyLayout(keys.page_ids, keys.slots, keys_per_row=keys.keys_per_row)
        return layout, window_left, keys.sparsity

    @staticmethod
    def _queries(x: torch.Tensor, layout: KeyLayout) -> torch.Tensor:
        """[B, H, C, D] -> FA4's [B, C, H, D], or [B * C, H, D] for variable lengths."""
        x = x.transpose(1, 2)
        return x.reshape(-1, *x.shape[2:]) if layout.varlen else x

    @staticmethod
    def _heads_first(x: torch.Tensor, b: int, layout: KeyLayout) -> torch.Tensor:
        """FA4's [B, C, H, D] / [B * C, H, D] -> [B, H, C, D] (a view)."""
        if layout.varlen:
            x = x.view(b, -1, *x.shape[1:])
        return x.transpose(1, 2)

    @staticmethod
    def _check(q, k_pool, page_table, kv_len, *, sliding_window, doc_start, page_select, select_block,
               v_pool=None) -> None:
        _, h_kv, page_size, _ = k_pool.shape
        check_paged_args(q, k_pool, page_table, kv_len, sliding_window, v_pool)
        check_visibility_args(q, h_kv, kv_len, page_size, doc_start, page_select, select_block)

    def _segments(self, k_pool, page_table, kv_len, q_len, *, sliding_window, doc_start, page_select,
                  select_block) -> list[tuple[KeyLayout, bool]] | None:
        """A dense call's key segments with their causal flag (module docstring), or None: one call. Documents
        (FA4's variable lengths), windows and page selections bound their keys already."""
        if sliding_window is not None or doc_start is not None or page_select is not None:
            return None
        page_size = k_pool.shape[2]
        ranges = key_segments(kv_len, q_len, page_size, self.key_segment)
        if len(ranges) == 1:
            return None
        return [(key_range(page_table, first, end, page_size), end == kv_len) for first, end in ranges]

    def _segmented_forward(self, q, k_pool, v_pool, segments, scale):
        """Each segment attended alone; outputs merged by log-sum-exp in float32, one segment alive at a time."""
        b = q.shape[0]
        queries = q.transpose(1, 2)
        acc = lse = None
        for layout, causal in segments:
            out, part = self.kernels.forward(queries, _gather(k_pool, layout, b), _gather(v_pool, layout, b),
                                             scale=scale, window_left=None, layout=layout, causal=causal)
            if acc is None:
                acc, lse = _at_least_float32(out), part
                continue
            merged = torch.logaddexp(lse, part)  # [B, H, C]; each weight below [B, C, H, 1] like FA4's out
            acc.mul_(torch.exp(lse - merged).transpose(1, 2).unsqueeze(-1))
            acc.add_(_at_least_float32(out).mul_(torch.exp(part - merged).transpose(1, 2).unsqueeze(-1)))
            lse = merged
        return acc.to(q.dtype).transpose(1, 2), lse

    def forward(self, q, k_pool, v_pool, page_table, kv_len, *, scale, sliding_window=None, sinks=None,
                doc_start=None, page_select=None, select_block=None, block_tokens=None, page_union=None):
        """Returns (out [B, H, C, Dv] in q.dtype, lse [B, H, C] float32). ``page_union``: the most distinct past
        pages one row's lists name where fewer than their entries (a chunk's cap): a page-sparse call gathers no
        more."""
        visibility = dict(sliding_window=sliding_window, doc_start=doc_start, page_select=page_select,
                          select_block=select_block)
        if not self.expresses(q, k_pool, sinks=sinks, v_pool=v_pool, **visibility):
            return self.fallback.forward(q, k_pool, v_pool, page_table, kv_len, scale=scale, sinks=sinks,
                                         **visibility)
        self._check(q, k_pool, page_table, kv_len, v_pool=v_pool, **visibility)
        b, h, c, _ = q.shape
        if segments := self._segments(k_pool, page_table, kv_len, c, **visibility):
            return self._segmented_forward(q, k_pool, v_pool, segments, scale)
        layout, window_left, sparsity = self._prepare(q, k_pool, page_table, kv_len, sliding_window, doc_start,
                                                      page_select, select_block, "forward", page_union)
        sparse = {} if sparsity is None else dict(block_sparse=sparsity)  # kernels before it take no such argument
        out, lse = self.kernels.forward(self._queries(q, layout), _gather(k_pool, layout, b),
                                        _gather(v_pool, layout, b), scale=scale, window_left=window_left,
                                        layout=layout, **sparse)
        if layout.varlen:  # [H, B * C] -> [B, H, C]
            lse = lse.view(h, b, c).transpose(0, 1)
        return self._heads_first(out, b, layout), lse

    def backward(self, d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, page_table, kv_len, *, scale,
                 sliding_window=None, sinks=None, doc_start=None, page_select=None, select_block=None,
                 block_tokens=None, page_union=None):
        """Adds dK/dV of every visible key into dk_pool/dv_pool; returns (dq [B, H, C, Dk], None)."""
        visibility = dict(sliding_window=sliding_window, doc_start=doc_start, page_select=page_select,
                          select_block=select_block)
        if not self.expresses(q, k_pool, sinks=sinks, v_pool=v_pool, **visibility):
            return self.fallback.backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, page_table, kv_len,
                                          scale=scale, sinks=sinks, **visibility)
        self._check(q, k_pool, page_table, kv_len, v_pool=v_pool, **visibility)
        check_backward_args(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool)
        if segments := self._segments(k_pool, page_table, kv_len, q.shape[2], **visibility):
            return self._segmented_backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, segments, scale)
        layout, window_left, sparsity = self._prepare(q, k_pool, page_table, kv_len, sliding_window, doc_start,
                                                      page_select, select_block, "backward", page_union)
        b, h, c, _ = q.shape
        if layout.varlen:  # [B, H, C] -> [H, B * C]
            lse = lse.transpose(0, 1).reshape(h, b * c)
        sparse = {} if sparsity is None else dict(block_sparse=sparsity)
        dq, dk, dv = self.kernels.backward(
            self._queries(d_out, layout), self._queries(q, layout), _gather(k_pool, layout, b),
            _gather(v_pool, layout, b), self._queries(out, layout), lse.contiguous(), scale=scale,
            window_left=window_left, layout=layout, **sparse,
        )
        _add_at(dk_pool, layout, dk)
        _add_at(dv_pool, layout, dv)
        return self._heads_first(dq, b, layout), None

    def _segmented_backward(self, d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, segments, scale):
        """Each segment's backward against the whole call's out and lse: its dK/dV added into the pages, its dQ
        summed in float32."""
        b = q.shape[0]
        queries, grads, outs, lse = q.transpose(1, 2), d_out.transpose(1, 2), out.transpose(1, 2), lse.contiguous()
        dq = None
        for layout, causal in segments:
            part, dk, dv = self.kernels.backward(grads, queries, _gather(k_pool, layout, b),
                                                 _gather(v_pool, layout, b), outs, lse, scale=scale,
                                                 window_left=None, layout=layout, causal=causal)
            _add_at(dk_pool, layout, dk)
            _add_at(dv_pool, layout, dv)
            dq = _at_least_float32(part) if dq is None else dq.add_(part)
        return dq.to(q.dtype).transpose(1, 2), None
