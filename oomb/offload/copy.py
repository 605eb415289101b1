"""Copy chosen pages between host pools and device slots, addressed from the GPU.

Sparse attention reads a different set of past pages for every chunk and layer. Copying
them with the copy engine would take one ``cudaMemcpyAsync`` per page (thousands per
layer), or a gather on the CPU into a staging buffer (the CPU thread then waits for the
copies in flight and memcpys at a few GB/s). Instead, pinned host memory is mapped into the
GPU's address space (unified virtual addressing), so a small Triton kernel on the copy
stream reads the chosen host pages straight over PCIe into the slot (``gather``) and writes
updated gradient pages straight back (``scatter``). The page list never leaves the GPU: no
host synchronisation.

Without CUDA the same copies are plain ``index_select`` / ``index_copy_`` on host tensors;
under ``TRITON_INTERPRET=1`` the kernel also runs on CPU tensors (tests).

Host pools come from ``pinned_empty``: ``torch.empty`` registered with the driver
(``cudaHostRegister``), exactly the bytes asked for. ``pin_memory=True`` goes through
PyTorch's caching host allocator, which rounds every block up to a power of two: 28 GiB
asked (one pool of 1M tokens of Qwen2.5-7B) would pin 32 GiB, and four such pools would
not fit a 128 GiB host.

Debugging: ``OOMB_OFFLOAD_SYNC=1`` (read when an offloaded store is built; or set its ``synchronous``)
synchronises the whole device before and after every copy batch, kernel-facing call and host-side
access of the pinned pools, so nothing overlaps. A result that changes with it is a stream race; one
that does not is a logic error.
"""

from __future__ import annotations

import os
import weakref

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with every CUDA build of torch
    triton = None

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every device, mapped into
# the device address space (the kernels below read and write it).
_REGISTER_FLAGS = 0x01 | 0x02


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, *, what: str = "offloaded pages",
                 instead: str = "use a shorter context or free host memory") -> torch.Tensor:
    """A zero-filled host tensor of exactly ``shape``, page-locked and mapped for the GPU.

    The registration is undone when the tensor's storage is freed. Raises RuntimeError with the
    byte count, ``what`` the memory is for and ``instead`` (what to change) when the host cannot lock
    that much memory.
    """
    t = torch.zeros(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    cudart = torch.cuda.cudart()
    ptr = t.data_ptr()
    status = cudart.cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS)
    code = getattr(status, "value", status)
    if code not in (0, None):
        raise RuntimeError(f"could not pin {nbytes / 2**30:.2f} GiB of host memory for {what} "
                           f"(cudaHostRegister error {code}); {instead}")
    # Unregister when the storage dies (views keep the storage alive, so tie it to the storage).
    weakref.finalize(t.untyped_storage(), _unregister, ptr)
    return t


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
        pass


if triton is not None:

    @triton.jit
    def _copy_pages_kernel(
        SRC, DST, SRC_IDX, DST_IDX,
        n_rows,  # pages per sequence row that move
        batch,
        src_b, src_p,  # strides (elements) of a sequence row and a page in SRC
        dst_b, dst_p,
        PAGE_ELEMS: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_SRC_IDX: tl.constexpr,
        HAS_DST_IDX: tl.constexpr,
    ):
        # A persistent grid: each program walks work items (sequence b, page r, part of the page)
        # with a stride of the grid size, moving BLOCK elements each: page r of sequence b goes from
        # SRC[b, SRC_IDX[r] or r] to DST[b, DST_IDX[r] or r]. Few programs leave the multiprocessors
        # to the compute stream's kernels; each keeps BLOCK elements in flight against the PCIe
        # latency of the mapped host side.
        parts: tl.constexpr = PAGE_ELEMS // BLOCK
        total = batch * n_rows * parts
        offs = tl.arange(0, BLOCK)
        for item in range(tl.program_id(0), total, tl.num_programs(0)):
            part = item % parts
            r = (item // parts) % n_rows
            b = item // (parts * n_rows)
            sp = r
            dp = r
            if HAS_SRC_IDX:
                sp = tl.load(SRC_IDX + r)
            if HAS_DST_IDX:
                dp = tl.load(DST_IDX + r)
            # an index of -1 skips the page (a union's pages that no list names: PastPages.union)
            moves = (offs < BLOCK) & (sp >= 0) & (dp >= 0)
            src = SRC + b.to(tl.int64) * src_b + tl.maximum(sp, 0).to(tl.int64) * src_p + part * BLOCK
            dst = DST + b.to(tl.int64) * dst_b + tl.maximum(dp, 0).to(tl.int64) * dst_p + part * BLOCK
            tl.store(dst + offs, tl.load(src + offs, mask=moves), mask=moves)


# Programs of the copy kernel: enough bytes in flight for PCIe (32 x 32 KiB), few multiprocessors.
DEFAULT_PROGRAMS = 32


def _block(page_elems: int, limit: int) -> int:
    block = 1
    while block < limit and page_elems % (block * 2) == 0:
        block *= 2
    return block


def copy_pages(src: torch.Tensor, dst: torch.Tensor, *, src_index: torch.Tensor | None = None,
               dst_index: torch.Tensor | None = None, use_kernel: bool, programs: int = DEFAULT_PROGRAMS,
               block: int = 16384, num_warps: int = 8) -> None:
    """dst[:, dst_index[r]] = src[:, src_index[r]] for r < len(index) (an absent index is 0, 1, ...); a row whose
    index is -1 in either moves nothing.

    ``src`` and ``dst``: [B, pages, *page] with contiguous pages. ``use_kernel``: the Triton
    kernel (CUDA with mapped host memory, or the interpreter); otherwise torch indexing on the
    tensors' own device (host tensors without CUDA). ``programs``, ``block``, ``num_warps``:
    the kernel's grid size, elements per program per step and warps (tuning: benchmarks/copy.py
    in the repository).
    """
    index = src_index if src_index is not None else dst_index
    if index is None:
        raise ValueError("copy_pages needs src_index or dst_index")
    n = index.numel()
    if n == 0:
        return
    if not use_kernel:
        if src_index is not None and dst_index is not None:  # rows marked -1 move nothing
            moves = (src_index >= 0) & (dst_index >= 0)
            src_index, dst_index = src_index[moves], dst_index[moves]
        rows = src.index_select(1, src_index.to(src.device, torch.long)) if src_index is not None else src[:, :n]
        if dst_index is not None:
            dst.index_copy_(1, dst_index.to(dst.device, torch.long), rows.to(dst.device))
        else:
            dst[:, :n].copy_(rows)
        return
    if triton is None:
        raise RuntimeError("sparse offload on CUDA needs the triton package")
    page_elems = src[0, 0].numel()
    for t in (src, dst):
        if not t[0, 0].is_contiguous() or t.stride(1) < page_elems:
            raise ValueError("copy_pages needs contiguous pages")
    block = _block(page_elems, block)
    items = src.shape[0] * n * (page_elems // block)
    _copy_pages_kernel[(max(1, min(programs, items)),)](
        src, dst,
        src_index if src_index is not None else index, dst_index if dst_index is not None else index,
        n, src.shape[0], src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        PAGE_ELEMS=page_elems, BLOCK=block,
        HAS_SRC_IDX=src_index is not None, HAS_DST_IDX=dst_index is not None,
        num_warps=num_warps,
    )


SYNC_ENV = "OOMB_OFFLOAD_SYNC"


def sync_from_env() -> bool:
    """Whether ``OOMB_OFFLOAD_SYNC`` asks for the fully synchronous (debugging) mode."""
    return os.environ.get(SYNC_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
