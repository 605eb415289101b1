"""What a paged store holds, per layer: page shapes, dtypes, sliding windows, and the bytes that follow.

``StoreSpec`` describes a store (two stores with equal specs are interchangeable); ``page_key_summary`` is the
per-page key summary both stores compute; ``StoreBytes`` what a store allocates, as the memory planner adds it up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PageShape:
    """The K/V geometry of one attention layer's pages (latent attention: a key head size other than the value's)."""

    kv_heads: int
    key_dim: int  # head size of keys (and queries)
    value_dim: int  # head size of values (and of the attention output)

    def __post_init__(self) -> None:
        for name in ("kv_heads", "key_dim", "value_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class StoreSpec:
    """Shapes and dtypes of a store; two stores with equal specs are interchangeable.

    ``layers``: one PageShape per attention layer of the store (an attention call of a chunk's forward: a
    model that attends twice per decoder layer has two store layers per decoder layer). Most models give
    every layer the same shape (``StoreSpec.uniform``).

    ``windows``: per layer, the sliding window its attention calls name (keys i - j < W), None for full attention;
    None (the field) where no layer has one (a tuple of None alone becomes None, so such specs compare equal). A
    device store keeps, of a sliding layer, only the pages its window reaches from a later chunk
    (oomb/cache/window_pages.py); the offloaded store, in host memory, as well (oomb/offload/host_pages.py).
    """

    layers: tuple[PageShape, ...]
    page_size: int
    dtype: torch.dtype
    grad_dtype: torch.dtype
    device: torch.device
    key_summary: str = "mean"  # per-page key summary for page selection: "mean", or "bounds" (mean | min | max)
    # Gradient pages (dK, dV) beside K and V: a training step's store has them; a forward-only pass that allocates
    # its own store (an evaluation) does without, half the K/V bytes.
    gradients: bool = True
    windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.key_summary not in KEY_SUMMARIES:
            raise ValueError(f"key_summary must be one of {KEY_SUMMARIES}, got {self.key_summary!r}")
        if not self.layers:
            raise ValueError("a store needs at least one layer")
        if self.windows is not None:
            if len(self.windows) != len(self.layers):
                raise ValueError(f"windows names {len(self.windows)} layers, the store has {len(self.layers)}")
            if any(w is not None and w < 1 for w in self.windows):
                raise ValueError(f"a sliding window must be at least 1 token, got {self.windows}")
            if all(w is None for w in self.windows):
                object.__setattr__(self, "windows", None)  # frozen: the one normal form of "no windows"

    def window(self, layer_idx: int) -> int | None:
        """The layer's sliding window (None: full attention)."""
        return None if self.windows is None else self.windows[layer_idx]

    def full_layers(self) -> list[int]:
        """The layers without a sliding window, which keep every page."""
        return [i for i in range(self.num_layers) if self.window(i) is None]

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, value_dim: int | None = None,
                **fields) -> StoreSpec:
        """``num_layers`` layers of one shape (``value_dim`` defaults to ``head_dim``)."""
        shape = PageShape(num_kv_heads, head_dim, head_dim if value_dim is None else value_dim)
        return cls(layers=(shape,) * num_layers, **fields)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def shape(self) -> PageShape:
        """The one shape of every layer; ValueError where layers differ (callers that need one shape)."""
        first = self.layers[0]
        if any(layer != first for layer in self.layers):
            raise ValueError(f"the store's layers have different shapes ({sorted(set(self.layers), key=str)}): "
                             "this part of oomb needs every attention layer to have the same K/V shape")
        return first

    @property
    def num_kv_heads(self) -> int:
        return self.shape.kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.key_dim

    def summary_dim(self, layer_idx: int = 0) -> int:
        """Last dimension of a layer's per-page key summary: D_k (the mean key), or 3 D_k (mean | min | max)."""
        return self.layers[layer_idx].key_dim * (3 if self.key_summary == "bounds" else 1)

    @property
    def _bytes_per_element(self) -> int:
        """Bytes of one K/V element with its gradient's (where the store has gradient pages)."""
        return self.dtype.itemsize + (self.grad_dtype.itemsize if self.gradients else 0)

    def bytes_per_token(self) -> int:
        """K, V and their gradient pages, all layers (the memory that grows with the context)."""
        return sum(s.kv_heads * (s.key_dim + s.value_dim) * self._bytes_per_element for s in self.layers)

    def summary_bytes_per_page(self) -> int:
        """The key summaries of one page id, all layers (in K's dtype)."""
        return sum(s.kv_heads * self.summary_dim(i) for i, s in enumerate(self.layers)) * self.dtype.itemsize

    def bytes_per_page(self) -> int:
        """One page id across all layers: K, V, dK, dV and the key summary (in K's dtype)."""
        return self.bytes_per_token() * self.page_size + self.summary_bytes_per_page()

    def layer_page_bytes(self, layer_idx: int) -> int:
        """One page of one layer: K, V, dK, dV and its key summary (in K's dtype)."""
        s = self.layers[layer_idx]
        return (s.kv_heads * (s.key_dim + s.value_dim) * self._bytes_per_element * self.page_size
                + s.kv_heads * self.summary_dim(layer_idx) * self.dtype.itemsize)

    def layer_bytes(self, pages: int) -> int:
        """``pages`` pages of one layer: K, V, dK, dV and mean keys (what offload keeps per layer; one shape)."""
        s = self.shape
        page = s.kv_heads * (s.key_dim + s.value_dim) * self._bytes_per_element * self.page_size
        return pages * (page + s.kv_heads * self.summary_dim() * self.dtype.itemsize)


KEY_SUMMARIES = ("mean", "bounds")


def page_key_summary(tiles: torch.Tensor, valid: torch.Tensor | None, kind: str) -> torch.Tensor:
    """Key tiles [n, H_kv, P, D] -> per-page summaries (fp32) over each page's ``valid`` [n] slots (None: every
    slot holds a key): [n, H_kv, D] mean keys, or for ``kind="bounds"`` [n, H_kv, 3D] = mean | per-channel min |
    max (what an upper bound of q . k over the page's keys needs: q+ . max + q- . min)."""
    if valid is None:  # whole pages (a chunk ending on a page boundary): nothing to mask, half the kernels
        mean = tiles.sum(dim=2, dtype=torch.float32).div_(tiles.shape[2])
        if kind == "mean":
            return mean
        k_min, k_max = torch.aminmax(tiles, dim=2)  # exact in the keys' own dtype
        return torch.cat([mean, k_min.float(), k_max.float()], dim=-1)
    t = tiles.float()
    mean = t.sum(dim=2) / valid.view(-1, 1, 1)  # padding slots are zero
    if kind == "mean":
        return mean
    slots = torch.arange(t.shape[2], device=t.device)
    pad = (slots.view(1, -1) >= valid.view(-1, 1)).view(t.shape[0], 1, t.shape[2], 1)
    k_min = t.masked_fill(pad, float("inf")).amin(dim=2)
    k_max = t.masked_fill(pad, float("-inf")).amax(dim=2)
    return torch.cat([mean, k_min, k_max], dim=-1)


@dataclass(frozen=True)
class StoreBytes:
    """Bytes a store allocates for one step: on the device, in host memory, and (offloaded) how many layers stay
    whole on the device. What the memory planner adds up, from the stores' own ``bytes_for``."""

    device: int
    host: int = 0
    resident_layers: int = 0
