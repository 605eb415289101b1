"""FlashAttention-4's two calls in PyTorch, with its semantics, so the ``fa4`` backend's gathering of
pages, packing of documents and scattering of gradients can be checked on CPU.

Layouts as FA4's: q [B, C, H, D] with k/v [B, S, H_kv, D], or variable lengths q [T_q, H, D] with
k/v [T_k, H_kv, D] and cu_seqlens; lse [B, H, C] or [H, T_q]. Causal aligned bottom-right in each
sequence; ``window_left`` keys before each query's own position stay visible (None: all).
"""

from __future__ import annotations

import torch


def _one_sequence(q, k, v, scale, window_left):
    """q [C, H, D], k/v [S, H_kv, D] -> out [C, H, D], lse [H, C]."""
    c, h, _ = q.shape
    s = k.shape[0]
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("chd,shd->hcs", q, k) * scale
    qi = torch.arange(c)[:, None] + (s - c)  # bottom-right: the last query sees the last key
    kj = torch.arange(s)[None, :]
    visible = kj <= qi
    if window_left is not None:
        visible &= kj >= qi - window_left
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hcs,shd->chd", torch.softmax(scores, dim=-1), v)
    return out, lse


def _attend(q, k, v, scale, window_left, layout):
    if not layout.varlen:
        outs, lses = zip(*(_one_sequence(q[b], k[b], v[b], scale, window_left) for b in range(q.shape[0])),
                         strict=True)
        return torch.stack(outs), torch.stack(lses)
    cu_q, cu_k = layout.cu_seqlens_q.tolist(), layout.cu_seqlens_k.tolist()
    assert max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False)) <= layout.max_seqlen_q
    assert max(b - a for a, b in zip(cu_k, cu_k[1:], strict=False)) <= layout.max_seqlen_k
    assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0], "sequences must cover q and k back to back"
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        o, lse = _one_sequence(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]], scale,
                               window_left)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


class TorchFlash:
    """The stand-in: float32/float64 like the reference, so agreement is checked to 1e-10 in float64."""

    dtypes = (torch.float32, torch.float64)

    def __init__(self):
        self.calls = 0

    def supports_head_dim(self, head_dim):
        return True

    def forward(self, q, k, v, *, scale, window_left, layout):
        self.calls += 1
        return _attend(q, k, v, scale, window_left, layout)

    def backward(self, d_out, q, k, v, out, lse, *, scale, window_left, layout):
        self.calls += 1
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        with torch.enable_grad():
            o, _ = _attend(q, k, v, scale, window_left, layout)
            return torch.autograd.grad(o, (q, k, v), d_out)
