"""The page layout, in one place: tokens [B, H_kv, T, D] <-> tiles [B * n, H_kv, page_size, D].

Pools store tiles; attention works on tokens. Both the store and the PyTorch kernels
convert through these two functions, so the layout is defined once. ``first_visible_page``
is the page arithmetic every reader of the pools shares (kernels, attention, page lists).
"""

from __future__ import annotations

import torch


def tokens_to_tiles(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B, H, T, D] -> [B * ceil(T / page_size), H, page_size, D], zero-padding a ragged tail."""
    b, h, t, d = x.shape
    n = -(-t // page_size)
    if n * page_size != t:
        x = torch.nn.functional.pad(x, (0, 0, 0, n * page_size - t))
    return x.reshape(b, h, n, page_size, d).permute(0, 2, 1, 3, 4).reshape(b * n, h, page_size, d)


def tiles_to_tokens(tiles: torch.Tensor) -> torch.Tensor:
    """[B, n, H, page_size, D] (a pool indexed by a [B, n] page-id block) -> [B, H, n * page_size, D]."""
    b, n, h, s, d = tiles.shape
    return tiles.permute(0, 2, 1, 3, 4).reshape(b, h, n * s, d)


def first_visible_page(
    kv_len: int, q_len: int, page_size: int, sliding_window: int | None, first_doc_start: int = 0
) -> int:
    """Pages before this one hold no key that any query of the chunk (the newest ``q_len`` of
    ``kv_len`` tokens) can see.

    ``first_doc_start``: the smallest document start of any query (0 without documents).
    """
    earliest_key = first_doc_start
    if sliding_window is not None:
        earliest_key = max(earliest_key, kv_len - q_len - sliding_window + 1)
    return max(0, earliest_key) // page_size
