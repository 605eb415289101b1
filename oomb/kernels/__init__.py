"""Attention over the paged store: one signature, several backends.

- ``torch``: the PyTorch path (kernels/reference.py). CPU and CUDA; the oracle in tests.
- ``triton``: the Triton kernels, one op per file: forward.py, backward.py (delta, then
  dkdv.py or sparse_backward.py, then dq.py), with common.py (shared jit helpers), tiles.py
  (tile choice) and launch.py (host-side argument helpers). CUDA, or CPU under
  ``TRITON_INTERPRET=1`` (tests only: slow).
- ``fa4``: FlashAttention-4 (flash4.py; ``pip install 'oomb[fa4]'``, Hopper and Blackwell) over
  keys gathered out of the pages. Page-sparse selections run on FA4's block sparsity by default
  where it applies (flash4_sparse.py: Hopper, pages of 128 and selection blocks of a multiple of 128
  queries, no documents or windows, not in deterministic mode; ``OOMB_FA4_BLOCK_SPARSE=0`` turns it
  off), tested against the reference on CPU with a stand-in for FA4 and on the GPU. The Triton kernels
  run what it cannot express: sinks, 32-bit inputs, and page-sparse calls off those conditions.
- ``auto``: fa4 where it imports and the GPU is Hopper or Blackwell, else triton on CUDA when it
  imports, torch elsewhere.

Head sizes: queries and keys have Dk, values and the output Dv (kernels/reference.py's docstring
has every shape). Dk == Dv is the common case; latent attention (DeepSeek-V2/V3, GLM-4-MoE-lite,
MiniCPM3: Dk = 192, Dv = 128) has Dk != Dv, and some models have sizes that are no power of two
(Phi-3's 96, 80).

- ``torch``: any Dk and Dv.
- ``triton``: Dk and Dv each 1 .. 256, any pair. A size that is not a power of two >= 16 runs in
  tiles padded to one (96 in 128, 192 in 256) with masked loads and stores (its K/V tiles through
  pointers, not TMA); powers of two run unmasked. Wider heads are refused (use
  ``torch``). Tiles for heads padded past 128 (tiles.py) were chosen by arithmetic, not timed.
- ``fa4``: what FlashAttention-4 runs (flash4_calls.fa4_supports_head_dims, from its source): on Hopper
  Dk and Dv each a multiple of 8 from 64 to 256 (smaller heads measured wrong or not compiling), Dk != Dv
  only with as many KV heads as query heads (its GQA backward wants equal sizes); on Blackwell equal sizes,
  multiples of 8 from 64 to 128.
  Other calls go to the Triton kernels, forward and backward alike. Page-sparse calls use FA4's
  block sparsity only up to 128 (the wider of Dk and Dv).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from oomb.kernels import reference


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    forward: Callable
    backward: Callable


__all__ = ["BACKEND_NAMES", "AttentionBackend", "flash4_unavailable", "get_backend"]

BACKEND_NAMES = ("auto", "torch", "triton", "fa4")


@functools.cache
def _triton_backend() -> AttentionBackend:
    # Imports triton: only when asked for.
    from oomb.kernels.backward import paged_attention_backward
    from oomb.kernels.forward import paged_attention_forward

    return AttentionBackend("triton", paged_attention_forward, paged_attention_backward)


def _triton_importable() -> bool:
    try:
        _triton_backend()
    except ImportError:
        return False
    return True


@functools.cache
def _flash4_backend() -> AttentionBackend:
    from oomb.kernels.flash4 import Flash4Attention
    from oomb.kernels.flash4_calls import FlashAttention4

    attention = Flash4Attention(FlashAttention4(), fallback=_triton_backend())
    return AttentionBackend("fa4", attention.forward, attention.backward)


def flash4_unavailable() -> str | None:
    """Why the ``fa4`` backend cannot run here (None: it can)."""
    import torch

    if not torch.cuda.is_available():
        return "it needs a CUDA GPU"
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        return f"FlashAttention-4 runs on Hopper (sm90) and Blackwell (sm100) GPUs; this one is sm{major}x"
    try:
        _flash4_backend()
    except ImportError as e:
        return f"flash-attn-4 or triton does not import ({e}); pip install 'oomb[fa4]'"
    return None


def get_backend(name: str, device_type: str) -> AttentionBackend:
    """Resolve a backend name for tensors on ``device_type`` ("cpu", "cuda")."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        if device_type == "cuda" and flash4_unavailable() is None:
            return _flash4_backend()
        name = "triton" if device_type == "cuda" and _triton_importable() else "torch"
    if name == "fa4":
        if device_type != "cuda":
            raise ValueError(f"backend='fa4' needs a CUDA device (tensors are on {device_type}); use 'auto'")
        if (reason := flash4_unavailable()) is not None:
            raise ValueError(f"backend='fa4' cannot run: {reason}")
        return _flash4_backend()
    if name == "torch":
        return AttentionBackend("torch", reference.paged_attention_forward, reference.paged_attention_backward)
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs a CUDA device (tensors are on {device_type}); use backend='torch' "
            "(or set TRITON_INTERPRET=1 to run the kernels in Triton's slow interpreter)"
        )
    try:
        return _triton_backend()
    except ImportError as e:
        raise ValueError(f"backend='triton' needs the triton package: {e}") from e
