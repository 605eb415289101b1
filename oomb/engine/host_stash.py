"""Tensors a step keeps from stage 1 for stage 2, in pinned host memory: copied out on a side stream as
stage 1 makes them, copied back one access ahead of stage 2's use.

Used for every decoder layer's input (``recompute="layer-host"``, oomb/engine/layer_recompute.py) and for
the attention outputs (``cache_attention="host"``). The buffer is one flat pinned allocation per model and
purpose, kept between steps as the paged store is (zeroing and pinning tens of GiB takes seconds), and
carved per step in the order tensors arrive: each tensor gets a contiguous region, so every copy is one
plain DMA transfer whatever the tensor's shape.

    stash = HostStash.for_model(model, "layer inputs", nbytes, device)
    stash.keep(key, x)             # stage 1: x (device) -> its region, on the side stream
    stash.prefetch(key)            # stage 2: start the copy back
    x = stash.take(key)            # the device tensor (waits for its copy); each key is taken once

On a CPU the buffer is ordinary memory and the copies are synchronous (the tests' path).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Hashable, Mapping, Sequence

import torch

from oomb.engine.sizes import itemsize

_ALIGN = 256  # bytes: every region starts aligned for any dtype and for DMA

# (model, purpose) -> (flat uint8 buffer, its copy stream); freed with the model or by release(model). One stream
# per buffer: every copy in or out of it, in any step, runs in order (a copy left in flight by a step that
# failed cannot land after the next step's copy into the same region).
_BUFFERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[torch.Tensor, torch.cuda.Stream | None]]] = (
    weakref.WeakKeyDictionary())


def chunk_lengths(chunks: Sequence[tuple[int, int]]) -> dict[int, int]:
    """How many of ``chunks`` ((start, end) each) have each length: what a stash's size depends on."""
    return dict(collections.Counter(end - start for start, end in chunks))


def chunk_lengths_of(seq_len: int, chunk_size: int, *, but_last: bool = False) -> dict[int, int]:
    """chunk_lengths of a sequence of ``seq_len`` split into chunks of ``chunk_size`` (the last one ragged),
    without listing them (the planner asks about sequences of up to 2^40 tokens); ``but_last``: all but the last."""
    full, last = divmod(seq_len, chunk_size)
    lengths = {chunk_size: full, last: 1} if last else {chunk_size: full}
    if but_last and seq_len > 0:
        lengths[last or chunk_size] -= 1
    return {length: count for length, count in lengths.items() if count > 0}


def region_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes one kept tensor of ``shape`` takes in a stash (its size rounded up to the alignment)."""
    n = torch.Size(shape).numel() * itemsize(dtype)
    return -(-n // _ALIGN) * _ALIGN


def release(model: torch.nn.Module) -> None:
    """Free every host buffer kept for ``model``."""
    _BUFFERS.pop(model, None)


def _buffer(model: torch.nn.Module, purpose: str, nbytes: int, device: torch.device, on_gpu: str | None
            ) -> tuple[torch.Tensor, torch.cuda.Stream | None]:
    kept = _BUFFERS.setdefault(model, {})
    found = kept.get(purpose)
    if found is not None and found[0].numel() >= nbytes:
        return found
    if found is not None and found[1] is not None:
        found[1].synchronize()  # nothing may still copy into the buffer that is about to be freed
    kept.pop(purpose, None)  # the old one goes before the larger one is allocated
    del found
    if device.type == "cuda":
        from oomb.offload.copy import pinned_empty

        instead = f"free host memory, or keep them on the GPU with {on_gpu}" if on_gpu else "free host memory"
        kept[purpose] = (pinned_empty((nbytes,), torch.uint8, what=f"the step's {purpose}", instead=instead),
                         torch.cuda.Stream(device))
    else:
        kept[purpose] = (torch.empty(nbytes, dtype=torch.uint8), None)
    return kept[purpose]


class HostStash:
    """Tensors by key in one host buffer (module docstring)."""

    def __init__(self, buffer: torch.Tensor, stream: torch.cuda.Stream | None, device: torch.device) -> None:
        self._buffer = buffer
        self._device = device
        self._stream = stream  # None: synchronous copies (a CPU run)
        self._used = 0
        # key -> (offset, shape, dtype, transposed): where the tensor lives and how to give it back
        self._where: dict[Hashable, tuple[int, torch.Size, torch.dtype, bool]] = {}
        self._fetched: dict[Hashable, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    @classmethod
    def for_model(cls, model: torch.nn.Module, purpose: str, nbytes: int, device: torch.device, *,
                  on_gpu: str | None = None) -> HostStash:
        """A stash of at least ``nbytes`` (sum of ``region_bytes``) in ``model``'s kept buffer for ``purpose``;
        ``on_gpu``: the setting that keeps these tensors on the GPU instead, named where the host cannot pin them."""
        return cls(*_buffer(model, purpose, max(nbytes, 1), device, on_gpu), device)

    def _region(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = shape.numel() * itemsize(dtype)
        return self._buffer[offset:offset + n].view(dtype).view(shape)

    def keep(self, key: Hashable, x: torch.Tensor) -> None:
        """Copy ``x`` out to a region of its own (stage 1); its device memory is not reused before the copy."""
        if key in self._where:
            raise KeyError(f"{key!r} is kept already")
        transposed = not x.is_contiguous() and x.dim() >= 3 and x.transpose(1, 2).is_contiguous()
        source = x.transpose(1, 2) if transposed else x  # e.g. attention outputs, [B, C, H, D] in memory
        if not source.is_contiguous():  # one DMA transfer needs one contiguous block
            source = source.contiguous()
        nbytes = region_bytes(tuple(source.shape), source.dtype)
        if self._used + nbytes > self._buffer.numel():
            raise RuntimeError(f"host stash full: {self._used + nbytes} bytes asked of {self._buffer.numel()} "
                               "(the step planned its size from its chunks)")
        offset, self._used = self._used, self._used + nbytes
        self._where[key] = (offset, source.shape, source.dtype, transposed)
        target = self._region(offset, source.shape, source.dtype)
        if self._stream is None:
            target.copy_(source)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._device))  # x is computed
        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=True)
        source.record_stream(self._stream)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._where

    def prefetch(self, key: Hashable) -> None:
        """Start copying ``key`` back to the device (stage 2); a key not kept, or already on its way, is skipped."""
        if key not in self._where or key in self._fetched:
            return
        offset, shape, dtype, _ = self._where[key]
        source = self._region(offset, shape, dtype)
        x = torch.empty(shape, dtype=dtype, device=self._device)
        if self._stream is None:
            self._fetched[key] = (x.copy_(source), None)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._device))  # x's memory is free to write
        with torch.cuda.stream(self._stream):
            x.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        x.record_stream(self._stream)  # a prefetch never taken (a step that failed) frees x only after its copy
        self._fetched[key] = (x, done)

    def take(self, key: Hashable) -> torch.Tensor:
        """``key``'s tensor on the device, as it was kept (waits for its copy); it is forgotten here."""
        self.prefetch(key)
        x, done = self._fetched.pop(key)
        transposed = self._where.pop(key)[3]
        if done is not None:
            torch.cuda.current_stream(self._device).wait_event(done)
        return x.transpose(1, 2) if transposed else x

    def forget(self, keep) -> None:
        """Drop every key for which ``keep(key)`` is false (its region is not reused before ``reset``)."""
        for key in [k for k in self._where if not keep(k)]:
            del self._where[key]
            self._fetched.pop(key, None)

    def reset(self) -> None:
        """Forget everything; the next step carves the buffer from its start."""
        self._where.clear()
        self._fetched.clear()
        self._used = 0


class HostAttentionCache:
    """``StepContext.attention_outputs`` in host memory (``cache_attention="host"``): (layer, chunk start) ->
    (out, lse), the mapping operations the attention layer and the step use. Taking a layer's outputs starts
    bringing the next layer's back, in the order stage 2 reads them (``step``: +1 when a chunk's recompute runs
    the layers forward, -1 when the backward rebuilds them last to first, recompute="layer")."""

    def __init__(self, stash: HostStash, step: int = 1) -> None:
        self._stash = stash
        self._keys: set[tuple[int, int]] = set()
        self.step = step

    @classmethod
    def on_host(cls, model: torch.nn.Module, layers: list[tuple[int, int]], chunks: list[tuple[int, int]], batch: int,
                dtype: torch.dtype, device: torch.device, step: int = 1) -> HostAttentionCache:
        """The cache of a step over ``chunks``, in ``model``'s kept host buffer for attention outputs; ``layers``:
        (query heads, value head size) of each attention layer (store layer)."""
        nbytes = cls.nbytes(layers, chunk_lengths(chunks), batch, dtype)
        return cls(HostStash.for_model(model, "attention outputs", nbytes, device,
                                       on_gpu="cache_attention=True (train.cache_attention=true) or False"), step)

    @staticmethod
    def nbytes(layers: list[tuple[int, int]], lengths: Mapping[int, int], batch: int, dtype: torch.dtype) -> int:
        """Host bytes for every chunk's and layer's out [B, H, C, D_v] (``dtype``) and lse [B, H, C] (float32);
        ``layers``: (H, D_v) of each attention layer; ``lengths``: chunk_lengths of the chunks."""
        return sum(count * (region_bytes((batch, heads, length, value_dim), dtype)
                            + region_bytes((batch, heads, length), torch.float32))
                   for length, count in lengths.items() for heads, value_dim in layers)

    def __setitem__(self, key: tuple[int, int], value: tuple[torch.Tensor, torch.Tensor]) -> None:
        out, lse = value
        self._stash.keep((key, "out"), out)
        self._stash.keep((key, "lse"), lse)
        self._keys.add(key)

    def prefetch(self, key: tuple[int, int]) -> None:
        if key in self._keys:
            self._stash.prefetch((key, "out"))
            self._stash.prefetch((key, "lse"))

    def pop(self, key: tuple[int, int], default=None):
        if key not in self._keys:
            return default
        self._keys.remove(key)
        found = self._stash.take((key, "out")), self._stash.take((key, "lse"))
        self.prefetch((key[0] + self.step, key[1]))
        return found

    def __iter__(self):
        return iter(list(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def __delitem__(self, key: tuple[int, int]) -> None:
        self._keys.remove(key)
        self._stash.forget(lambda k: k[0] != key)

