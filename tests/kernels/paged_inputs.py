"""Random paged-attention problems and a dense float64 oracle, shared by kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedProblem:
    q: torch.Tensor  # [B, H, C, D]
    k: torch.Tensor  # [B, H_kv, kv_len, D] dense keys
    v: torch.Tensor  # [B, H_kv, kv_len, D]
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    page_table: torch.Tensor  # [B, n_pages] int32, shuffled ids
    kv_len: int
    sinks: torch.Tensor | None


def make_problem(b, h, h_kv, c, kv_len, d, page_size, *, dtype=torch.float32, device="cpu", sinks=False,
                 spare_pages=3) -> PagedProblem:
    n_pages = -(-kv_len // page_size)
    total = b * n_pages + spare_pages  # spare pages that no table row uses must stay untouched
    perm = torch.randperm(total, device=device)[: b * n_pages].to(torch.int32)
    page_table = perm.view(b, n_pages)
    q = torch.randn(b, h, c, d, device=device, dtype=dtype)
    k = torch.randn(b, h_kv, kv_len, d, device=device, dtype=dtype)
    v = torch.randn(b, h_kv, kv_len, d, device=device, dtype=dtype)
    k_pool = torch.randn(total, h_kv, page_size, d, device=device, dtype=dtype)  # garbage where unused
    v_pool = torch.randn(total, h_kv, page_size, d, device=device, dtype=dtype)
    for bi in range(b):
        for p in range(n_pages):
            lo, hi = p * page_size, min((p + 1) * page_size, kv_len)
            k_pool[page_table[bi, p], :, : hi - lo] = k[bi, :, lo:hi]
            v_pool[page_table[bi, p], :, : hi - lo] = v[bi, :, lo:hi]
    s = torch.randn(h, device=device, dtype=dtype) if sinks else None
    return PagedProblem(q, k, v, k_pool, v_pool, page_table, kv_len, s)


def dense_attention(q, k, v, kv_len, *, scale, sliding_window=None, sinks=None):
    """Float64 causal attention of the last C positions over all kv_len keys (autograd-friendly)."""
    b, h, c, d = q.shape
    g = h // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    qi = torch.arange(kv_len - c, kv_len, device=q.device)[:, None]
    kj = torch.arange(kv_len, device=q.device)[None, :]
    visible = kj <= qi
    if sliding_window is not None:
        visible &= (qi - kj) < sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, h, 1, 1).expand(b, h, c, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse
