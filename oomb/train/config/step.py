"""The step's settings as a run's config gives them: the StepOptions of its steps (step_options) and what
that takes from ``train.*`` (the page selection, the chunk size where no plan settles it, the offloaded
store's GPU allowance)."""

from __future__ import annotations

import re

from oomb.engine import StepOptions
from oomb.planning.plan import format_bytes
from oomb.sparse import DEFAULT_SCORE, PageSelection
from oomb.train.config.settings import Config, ConfigError


def page_selection(cfg: Config) -> PageSelection | None:
    """The run's page-sparse attention policy (None = dense), checked; raises ConfigError."""
    t = cfg.train
    if t.page_budget is None:
        unused = [f"train.{name}" for name, default in (("select_block", 128), ("sink_pages", 0),
                                                        ("local_pages", 0), ("select_per_head", False),
                                                        ("select_score", DEFAULT_SCORE), ("chunk_pages", "auto"))
                  if getattr(t, name) != default]
        if unused:
            raise ConfigError(f"{', '.join(unused)} only apply to page-sparse attention: set train.page_budget "
                              "(e.g. 64), or leave them at their defaults for dense attention")
        return None
    chunk_pages = settled_chunk_pages(cfg)
    try:
        return PageSelection(page_budget=t.page_budget, block=t.select_block, sink_pages=t.sink_pages,
                             local_pages=t.local_pages, per_head=t.select_per_head, score=t.select_score,
                             chunk_pages=chunk_pages)
    except ValueError as e:
        raise ConfigError(f"train.page_budget / select_block / sink_pages / local_pages / select_score / "
                          f"chunk_pages: {e}") from e


def settled_chunk_pages(cfg: Config) -> int | None:
    """train.chunk_pages as the selection runs it: auto is train.page_budget, with and without offload (sparse
    training with the cap learns the retrieval study's task as free blocks do, and a 128K step of Qwen2.5-7B is
    3-4% faster than with free blocks, docs/sparse.md); None for dense attention."""
    t = cfg.train
    if t.page_budget is None:
        return None
    if isinstance(t.chunk_pages, str) and t.chunk_pages != "auto":
        raise ConfigError(f"train.chunk_pages={t.chunk_pages!r}: use auto, null (no cap) or a number of pages "
                          f"of at least train.page_budget ({t.page_budget})")
    return chunk_pages_cap(t.chunk_pages, t.page_budget)


def chunk_pages_cap(chunk_pages: int | str | None, page_budget: int) -> int | None:
    """PageSelection.chunk_pages of a chunk_pages setting: auto is the page budget (training's default, and oomb
    eval's), None no cap, a number itself."""
    return page_budget if chunk_pages == "auto" else chunk_pages


def offload_selection_note(cfg: Config) -> str | None:
    """Advice for page-sparse attention with offload and a selection block smaller than the chunk.

    Each block's page list is moved to the GPU; the union of a chunk's lists is most of the past at
    long contexts, so small blocks move several times the bytes of one list per chunk (measured on
    the H200, docs/offload.md). Not changed for the user: the block decides which pages are attended.
    """
    t = cfg.train
    chunk = settled_chunk_size(cfg)
    if not t.offload or t.page_budget is None or t.select_block >= chunk or settled_chunk_pages(cfg) is not None:
        return None
    return (f"train.offload with train.chunk_pages=null and train.select_block={t.select_block} below "
            f"train.chunk_size={chunk}: each block of {t.select_block} queries picks its own {t.page_budget} pages "
            "and their union crosses to the GPU for every layer and chunk. train.chunk_pages=auto (at most "
            f"{t.page_budget} pages a chunk) moves far less (Qwen2.5-7B, 128K tokens, H200: +4.8% against +29.9% "
            "step time over no offload, docs/offload.md); it also changes which pages are attended")


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'141GiB', '80 GB', '1.5TiB', '150e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{text!r} is not a memory size; write e.g. 141GiB, 80GB or 150e9")
    return int(float(match.group(1)) * _UNITS[unit])


def offload_gpu_bytes(value: str) -> int | str:
    """train.offload_gpu_memory as plan_memory's offload_gpu_bytes: "auto" or a byte count."""
    return "auto" if str(value).strip().lower() == "auto" else parse_bytes(str(value))


def gpu_memory_cap(cfg: Config) -> int | None:
    """train.gpu_memory as a byte count; None for auto (the GPU's free memory)."""
    value = str(cfg.train.gpu_memory).strip()
    return None if value.lower() == "auto" else parse_bytes(value)


def capped_gpu_bytes(gpu_bytes: int | None, cfg: Config) -> int | None:
    """The GPU memory a plan may use: ``gpu_bytes`` (free or given), at most train.gpu_memory."""
    cap = gpu_memory_cap(cfg)
    return gpu_bytes if cap is None or gpu_bytes is None else min(gpu_bytes, cap)


def gpu_memory_source(given: str | None, device, cfg: Config) -> str:
    """Where the GPU memory a plan was checked against came from, as `oomb plan` prints it."""
    source = "--gpu-memory" if given is not None else f"free on {device}"
    return source if gpu_memory_cap(cfg) is None else f"{source}, at most train.gpu_memory={cfg.train.gpu_memory}"


def gpu_room(device, gpu_bytes: int, cfg: Config) -> str:
    """The GPU memory a refused plan had, as the refusal says it: what is free, or what train.gpu_memory allows."""
    if gpu_bytes == gpu_memory_cap(cfg):  # the cap, not the free memory, limited the plan
        return f"train.gpu_memory={cfg.train.gpu_memory} allows {format_bytes(gpu_bytes)}"
    return f"{device} has {format_bytes(gpu_bytes)} free"


def offload_gpu_allowance(cfg: Config) -> int:
    """train.offload_gpu_memory as the memory plan settled it (0 without offload or where never settled)."""
    value = offload_gpu_bytes(cfg.train.offload_gpu_memory)
    return value if cfg.train.offload and value != "auto" else 0


# train.chunk_size=auto where no memory plan settles it (train.memory_check=false): small enough for any
# GPU that holds the model.
UNPLANNED_CHUNK_SIZE = 1024


def settled_chunk_size(cfg: Config) -> int:
    """train.chunk_size as the step runs it: the number, or where "auto" was never settled by a memory
    plan, the largest multiple of train.page_size up to UNPLANNED_CHUNK_SIZE (at least one page)."""
    t = cfg.train
    if t.chunk_size != "auto":
        return t.chunk_size
    return max(t.page_size, UNPLANNED_CHUNK_SIZE // t.page_size * t.page_size)


def step_options(cfg: Config) -> StepOptions:
    """The engine's options of this run's steps: chunked_backward's, and the NaN locator's after a
    non-finite step (it then runs the step's chunks, store and page selection)."""
    t = cfg.train
    return StepOptions(chunk_size=settled_chunk_size(cfg), page_size=t.page_size, selection=page_selection(cfg),
                       offload=t.offload, offload_gpu_bytes=offload_gpu_allowance(cfg),
                       cache_attention=t.cache_attention if t.cache_attention in (True, "host") else False,
                       recompute="chunk" if t.recompute == "auto" else t.recompute, backend=t.attention)
