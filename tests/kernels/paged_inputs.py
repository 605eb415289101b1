"""Random paged-attention problems and a dense float64 oracle, shared by kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedProblem:
    q: torch.Tensor  # [B, H, C, Dk]
    k: torch.Tensor  # [B, H_kv, kv_len, Dk] dense keys
    v: torch.Tensor  # [B, H_kv, kv_len, Dv]
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    page_table: torch.Tensor  # [B, n_pages] int32, shuffled ids
    kv_len: int
    sinks: torch.Tensor | None


def make_problem(b, h, h_kv, c, kv_len, d, page_size, *, dtype=torch.float32, device="cpu", sinks=False,
                 spare_pages=3, d_v=None) -> PagedProblem:
    """``d``: the key head size Dk; ``d_v``: the value head size Dv (None: d)."""
    d_v = d if d_v is None else d_v
    n_pages = -(-kv_len // page_size)
    total = b * n_pages + spare_pages  # spare pages that no table row uses must stay untouched
    perm = torch.randperm(total, device=device)[: b * n_pages].to(torch.int32)
    page_table = perm.view(b, n_pages)
    q = torch.randn(b, h, c, d, device=device, dtype=dtype)
    k = torch.randn(b, h_kv, kv_len, d, device=device, dtype=dtype)
    v = torch.randn(b, h_kv, kv_len, d_v, device=device, dtype=dtype)
    k_pool = torch.randn(total, h_kv, page_size, d, device=device, dtype=dtype)  # garbage where unused
    v_pool = torch.randn(total, h_kv, page_size, d_v, device=device, dtype=dtype)
    for bi in range(b):
        for p in range(n_pages):
            lo, hi = p * page_size, min((p + 1) * page_size, kv_len)
            k_pool[page_table[bi, p], :, : hi - lo] = k[bi, :, lo:hi]
            v_pool[page_table[bi, p], :, : hi - lo] = v[bi, :, lo:hi]
    s = torch.randn(h, device=device, dtype=dtype) if sinks else None
    return PagedProblem(q, k, v, k_pool, v_pool, page_table, kv_len, s)


def dense_attention(q, k, v, kv_len, *, scale, sliding_window=None, sinks=None, extra_mask=None):
    """Float64 causal attention of the last C positions over all kv_len keys (autograd-friendly)."""
    b, h, c, _ = q.shape
    g = h // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    qi = torch.arange(kv_len - c, kv_len, device=q.device)[:, None]
    kj = torch.arange(kv_len, device=q.device)[None, :]
    visible = kj <= qi
    if sliding_window is not None:
        visible &= (qi - kj) < sliding_window
    if extra_mask is not None:  # [B, H, C, kv_len] from visibility_mask
        visible = visible & extra_mask
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, h, 1, 1).expand(b, h, c, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


def random_doc_start(b, c, kv_len, n_docs, *, device="cpu") -> torch.Tensor:
    """[B, C] int32 document start of each query of the chunk, for random boundaries over the sequence."""
    starts = torch.zeros(b, c, dtype=torch.int32, device=device)
    for bi in range(b):
        cuts = torch.randperm(kv_len - 1)[: n_docs - 1] + 1  # a new document starts at each cut
        doc_of = torch.zeros(kv_len, dtype=torch.int64)
        doc_of[cuts] = 1
        doc_of = doc_of.cumsum(0)
        first = torch.zeros(int(doc_of[-1]) + 1, dtype=torch.int64)
        first[1:] = cuts.sort().values
        starts[bi] = first[doc_of[kv_len - c:]].to(torch.int32)
    return starts


def random_page_select(b, h_sel, c, kv_len, page_size, select_block, k, *, device="cpu") -> torch.Tensor:
    """[B, H_sel, ceil(C / select_block), K] int32: K distinct past pages per query block, ascending."""
    n_past = (kv_len - c) // page_size
    n_qb = -(-c // select_block)
    sel = torch.stack([torch.randperm(n_past)[:k].sort().values for _ in range(b * h_sel * n_qb)])
    return sel.view(b, h_sel, n_qb, k).to(device=device, dtype=torch.int32)


def visibility_mask(b, h, c, kv_len, *, page_size, doc_start=None, page_select=None, select_block=None,
                    device="cpu") -> torch.Tensor | None:
    """[B, H, C, kv_len] bool of the keys doc_start / page_select leave visible (causality aside)."""
    if doc_start is None and page_select is None:
        return None
    keys = torch.arange(kv_len, device=device)
    vis = torch.ones(b, h, c, kv_len, dtype=torch.bool, device=device)
    if doc_start is not None:
        vis &= (keys[None, None, None, :] >= doc_start.long()[:, None, :, None])
    if page_select is not None:
        n_past = (kv_len - c) // page_size
        h_sel = page_select.shape[1]
        past_ok = torch.zeros(b, h_sel, page_select.shape[2], n_past, dtype=torch.bool, device=device)
        past_ok.scatter_(-1, page_select.long(), True)
        qb = torch.arange(c, device=device) // select_block
        past_tok = past_ok[:, :, qb].repeat_interleave(page_size, dim=-1)  # [B, H_sel, C, n_past*page]
        past_tok = past_tok.repeat_interleave(h // h_sel, dim=1)
        vis[..., : n_past * page_size] &= past_tok
    return vis


def check_bf16_against_fp32(backend, pb: PagedProblem, kw: dict, kw32: dict | None = None) -> None:
    """A bf16 backend's forward and backward on ``pb`` against the reference backend's in float32 (out and dq,
    dk, dv within 1e-2 relative, lse within 1e-3, d_sinks within 1e-2 where ``kw`` has sinks). ``kw32``: the
    reference's keywords where they differ (float32 sinks); gradients are added into zeroed float32 pools."""
    from helpers import assert_close_rel

    from oomb.kernels import reference

    kw32 = kw if kw32 is None else kw32
    q32, k32, v32 = pb.q.float(), pb.k_pool.float(), pb.v_pool.float()
    out, lse = backend.forward(pb.q, pb.k_pool, pb.v_pool, pb.page_table, pb.kv_len, **kw)
    ref_out, ref_lse = reference.paged_attention_forward(q32, k32, v32, pb.page_table, pb.kv_len, **kw32)
    assert_close_rel(out.float(), ref_out, 1e-2, "out")
    assert_close_rel(lse, ref_lse, 1e-3, "lse")
    d_out = torch.randn_like(pb.q)
    dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
    ref_dk, ref_dv = torch.zeros_like(k32), torch.zeros_like(v32)
    dq, d_sinks = backend.backward(d_out, pb.q, out, lse, pb.k_pool, pb.v_pool, dk, dv, pb.page_table, pb.kv_len,
                                   **kw)
    ref_dq, ref_d_sinks = reference.paged_attention_backward(d_out.float(), q32, ref_out, ref_lse, k32, v32, ref_dk,
                                                             ref_dv, pb.page_table, pb.kv_len, **kw32)
    assert_close_rel(dq.float(), ref_dq, 1e-2, "dq")
    assert_close_rel(dk, ref_dk, 1e-2, "dk")
    assert_close_rel(dv, ref_dv, 1e-2, "dv")
    if kw.get("sinks") is not None:
        assert_close_rel(d_sinks, ref_d_sinks, 1e-2, "d_sinks")
