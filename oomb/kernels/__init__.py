"""Attention over the paged store: one signature, several backends.

- ``torch``: the PyTorch path (kernels/reference.py). CPU and CUDA; the oracle in tests.
- ``triton``: the Triton kernels, one op per file: forward.py, backward.py (delta, then
  dkdv.py or sparse_backward.py, then dq.py), with common.py (shared jit helpers), tiles.py
  (tile choice) and launch.py (host-side argument helpers). CUDA, or CPU under
  ``TRITON_INTERPRET=1`` (tests only: slow).
- ``auto``: triton on CUDA when it imports, torch elsewhere.
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


__all__ = ["BACKEND_NAMES", "AttentionBackend", "get_backend"]

BACKEND_NAMES = ("auto", "torch", "triton")


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


def get_backend(name: str, device_type: str) -> AttentionBackend:
    """Resolve a backend name for tensors on ``device_type`` ("cpu", "cuda")."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = "triton" if device_type == "cuda" and _triton_importable() else "torch"
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
