"""Host-side argument helpers shared by the Triton attention launchers (checks, placeholders, grids).

The launchers call ``empty_buffer`` through this module (``launch.empty_buffer(...)``), so a test
can replace it in one place to poison every buffer a kernel must fill.
"""

from __future__ import annotations

import torch
import triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: pointer loads only
    TensorDescriptor = None

from oomb.cache.layout import first_visible_page
from oomb.kernels.reference import check_paged_args, check_visibility_args
from oomb.kernels.tiles import Tiles, interpreting

LOG2E = 1.4426950408889634


# The largest key or value head size the Triton kernels take: a 256-column tile (padded) is the most the
# tiles of tiles.py keep in registers and shared memory.
MAX_HEAD_DIM = 256


def head_block(d: int) -> int:
    """The tile width of a head size ``d``: the next power of two >= 16 (tl.arange and tl.dot need one). Columns
    past ``d`` are masked (common.dims_mask); a power-of-two d >= 16 is its own block and pays no mask."""
    return max(16, 1 << (d - 1).bit_length())


def tile_head_dim(d_k: int, d_v: int) -> int:
    """The head size tiles.choose_tiles is asked about: the wider of the padded key and value tiles (both live
    in the kernels' registers and shared memory)."""
    return max(head_block(d_k), head_block(d_v))


def kv_same(k_pool: torch.Tensor, v_pool: torch.Tensor, dk_pool: torch.Tensor | None = None,
            dv_pool: torch.Tensor | None = None) -> bool:
    """Whether the V pool (and dV pool) have the K pool's (dK pool's) head size and strides, so the kernels compute
    one set of offsets for both (the KV_SAME constexpr: the code path of equal head sizes, unchanged)."""
    same = v_pool.shape[-1] == k_pool.shape[-1] and v_pool.stride() == k_pool.stride()
    if dk_pool is not None:
        same = same and dv_pool.shape[-1] == dk_pool.shape[-1] and dv_pool.stride() == dk_pool.stride()
    return same


def check_args(q, k_pool, v_pool, page_table, kv_len, sliding_window, sinks):
    """Shapes, strides and ranges every launcher needs; returns (b, h, c, d, h_kv, page_size, n_pages) with d the
    key head size Dk (the value head size Dv is v_pool.shape[-1])."""
    b, h, c, d = q.shape
    _, h_kv, page_size, _ = k_pool.shape
    if page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be int32 [B, n]; got {page_table.dtype} {tuple(page_table.shape)}")
    n_pages = check_paged_args(q, k_pool, page_table, kv_len, sliding_window, v_pool)
    d_v = v_pool.shape[-1]
    if not (1 <= d <= MAX_HEAD_DIM and 1 <= d_v <= MAX_HEAD_DIM):
        raise ValueError(f"the Triton kernels take key and value head sizes 1 .. {MAX_HEAD_DIM}; got Dk={d}, Dv={d_v} "
                         "(use backend='torch' for larger heads)")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("pools must be contiguous in head_dim")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"sinks must be [H]={h}, got {tuple(sinks.shape)}")
    return b, h, c, d, h_kv, page_size, n_pages


def window_args(kv_len, c, page_size, sliding_window):
    """(lo_key, window): keys before lo_key are never visible; window clamped so int32 math cannot overflow."""
    lo_key = first_visible_page(kv_len, c, page_size, sliding_window) * page_size
    window = 0 if sliding_window is None else min(sliding_window, kv_len + 1)
    return lo_key, window


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (the reference's semantics); 16-bit inputs are exact in tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its rows are contiguous (the kernels take the other strides as arguments)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def empty_buffer(shape, dtype, device) -> torch.Tensor:
    """Every buffer a kernel must fill (tests replace this to poison them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def kv_descriptors(k_pool, v_pool, tiles: Tiles, block_n: int):
    """TMA descriptors of the pools as [num_pages * H_kv * page_size, D], or the pools themselves
    (placeholders the kernel never reads) when TMA does not apply. Head sizes that are padded (not a
    power of two >= 16) take pointer loads: a TMA box would have to read past the row into the next
    (or rely on out-of-bounds fill, not checked on a GPU here)."""
    num_pages, h_kv, page_size, d_k = k_pool.shape
    d_v = v_pool.shape[-1]
    usable = (
        tiles.tma
        and TensorDescriptor is not None
        and page_size % block_n == 0
        and head_block(d_k) == d_k
        and head_block(d_v) == d_v
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and k_pool.data_ptr() % 16 == 0
        and v_pool.data_ptr() % 16 == 0
        and (interpreting() or (k_pool.is_cuda and torch.cuda.get_device_capability(k_pool.device)[0] >= 9))
    )
    if not usable:
        return k_pool, v_pool, False
    rows = num_pages * h_kv * page_size
    k_desc = TensorDescriptor(k_pool, [rows, d_k], [d_k, 1], [block_n, d_k])
    v_desc = TensorDescriptor(v_pool, [rows, d_v], [d_v, 1], [block_n, d_v])
    return k_desc, v_desc, True


def visibility_args(q, h_kv, kv_len, page_size, sliding_window, doc_start, page_select, select_block):
    """Kernel arguments for documents and page selection (placeholders when absent)."""
    b, h, c, _ = q.shape
    check_visibility_args(q, h_kv, kv_len, page_size, doc_start, page_select, select_block)
    docs = None if doc_start is None else doc_start.to(torch.int32).contiguous()
    sel = None
    if page_select is not None:
        if sliding_window is not None:
            raise ValueError("page selection does not combine with a sliding window: window layers read only the "
                             "pages inside their window already")
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"page-sparse attention needs a power-of-two page_size >= 16, got {page_size}")
        sel = page_select.contiguous()
    return docs, sel


def sparse_grid_args(sel, c, g, block_m, select_block):
    """(sel strides, select_block, tiles per block, K) for the row-major kernels; dense: zeros."""
    if sel is None:
        return (0, 0, 0), 0, 0, 0
    tiles_per_block = triton.cdiv(min(select_block, c) * g, block_m)
    s_h = sel.stride(1) if sel.shape[1] > 1 else 0  # one selection shared by every KV head
    return (sel.stride(0), s_h, sel.stride(2)), select_block, tiles_per_block, sel.shape[3]


def backward_strides(q, d_out, lse, k_pool, dk_pool, page_table, v_pool=None, dv_pool=None) -> tuple[int, ...]:
    """The stride arguments both dK/dV kernels take, in their order (v_pool / dv_pool: k_pool's / dk_pool's
    strides when not given)."""
    v_pool = k_pool if v_pool is None else v_pool
    dv_pool = dk_pool if dv_pool is None else dv_pool
    return (
        q.stride(0), q.stride(1), q.stride(2),
        d_out.stride(0), d_out.stride(1), d_out.stride(2),
        lse.stride(0), lse.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        dk_pool.stride(0), dk_pool.stride(1), dk_pool.stride(2),
        dv_pool.stride(0), dv_pool.stride(1), dv_pool.stride(2),
        page_table.stride(0),
    )
