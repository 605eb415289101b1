"""Tile sizes and launch settings of the Triton attention kernels, per problem class.

The launchers ask ``choose_tiles`` through this module (``tiles.choose_tiles(...)``), so tests,
benchmarks and tuning replace it in one place (``oomb.kernels.tiles.choose_tiles = ...``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch settings of the four kernels (M = rows of (position, head), N = keys)."""

    fwd_m: int
    fwd_n: int
    fwd_warps: int
    fwd_stages: int
    dkdv_m: int  # rows per step of the dK/dV loop
    dkdv_n: int  # keys owned by one dK/dV program
    dq_m: int  # rows owned by one dQ program
    dq_n: int  # keys per step of the dQ loop
    bwd_warps: int
    bwd_stages: int
    delta_c: int = 64
    tma: bool = False  # K/V tiles of the forward and dQ loops through TMA descriptors (Hopper+)
    # dK/dV row tiles of one query head at a time (contiguous Q/dO rows) instead of rows that
    # interleave the GQA group's heads position by position.
    dkdv_head_major: bool = False
    # Dense calls: dQ summed inside the dK/dV kernel (fp32 atomics, 5 matmuls per tile pair instead
    # of 4 + 3) and no dQ kernel, so dq_m/dq_n go unused; page-selected calls ignore it. The atomics
    # make dQ's summation order, so its last bits, vary from run to run. With d=128 on sm_90a the
    # extra fp32 tile spills inside the row loops at dkdv_m=64, not at 32 (offline ptxas, not timed).
    dq_fused: bool = False


def interpreting() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``: tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_tiles(head_dim: int, page_size: int, dtype: torch.dtype) -> Tiles:
    """Tiles for one problem class; a module-level function so tests and tuning can replace it.

    ``head_dim``: the wider of the key and value head tiles, each padded to a power of two >= 16
    (launch.tile_head_dim: 96 comes as 128; Dk=192, Dv=128 as 256). Any power-of-two key block
    >= 16 works with any page size (a block inside one page, or whole pages with one page id per
    key); a block inside one page is the cheaper case and the only one TMA serves. Register use
    of the head_dim <= 128 settings was checked offline (ptxas for sm_90a, no GPU): they do not
    spill inside loops. Their speed against other tiles: docs/benchmarks.md ("Attention
    kernels"), benchmarks.tune_attention.
    """
    if interpreting():
        # The interpreter costs ~ms per block iteration whatever the tile: small tiles, few programs.
        return Tiles(16, 16, 1, 1, 16, 16, 16, 16, 1, 1, delta_c=16, dkdv_head_major=True)
    if dtype == torch.float32:
        # Exact fp32 products run on FMA units, not tensor cores: a correctness path with small tiles.
        # Heads of 256 columns: 32-key blocks of K and V are 32 KiB each in fp32, two stages 128 KiB.
        return Tiles(32, 32, 8, 2, 16, 32, 32, 32, 8, 2)
    if head_dim > 128:
        # Heads padded to 256 (192 for DeepSeek-style latent attention's keys, 256, or any size in (128, 256]):
        # chosen by arithmetic, not timed (no GPU here); tune them with benchmarks.tune_attention.
        # - Forward: 128 rows x 64 keys, 8 warps, 2 stages. Per thread the fp32 output tile [128, 256] is
        #   128 registers and the scores [128, 64] 32 more, FlashAttention-3's budget at this size (it runs
        #   128 x 80); K and V blocks of 64 keys are 32 KiB each in bf16, so two stages with the q tile
        #   (64 KiB) use 192 KiB of the 227 KiB of shared memory an H100 block may have, where 128-key
        #   blocks or three stages would not fit.
        # - dK/dV: 64 keys a program (its fp32 dK and dV [64, 256] are 64 registers each at 8 warps;
        #   128 keys would double them past the 255-register limit), 32-row steps.
        # - dQ: 64 rows x 64 keys (the fp32 dQ [64, 256] is 64 registers a thread).
        # TMA as for d <= 128 where the head sizes are whole tiles (launch.kv_descriptors).
        return Tiles(128, 64, 8, 2, 32, 64, 64, 64, 8, 2, tma=True, dkdv_head_major=True)
    # Key blocks of the forward/dQ loops stay inside one page when pages are large enough (one page id
    # per block, TMA); small or odd pages get 128-key blocks with a page id per key instead.
    fwd_n = min(128, page_size) if page_size >= 64 and page_size & (page_size - 1) == 0 else 128
    # dQ loop over 128-key blocks where a page holds them: bwd 296 vs 278 TFLOP/s with 64 (H200, kv 64K,
    # page 128); 64 elsewhere (not measured).
    dq_n = 128 if page_size % 128 == 0 else 64
    # d=128, bf16/fp16: what won for a tutorial-style flash attention without pages on the H200 (triton
    # 3.6): forward 128/128, 8 warps, 3 stages; backward 8 warps, 3 stages (4 warps, 5 stages spill
    # registers at d=128). d=64 uses the same (4 warps spill).
    # dK/dV: one query head at a time in 64-row tiles: the kernel 22.3 -> 14.9 ms, forward+backward
    # 323 -> 395 TFLOP/s (H200, kv 64K, page 128, 28/4 heads; 32-row head-major tiles 16.9 ms,
    # interleaved 64-row tiles 24.0 ms; benchmarks/results/attention-dkdv-layouts-64k.json).
    return Tiles(128, fwd_n, 8, 3, 64, 128, 128, dq_n, 8, 3, tma=True, dkdv_head_major=True)

