"""The chunks train.chunk_size=auto may take, longest first, and the whole sequence as one chunk: the
chunk half of `oomb.train.loop.memory.auto_choices` (which orders them with the recompute and cache settings)."""

from __future__ import annotations

from oomb.train.config.settings import Config

# train.chunk_size=auto tries chunks from this size down, halving: on the GPU a longer chunk runs faster (fewer,
# longer kernels; docs/benchmarks.md). On CPU from 1024, the fixed default before auto, so the CPU runs (the
# built-in tiny job) keep their speed and losses.
AUTO_CHUNK_START = {"cuda": 8192, "cpu": 1024}
# With train.recompute=layer-host a chunk's activations are one layer's, so chunks twice as long fit where 8192
# did with every layer's: fewer, larger matrix products (H200, Qwen2.5-7B, 128K: 0.92x the best transformers
# stack's step with chunks of 16384, docs/benchmarks.md).
LAYER_AUTO_CHUNK_START = 16384
# The smallest automatic chunk tried with the attention cache before the largest chunk without it. The cache
# and long chunks each speed a step up (H200, Qwen2.5-7B: docs/benchmarks.md, "chunked_backward's defaults" and
# "Chunks of 8192 tokens instead of 4096"). Cached chunks below 1024 against long uncached ones were not measured: they
# run many more, smaller kernels per step, so the long chunk is preferred there.
CACHE_MIN_CHUNK = 1024
# With offload, whole-chunk recompute's chunks of this size or more come before layer-host (auto_choices).
OFFLOAD_CHUNK_FLOOR = 8192


def chunk_choices(cfg: Config, device_type: str, seq_len: int | None = None, start: int | None = None) -> list[int]:
    """The chunk sizes train.chunk_size=auto tries, largest first: halvings of ``start`` (default
    AUTO_CHUNK_START) as multiples of train.page_size, none longer than ``seq_len`` rounded up to a whole page."""
    page = cfg.train.page_size
    top = start or AUTO_CHUNK_START["cuda" if device_type == "cuda" else "cpu"]
    if seq_len is not None:
        top = min(top, _whole_pages(seq_len, page))
    sizes, size = [], top
    while True:
        chunk = max(page, size // page * page)
        if chunk not in sizes:
            sizes.append(chunk)
        if chunk == page:
            return sizes
        size //= 2


def whole_sequence_chunk(cfg: Config, device_type: str, seq_len: int | None) -> int | None:
    """The chunk that holds the whole sequence, run with whole-chunk recompute, where the run's settings allow it (on
    a GPU; None elsewhere): the fastest step there is wherever all its activations fit. Stage 1 runs every chunk but
    the last, so one chunk is a plain forward and backward, no layer computed twice; recompute=layer-host runs every
    layer's forward twice (stage 1 keeps the layer inputs, stage 2 rebuilds each layer): half as much again of a
    LoRA step's matrix work (no weight gradients), a third more of a full fine-tune's. On a CPU the chunks stay as
    chunk_choices gives them (the built-in tiny job keeps its chunks and losses)."""
    t = cfg.train
    if seq_len is None or device_type != "cuda" or t.recompute not in ("auto", "chunk"):
        return None
    if t.chunk_size == "auto":
        return _whole_pages(seq_len, t.page_size)
    return t.chunk_size if t.chunk_size >= seq_len else None


def computes_each_layer_once(recompute: str, chunk_size, seq_len: int) -> bool:
    """Whether a step of ``seq_len`` tokens runs as one chunk with whole-chunk recompute (``recompute`` "auto" runs
    so where no plan settled it): stage 1 has nothing to fill, so no layer is computed twice."""
    return isinstance(chunk_size, int) and chunk_size >= seq_len and recompute in ("chunk", "auto")


def _whole_pages(tokens: int, page: int) -> int:
    """``tokens`` rounded up to a whole page."""
    return -(-tokens // page) * page
