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
fallback backend (the Triton kernels on a GPU): 32-bit inputs, head sizes FA4
lacks (``fa4_supports_head_dims``: on Hopper, sizes off multiples of 8, below 64 or above 256, and key and
value sizes that differ under GQA), and selections with documents, a window, or pages and selection
blocks off FA4's blocks. The choice depends only on the call's arguments, which forward and backward
share, so an output and its gradient always come from the same kernels.

Per-head sinks (GPT-OSS) join the softmax outside FA4, in every kind of call alike: FA4 attends the keys,
then the sink's share of the denominator is folded into the output and the log-sum-exp (out * e^(lse - lse'),
lse' = log(e^lse + e^sink)). FA4's backward from that out and lse is the backward of attention with the sink
(its probabilities are e^(s - lse'), its row term dO.out), and the sink's own gradient is
-sum e^(sink - lse') dO.out over the queries, a few elementwise operations on the chunk's output.

The kernels are an object with ``forward``/``backward`` (``FlashAttention4`` wraps
flash-attn-4's functions); tests give a PyTorch stand-in with FA4's semantics to check the
gathering, packing and scattering on CPU against the reference backend.
"""

from __future__ import annotations

import collections
import weakref

import torch

from oomb.cache.layout import first_visible_page
from oomb.kernels import flash4_sparse
from oomb.kernels.flash4_calls import FlashKernels, KeyLayout
from oomb.kernels.flash4_sparse import page_sparse_keys
from oomb.kernels.reference import check_backward_args, check_paged_args, check_visibility_args

# Keys of the past one dense call gathers at a time (module docstring): 2 GiB of Qwen2.5-7B's gathered keys,
# values and their gradients. Contexts up to 256K (all the measured steps of docs/benchmarks.md) run in one call.
KEY_SEGMENT = 262144


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


def _fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention over the keys -> with each query head's sink logit in the denominator (module
    docstring): out [B, H, C, Dv] scaled in float32 or wider, lse [B, H, C]."""
    with_sink = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return _at_least_float32(out).mul_(torch.exp(lse - with_sink).unsqueeze(-1)), with_sink


def _sink_gradient(d_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [H] (float32, or float64 for float64 inputs): -sum over rows and queries of the sink's
    probability e^(sink - lse) times the row term dO.out."""
    wide = torch.promote_types(out.dtype, torch.float32)
    delta = (d_out.to(wide) * out.to(wide)).sum(-1)  # [B, H, C]
    p_sink = torch.exp(sinks.to(wide).view(1, -1, 1) - lse.to(wide))
    return -(p_sink * delta).sum(dim=(0, 2))


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
        value head size (None: the key head size). Sinks never keep a call from FA4 (module docstring)."""
        head_dim_v = q.shape[-1] if v_pool is None else v_pool.shape[-1]
        return (q.dtype in self.kernels.dtypes
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
        return acc.transpose(1, 2), lse

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
            out, lse = self._segmented_forward(q, k_pool, v_pool, segments, scale)  # out in float32
        else:
            layout, window_left, sparsity = self._prepare(q, k_pool, page_table, kv_len, sliding_window, doc_start,
                                                          page_select, select_block, "forward", page_union)
            sparse = {} if sparsity is None else dict(block_sparse=sparsity)  # kernels before it take no such argument
            out, lse = self.kernels.forward(self._queries(q, layout), _gather(k_pool, layout, b),
                                            _gather(v_pool, layout, b), scale=scale, window_left=window_left,
                                            layout=layout, **sparse)
            if layout.varlen:  # [H, B * C] -> [B, H, C]
                lse = lse.view(h, b, c).transpose(0, 1)
            out = self._heads_first(out, b, layout)
        if sinks is not None:
            out, lse = _fold_sinks(out, lse, sinks)
        return out.to(q.dtype), lse

    def backward(self, d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, page_table, kv_len, *, scale,
                 sliding_window=None, sinks=None, doc_start=None, page_select=None, select_block=None,
                 block_tokens=None, page_union=None):
        """Adds dK/dV of every visible key into dk_pool/dv_pool; returns (dq [B, H, C, Dk], d_sinks [H] float32 or
        None). ``out`` and ``lse`` are the forward's, sinks folded in."""
        visibility = dict(sliding_window=sliding_window, doc_start=doc_start, page_select=page_select,
                          select_block=select_block)
        if not self.expresses(q, k_pool, sinks=sinks, v_pool=v_pool, **visibility):
            return self.fallback.backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, page_table, kv_len,
                                          scale=scale, sinks=sinks, **visibility)
        self._check(q, k_pool, page_table, kv_len, v_pool=v_pool, **visibility)
        check_backward_args(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool)
        d_sinks = None if sinks is None else _sink_gradient(d_out, out, lse, sinks)
        if segments := self._segments(k_pool, page_table, kv_len, q.shape[2], **visibility):
            dq = self._segmented_backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, segments, scale)
            return dq, d_sinks
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
        return self._heads_first(dq, b, layout), d_sinks

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
        return dq.to(q.dtype).transpose(1, 2)
