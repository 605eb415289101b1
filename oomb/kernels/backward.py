"""The backward of paged attention in Triton: the delta preprocess, then dK/dV and dQ.

Launches, in order (the PyTorch reference with the same signature is
``oomb.kernels.reference.paged_attention_backward``):

- ``_bwd_delta_kernel`` (here): delta = rowsum(dO * O), fp32.
- dK/dV added into the gradient pages: dense, ``_bwd_dkdv_kernel`` (dkdv.py; with
  ``Tiles.dq_fused`` it sums dQ too); page-selected, ``_bwd_dkdv_sparse_kernel``
  (sparse_backward.py).
- ``_bwd_dq_kernel`` (dq.py), unless the dK/dV kernel summed dQ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oomb.kernels import launch, tiles
from oomb.kernels.common import dims_mask
from oomb.kernels.dkdv import launch_dkdv
from oomb.kernels.dq import launch_dq
from oomb.kernels.reference import check_backward_args
from oomb.kernels.sparse_backward import launch_sparse_dkdv


@triton.jit
def _bwd_delta_kernel(
    OUT,  # [B, H, C, DV]
    DO,  # [B, H, C, DV]
    DELTA,  # [B, H, C] float32, contiguous
    so_b, so_h, so_c,
    sdo_b, sdo_h, sdo_c,
    C,
    H: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = dims_mask((c < C)[:, None], DV, BLOCK_DV)
    offs_d = tl.arange(0, BLOCK_DV)
    o = tl.load(OUT + b * so_b + h * so_h + c[:, None].to(tl.int64) * so_c + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + c[:, None].to(tl.int64) * sdo_c + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * C + c, delta, mask=c < C)


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
    block_tokens: int | None = None,  # accepted for signature parity with the reference; unused
    page_union: int | None = None,  # as in the reference; unused
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Adds dK/dV of every visible page into dk_pool/dv_pool (only pages some query attends are written).

    Returns (dq [B, H, C, Dk] in q.dtype, d_sinks [H] float32 or None).
    """
    b, h, c, d, h_kv, page_size, n_pages = launch.check_args(q, k_pool, v_pool, page_table, kv_len, sliding_window,
                                                             sinks)
    check_backward_args(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool)
    if dk_pool.stride(-1) != 1 or dv_pool.stride(-1) != 1:
        raise ValueError("gradient pools must be contiguous in head_dim")
    d_v = v_pool.shape[-1]
    q, d_out, out = launch.last_dim_contiguous(q), launch.last_dim_contiguous(d_out), launch.last_dim_contiguous(out)
    lse, page_table = launch.last_dim_contiguous(lse), launch.last_dim_contiguous(page_table)
    t = tiles.choose_tiles(launch.tile_head_dim(d, d_v), page_size, q.dtype)
    docs, sel = launch.visibility_args(q, h_kv, kv_len, page_size, sliding_window, doc_start, page_select,
                                       select_block)
    lo_key, window = launch.window_args(kv_len, c, page_size, sliding_window)
    if sel is not None:
        lo_key = kv_len - c  # dQ's dense loop covers the chunk's own keys; the past comes from the page lists
    has_window = sliding_window is not None

    delta = launch.empty_buffer((b, h, c), torch.float32, q.device)
    _bwd_delta_kernel[(triton.cdiv(c, t.delta_c), b * h)](
        out, d_out, delta,
        out.stride(0), out.stride(1), out.stride(2),
        d_out.stride(0), d_out.stride(1), d_out.stride(2),
        c, H=h, DV=d_v, BLOCK_DV=launch.head_block(d_v), BLOCK_C=t.delta_c,
    )

    fused_dq = sel is None and t.dq_fused
    if sel is None:
        dq_acc = launch_dkdv(q, d_out, lse, delta, k_pool, v_pool, dk_pool, dv_pool, page_table, docs,
                             kv_len=kv_len, lo_key=lo_key, window=window, scale=scale, has_window=has_window, t=t,
                             fused_dq=fused_dq)
    else:
        launch_sparse_dkdv(q, d_out, lse, delta, k_pool, v_pool, dk_pool, dv_pool, page_table, docs, sel,
                           kv_len=kv_len, select_block=select_block, scale=scale, t=t)

    if fused_dq:
        dq = dq_acc.mul_(scale).to(q.dtype)
    else:
        dq = launch_dq(q, d_out, lse, delta, k_pool, v_pool, page_table, docs, sel, kv_len=kv_len, lo_key=lo_key,
                       window=window, scale=scale, has_window=has_window, select_block=select_block, t=t)

    d_sinks = None
    if sinks is not None:
        # The sink is a key of logit `sink` and value 0: dS_sink = P_sink * (0 - delta).
        p_sink = torch.exp(sinks.float().view(1, h, 1) - lse)
        d_sinks = -(p_sink * delta).sum(dim=(0, 2))
    return dq, d_sinks
