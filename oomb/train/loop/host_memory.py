"""The memory a run's plan is checked against: the GPU's free bytes, the host's, and what the process that will
train already holds (its resident memory, measured).

The host check of the process that will train (``oomb train``, and ``oomb plan`` of this machine) is::

    the plan's items + this process's resident memory (RSS, measured)  <=  the host's free memory + that RSS

so a run needs what its plan adds beyond what the process holds at the check (interpreter, torch, the data
read). A plan for another machine's host (``oomb plan --host-memory``), or of memory given as a plain pair,
counts the flat HOST_PROCESS_BYTES allowance (oomb.planning.plan) for the process instead: nothing there was
measured. A flat 4 GiB refused the 0.5 GiB demo on a machine with 3 GiB free.
"""

from __future__ import annotations

import os

import psutil
import torch

from oomb.engine.options import MemoryLimits
from oomb.planning.plan import CUDA_CONTEXT_BYTES, MeasuredLimits, MemoryPlan
from oomb.planning.plan import format_bytes as _gib
from oomb.train.config.step import gpu_memory_cap

__all__ = ["Measured", "available_memory", "cap_gpu_allocator", "host_shortfall", "memory_limits", "process_bytes"]


class Measured(tuple):
    """available_memory's pair (GPU bytes or None, host bytes), which unpacks as one, and ``process``: the resident
    bytes of this process, measured with it."""

    process: int | None = None


def available_memory(device: torch.device) -> tuple[int | None, int]:
    """(GPU bytes free for this run or None off CUDA, host bytes available to this process: the host's free memory
    and this process's resident memory), a Measured pair whose ``process`` is that resident memory, measured after
    the GPU's context exists (its host memory is counted there)."""
    gpu = None
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        gpu = free + torch.cuda.memory_reserved(device)
    rss = psutil.Process(os.getpid()).memory_info().rss
    found = Measured((gpu, psutil.virtual_memory().available + rss))
    found.process = rss
    return found


def cap_gpu_allocator(cfg, device: torch.device) -> float | None:
    """Hold the CUDA caching allocator to train.gpu_memory less the plan's CUDA context allowance
    (set_per_process_memory_fraction: past it an allocation fails as out of memory, which the run reports, instead
    of taking the rest of the card), so the process with its context stays within the number the user gave, as the
    plan counted it; the fraction set, or None where there is no cap (auto, or not CUDA)."""
    cap = gpu_memory_cap(cfg)
    if cap is None or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()  # it takes no bare "cuda"
    fraction = min(1.0, max(0, cap - CUDA_CONTEXT_BYTES) / torch.cuda.get_device_properties(index).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def process_bytes(available) -> int | None:
    """The resident bytes ``available`` (available_memory's answer) was measured with; None for a plain pair."""
    return getattr(available, "process", None)


def memory_limits(gpu_bytes: int | None, host_bytes: int | None, process: int | None = None) -> MemoryLimits:
    """The limits a plan is checked against: MeasuredLimits where ``process`` (this process's resident memory) was
    measured, so the plan's "process" item is that; else MemoryLimits (the flat HOST_PROCESS_BYTES allowance)."""
    if process is None:
        return MemoryLimits(gpu_bytes=gpu_bytes, host_bytes=host_bytes)
    return MeasuredLimits(gpu_bytes=gpu_bytes, host_bytes=host_bytes, process_bytes=process)


def host_shortfall(plan: MemoryPlan, host: int, process: int | None) -> str:
    """What a plan whose host items do not fit needs, for the refusal: beyond what the process holds where that was
    measured, else all of it against the host memory given."""
    if process is None:
        return f"{_gib(plan.host_bytes)} of host memory but {_gib(host)} is available"
    return (f"{_gib(plan.host_bytes - process)} of host memory besides the {_gib(process)} this process holds, but "
            f"{_gib(max(0, host - process))} is free")
