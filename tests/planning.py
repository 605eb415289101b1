"""The planner called with one flat set of names, as the tests state settings: each name routed to the StepOptions,
RunShape or MemoryLimits field it is (the selection's to a PageSelection), then oomb.planning.plan's functions."""

from __future__ import annotations

import dataclasses

from oomb.engine import MemoryLimits, RunShape, StepOptions
from oomb.engine.options import with_changes
from oomb.planning.plan import largest_context, plan_first_fitting, plan_memory
from oomb.sparse import PageSelection

_SELECTION = {"page_budget": "page_budget", "select_block": "block", "per_head_selection": "per_head",
              "select_score": "score", "chunk_pages": "chunk_pages"}
_LIMITS = {"device_total_bytes": "gpu_bytes", "host_total_bytes": "host_bytes"}
_OPTIONS = {f.name for f in dataclasses.fields(StepOptions)}


def split(**flat):
    """(StepOptions, RunShape, MemoryLimits, the offload allowance) of flat settings; ``attention`` is the
    backend (default "triton": no FlashAttention-4 workspace planned)."""
    limits = MemoryLimits(**{_LIMITS[k]: flat.pop(k) for k in list(flat) if k in _LIMITS})
    selection = {_SELECTION[k]: flat.pop(k) for k in list(flat) if k in _SELECTION}
    allowance = flat.pop("offload_gpu_bytes", None)
    options = {k: flat.pop(k) for k in list(flat) if k in _OPTIONS}
    options["backend"] = flat.pop("attention", options.get("backend", "triton"))
    if selection.get("page_budget") is not None:
        options["selection"] = PageSelection(**selection)
    return StepOptions(**options), RunShape(**flat), limits, allowance


def plan_of(config, **flat):
    options, shape, limits, allowance = split(**flat)
    return plan_memory(config, options, shape, limits, offload_gpu_bytes=allowance)


def longest_of(config, choices=({},), **flat):
    flat.setdefault("seq_len", 1)
    options, shape, limits, allowance = split(**flat)
    return largest_context(config, options, shape, limits, choices=_choices(choices), offload_gpu_bytes=allowance)


def first_fitting(config, choices, **flat):
    options, shape, limits, allowance = split(**flat)
    return plan_first_fitting(config, options, shape, limits, choices=_choices(choices), offload_gpu_bytes=allowance)


def _choices(choices):
    """Choices in the planner's field names (a selection's fields are not among the tests' choices)."""
    return [{_LIMITS.get(k, k): v for k, v in choice.items()} for choice in choices]


def plan_run(config, planned, gpu_bytes=None, host_bytes=None, **change):
    """The plan of a run's step as ``oomb train`` plans it (``planned``: oomb.train.loop.memory.planned_step), with
    ``change``'s StepOptions or RunShape fields replaced."""
    options, shape, allowance = planned
    options, shape = with_changes(options, shape, change)
    return plan_memory(config, options, shape, MemoryLimits(gpu_bytes, host_bytes), offload_gpu_bytes=allowance)


def longest_run(config, planned, choices, gpu_bytes=None, host_bytes=None):
    """largest_context of a run's step as ``oomb train`` plans it, over ``choices``."""
    options, shape, allowance = planned
    return largest_context(config, options, shape, MemoryLimits(gpu_bytes, host_bytes), choices=choices,
                           offload_gpu_bytes=allowance)
