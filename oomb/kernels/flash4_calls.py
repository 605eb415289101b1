"""flash-attn-4's forward and backward as the ``fa4`` backend calls them (kernels/flash4.py), and what it takes.

``FlashKernels`` is the two calls in FA4's layouts; ``FlashAttention4`` makes them through flash-attn-4's
functions below its autograd wrapper, ``fa4_supports_head_dims`` says which head sizes it runs, and
``KeyLayout`` how the keys a call gathers out of the pages are laid out for it. Tests put a PyTorch
stand-in with FA4's semantics in its place (tests/flash_standin.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from oomb.kernels.flash4_sparse import BlockLists, BlockSparsity

# The flash-attn-4 release this adapter was written and measured against: it calls the
# package's forward and backward functions below its autograd wrapper (oomb runs its own
# backward), which a later release may change.
FLASH4_VERSION = "4.0.0b40"

# FA4's block sparsity runs the page-sparse calls where it can (Hopper): its GPU tests passed on the H200 and a
# sparse 128K step of Qwen2.5-7B took 17.2 s on it against 19.8 s on the Triton kernels the day before, though
# recomputing more (docs/benchmarks.md).
# This variable set to "0" keeps page-sparse calls on the Triton kernels.
BLOCK_SPARSE_ENV = "OOMB_FA4_BLOCK_SPARSE"

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


FA4_MIN_HEAD_DIM = 64  # smaller heads run on the Triton kernels (fa4_supports_head_dims)


def fa4_supports_head_dims(arch: int, head_dim: int, head_dim_v: int, grouped: bool, *,
                           min_head_dim: int = FA4_MIN_HEAD_DIM) -> bool:
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
    - Sizes below 64 (``FA4_MIN_HEAD_DIM``) go to the fallback on both: on an H100 (2026-12-07, tiny models of
      tests/models/test_gpu_families.py) FA4 b40 ran head size 16 with a gradient 2x-60x further from fp32 than
      transformers' own bf16 step, and failed to compile keys of 24 with values of 16 (a CuTe layout error); 64
      and 128 are checked against the fp32 reference on the GPU (tests/kernels/test_flash4.py).
    """
    if min(head_dim, head_dim_v) < max(8, min_head_dim) or head_dim % 8 or head_dim_v % 8:
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
