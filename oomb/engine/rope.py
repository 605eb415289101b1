"""Rotary frequencies that depend on the sequence's length, held at the whole sequence's for a chunked pass.

transformers recomputes the frequencies of dynamic-NTK and LongRoPE rotary embeddings in each forward from the
largest position it is given (``dynamic_rope_update``): LongRoPE (Phi-3's 128K models) switches from its short to
its long factors once a sequence is longer than the model's original context, dynamic NTK rescales with the
length. A chunked pass gives each chunk its own positions, so unheld the first chunks of a long sequence would
rotate with other frequencies than the later ones, and than a full forward of the sequence. ``length_held``
runs each such rotary module once at the sequence's last position (its frequencies become what a full forward
gives them, from the state it is in) and keeps them there for the pass: the update is skipped while its
``rope_type`` reads "default", and the module's own type comes back afterwards.
"""

from __future__ import annotations

import contextlib

import torch

_HELD = "default"


def _updates(rope_type) -> bool:
    """Whether transformers updates the frequencies of this rope type in each forward."""
    return isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope")


@contextlib.contextmanager
def length_held(model: torch.nn.Module, seq_len: int):
    """Hold every length-dependent rotary module of ``model`` at the frequencies of a ``seq_len``-token sequence."""
    held = []
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        per_layer = rope_type if isinstance(rope_type, dict) else {None: rope_type}
        updating = [layer for layer, kind in per_layer.items() if _updates(kind)]
        buffer = getattr(module, "inv_freq", None)
        if not updating or not isinstance(buffer, torch.Tensor) and not isinstance(rope_type, dict):
            continue
        device = next((b.device for b in module.buffers()), torch.device("cpu"))
        x = torch.zeros(1, 1, 1, device=device)
        position = torch.full((1, 1), seq_len - 1, device=device)
        with torch.no_grad():
            for layer in updating:  # the update a full forward of the sequence makes
                module(x, position) if layer is None else module(x, position, layer_type=layer)
        held.append((module, rope_type))
        module.rope_type = {k: _HELD if k in updating else v for k, v in per_layer.items()} if isinstance(
            rope_type, dict) else _HELD
    try:
        yield len(held)
    finally:
        for module, rope_type in held:
            module.rope_type = rope_type
