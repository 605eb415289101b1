"""FlashAttention-4's two calls in PyTorch, with its semantics, so the ``fa4`` backend's gathering of
pages, packing of documents and scattering of gradients can be checked on CPU.

Layouts as FA4's: q [B, C, H, Dk] with k [B, S, H_kv, Dk] and v [B, S, H_kv, Dv], or variable lengths
q [T_q, H, Dk] with k [T_k, H_kv, Dk], v [T_k, H_kv, Dv] and cu_seqlens; out with Dv; lse [B, H, C] or
[H, T_q]. Head sizes are checked as flash-attn-4 4.0.0b40 checks them on Hopper (``_fa4_head_dims``), so
a call the backend should have handed to its fallback fails here. Causal aligned bottom-right in each
sequence; ``window_left`` keys before each query's own position stay visible (None: all); with
``causal=False`` every key. The backward computes from the out and lse it is given, as FA4's does.

Block sparsity (``block_sparse``, oomb.kernels.flash4_sparse.BlockSparsity) as FA4 reads it: a query
sees only keys of the blocks its query block lists, its mask blocks under the causal mask, its full
blocks whole. That is stricter than FA4 on SM90/SM100, which masks full blocks causally too, so a
block across the diagonal listed as full fails here. The lists are checked as FA4 needs them (int32,
broadcastable batch and head dims, ascending, in range, no block in both lists). The backward reads
its own, transposed lists and, like FA4, the forward's lse and out: lists that disagree with the
forward's show up as wrong gradients.
"""

from __future__ import annotations

import torch

from oomb.kernels import flash4_calls, reference


def _causal(c, s, window_left, causal=True):
    """[C, S] bool: bottom-right causal (the last query sees the last key), within the left window; every key
    where not ``causal``."""
    if not causal:
        assert window_left is None, "oomb calls FA4 without the causal mask only on whole segments, no window"
        return torch.ones(c, s, dtype=torch.bool)
    qi = torch.arange(c)[:, None] + (s - c)
    kj = torch.arange(s)[None, :]
    visible = kj <= qi
    if window_left is not None:
        visible &= kj >= qi - window_left
    return visible


def _listed(lists, b, h, n_rows, n_cols):
    """(mask, full) [n_rows, n_cols] bool: the blocks row b, query head h lists, checked as FA4 needs them."""
    found = []
    for cnt, idx in ((lists.mask_cnt, lists.mask_idx), (lists.full_cnt, lists.full_idx)):
        assert cnt.dtype == idx.dtype == torch.int32, "FA4 takes int32 block lists"
        assert cnt.dim() == 3 and idx.dim() == 4 and cnt.shape[2] == idx.shape[2] == n_rows, (cnt.shape, n_rows)
        assert 1 <= idx.shape[3] <= n_cols, f"a list's width {idx.shape[3]} is not in 1..{n_cols}"
        cnt = cnt[b if cnt.shape[0] > 1 else 0, h if cnt.shape[1] > 1 else 0]
        idx = idx[b if idx.shape[0] > 1 else 0, h if idx.shape[1] > 1 else 0]
        bits = torch.zeros(n_rows, n_cols, dtype=torch.bool)
        for r in range(n_rows):
            assert 0 <= cnt[r] <= idx.shape[1], f"count {int(cnt[r])} beyond the list's width {idx.shape[1]}"
            entries = idx[r, : cnt[r]].tolist()
            assert entries == sorted(set(entries)), f"entries must ascend, distinct: {entries}"
            assert all(0 <= e < n_cols for e in entries), f"entries out of 0..{n_cols - 1}: {entries}"
            bits[r, entries] = True
        found.append(bits)
    assert not (found[0] & found[1]).any(), "a block in both lists would be visited twice"
    return found


def _check_dims(lists, batch, heads):
    for t in (lists.mask_cnt, lists.mask_idx, lists.full_cnt, lists.full_idx):
        assert t.shape[0] in (1, batch) and t.shape[1] in (1, heads), f"dims {tuple(t.shape[:2])} vs ({batch}, {heads})"


def _sparse_visible(sparsity, b, heads, c, s, backward):
    """[H, C, S] bool: the keys each query sees under the forward's (or the backward's) lists of row b."""
    bq, bkv = sparsity.block_q, sparsity.block_kv
    n_q, n_k = -(-c // bq), -(-s // bkv)
    lists = sparsity.backward if backward else sparsity.forward
    causal = _causal(c, s, None)
    visible = []
    for h in range(heads):
        mask, full = _listed(lists, b, h, n_k, n_q) if backward else _listed(lists, b, h, n_q, n_k)
        if backward:
            mask, full = mask.T, full.T

        def tokens(blocks):
            return blocks.repeat_interleave(bq, 0)[:c].repeat_interleave(bkv, 1)[:, :s]

        visible.append(tokens(full) | (tokens(mask) & causal))
    return torch.stack(visible)


def _one_sequence(q, k, v, scale, window_left, visible=None):
    """q [C, H, D], k/v [S, H_kv, D] -> out [C, H, D], lse [H, C]. ``visible`` [H, C, S] replaces the causal mask."""
    c, h, _ = q.shape
    s = k.shape[0]
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("chd,shd->hcs", q, k) * scale
    if visible is None:
        visible = _causal(c, s, window_left)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.softmax(scores, dim=-1).nan_to_num()  # a query with no key: out 0, lse -inf, as FA4's
    out = torch.einsum("hcs,shd->chd", p, v)
    return out, lse


def _grads(d_out, q, k, v, out, lse, scale, visible):
    """One sequence's dq [C, H, D], dk/dv [S, H_kv, D] from the forward's lse and out, as FA4's backward computes
    them: a call given only some of the keys gets their share of the whole softmax's gradients."""
    h, h_kv = q.shape[1], k.shape[1]
    g = h // h_kv
    kg, vg = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("chd,shd->hcs", q, kg) * scale
    p = torch.exp(scores - lse[..., None]).masked_fill(~visible, 0.0)
    delta = (d_out * out).sum(-1).T  # [H, C] = rowsum(dO * O)
    dp = torch.einsum("chd,shd->hcs", d_out, vg)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("hcs,shd->chd", ds, kg) * scale
    dk = torch.einsum("hcs,chd->shd", ds, q) * scale
    dv = torch.einsum("hcs,chd->shd", p, d_out)

    def per_kv_head(x):  # [S, H, D] -> [S, H_kv, D]: query head h reads KV head h // g
        return x.view(x.shape[0], h_kv, g, x.shape[-1]).sum(2)

    return dq, per_kv_head(dk), per_kv_head(dv)


def _sequences(q, k, layout):
    """(query rows, key rows) of each of FA4's sequences: rows of the batched layout, or cu_seqlens' ranges."""
    if not layout.varlen:
        return [((b,), (b,)) for b in range(q.shape[0])]
    cu_q, cu_k = layout.cu_seqlens_q.tolist(), layout.cu_seqlens_k.tolist()
    assert max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False)) <= layout.max_seqlen_q
    assert max(b - a for a, b in zip(cu_k, cu_k[1:], strict=False)) <= layout.max_seqlen_k
    assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0], "sequences must cover q and k back to back"
    return [((slice(cu_q[i], cu_q[i + 1]),), (slice(cu_k[i], cu_k[i + 1]),)) for i in range(len(cu_q) - 1)]


def _visible(q, k, layout, window_left, causal, block_sparse, backward):
    """[H, C, S] bool of each sequence: what its queries see (the block lists' pairs, or the causal mask)."""
    if block_sparse is not None:
        assert not layout.varlen and window_left is None and causal, \
            "oomb passes block sparsity with FA4's batched layout only, causal, no window"
        _check_dims(block_sparse.backward if backward else block_sparse.forward, q.shape[0], q.shape[2])
        return [_sparse_visible(block_sparse, b, q.shape[2], q.shape[1], k.shape[1], backward)
                for b in range(q.shape[0])]
    assert causal or not layout.varlen, "oomb calls FA4 without the causal mask only in the batched layout"
    return [_causal(q[qi].shape[0], k[ki].shape[0], window_left, causal).expand(q.shape[-2], -1, -1)
            for qi, ki in _sequences(q, k, layout)]


def _attend(q, k, v, scale, window_left, layout, block_sparse=None, causal=True):
    seqs = _sequences(q, k, layout)
    visible = _visible(q, k, layout, window_left, causal, block_sparse, backward=False)
    outs, lses = zip(*(_one_sequence(q[qi], k[ki], v[ki], scale, window_left, vis)
                       for (qi, ki), vis in zip(seqs, visible, strict=True)), strict=True)
    if not layout.varlen:
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _fa4_head_dims(q, k, v, backward):
    """The head-size checks of flash-attn-4 4.0.0b40 on Hopper (SM90), as its source has them: both sizes 8..256 and
    multiples of 8 (interface.py:134-146), and in the backward, with more query heads than KV heads, equal sizes
    (flash_bwd_sm90.py:122-123)."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    assert k.shape[-1] == head_dim, "q and k must share their head size"
    assert 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256 and head_dim % 8 == 0 and head_dim_v % 8 == 0, (
        f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on SM90")
    if backward and q.shape[-2] > k.shape[-2]:
        assert head_dim == head_dim_v, "GQA backward requires head_dim == head_dim_v"


class TorchFlash:
    """The stand-in: float32/float64 like the reference, so agreement is checked to 1e-10 in float64. It is FA4 on
    Hopper for head sizes: it answers ``supports_head_dims`` as the ``fa4`` backend's FlashAttention4 does there,
    and its calls check the sizes as FA4's do.

    ``sparse_blocks``: the (query, key) block sizes its block sparsity offers (None: none, as a kernels object
    from before block sparsity, which the backend must never hand a page selection)."""

    dtypes = (torch.float32, torch.float64)

    # FA4 b40 itself takes sizes from 8; oomb hands it 64 and up (flash4_calls.FA4_MIN_HEAD_DIM). The stand-in runs
    # the wrapper at tiny sizes (8 and up); tests/kernels/test_head_sizes.py checks oomb's minimum.
    min_head_dim = 8

    def __init__(self, sparse_blocks: tuple[int, int] | None = None):
        self.calls = 0
        self.sparse_blocks = sparse_blocks
        self.sparse_calls = 0

    def supports_head_dims(self, head_dim, head_dim_v, grouped):
        return flash4_calls.fa4_supports_head_dims(9, head_dim, head_dim_v, grouped, min_head_dim=self.min_head_dim)

    def block_sparse_blocks(self, head_dim):
        return self.sparse_blocks

    def _count(self, block_sparse):
        self.calls += 1
        if block_sparse is not None:
            assert (block_sparse.block_q, block_sparse.block_kv) == self.sparse_blocks, "blocks it does not offer"
            self.sparse_calls += 1

    def forward(self, q, k, v, *, scale, window_left, layout, block_sparse=None, causal=True):
        self._count(block_sparse)
        _fa4_head_dims(q, k, v, backward=False)
        return _attend(q, k, v, scale, window_left, layout, block_sparse, causal)

    def backward(self, d_out, q, k, v, out, lse, *, scale, window_left, layout, block_sparse=None, causal=True):
        # As FA4's: from the given out and lse (a segment's share of a softmax over more keys than it is given).
        self._count(block_sparse)
        _fa4_head_dims(q, k, v, backward=True)
        seqs = _sequences(q, k, layout)
        visible = _visible(q, k, layout, window_left, causal, block_sparse, backward=True)
        lse_of = (lambda qi: lse[qi]) if not layout.varlen else (lambda qi: lse[:, qi[0]])
        grads = [_grads(d_out[qi], q[qi], k[ki], v[ki], out[qi], lse_of(qi), scale, vis)
                 for (qi, ki), vis in zip(seqs, visible, strict=True)]
        dq, dk, dv = zip(*grads, strict=True)
        join = torch.stack if not layout.varlen else torch.cat
        return join(dq), join(dk), join(dv)


class FallbackSpy:
    """The fa4 backend's fallback (the reference backend) that records which directions were handed to it."""

    def __init__(self):
        self.calls = []

    def forward(self, *args, **kw):
        self.calls.append("forward")
        return reference.paged_attention_forward(*args, **kw)

    def backward(self, *args, **kw):
        self.calls.append("backward")
        return reference.paged_attention_backward(*args, **kw)
