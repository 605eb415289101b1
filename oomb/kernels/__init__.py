"""Attention over the paged store: one signature, several backends.

``backend="torch"`` is the PyTorch path (kernels/reference.py): CPU and CUDA, the
oracle in tests. The Triton kernels join here as another backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from oomb.kernels import reference


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    forward: Callable
    backward: Callable


_BACKENDS = {
    "torch": AttentionBackend("torch", reference.paged_attention_forward, reference.paged_attention_backward),
}

BACKEND_NAMES = ("auto", *_BACKENDS)


def get_backend(name: str, device_type: str) -> AttentionBackend:
    """Resolve a backend name; ``auto`` picks the fastest one that runs on ``device_type``."""
    if name == "auto":
        name = "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return _BACKENDS[name]
