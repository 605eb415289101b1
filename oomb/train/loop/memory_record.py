"""train.memory_snapshot=N: the GPU allocator's record of the first N steps, and what was alive at its peak.

A run's GPU peak is one number (``peak_gpu_gib`` in metrics.jsonl); when it is more than the memory plan said, or
a step runs out of memory, the question is which tensors made it. PyTorch's allocator can record every allocation
and free with the Python stack that made it (``torch.cuda.memory._record_memory_history``; its documentation,
"Understanding CUDA Memory Usage"). With this setting the record starts before the model is built and ends after
step N (or when a step runs out of memory), and two files go into the run folder:

    memory_snapshot.pickle  the record, for https://pytorch.org/memory_viz (drop the file on the page; nothing is
                            uploaded): every allocation over time with its stack
    memory_peak.json        the allocations alive at the record's peak, summed by the code that made them: the
                            innermost oomb frame of each stack ("site") and the innermost frame outside torch
                            ("via": transformers, peft, liger, bitsandbytes, ... where that is another), largest
                            first, beside the memory plan's GPU items (oomb plan's table)

The allocator's ``allocated`` count (``torch.cuda.max_memory_allocated``) goes up at each allocation and down when
a tensor is freed ("free_requested": a block a side stream still uses returns to the pool later, but no longer
counts), so replaying those two events gives the count over time and the set alive at its peak. Record sizes are
the tensors' own (not rounded to the allocator's blocks), so the replayed peak is a little under the allocator's.

Recording costs a few microseconds an allocation and host memory for the record (``MAX_ENTRIES`` events at most;
an older event is dropped first, and what was allocated before the oldest one kept is reported as such). Only the
main rank records (its GPU).
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import defaultdict
from pathlib import Path

import torch

from oomb.train.config.settings import Config, ConfigError
from oomb.train.runfolder.runfiles import write_text_atomic

SNAPSHOT = "memory_snapshot.pickle"
PEAK = "memory_peak.json"
# Events the record keeps: a 7B model's step at 128K makes about 10^5 allocations; two steps and the model's build
# fit with room to spare, in about a GiB of host memory for the stacks.
MAX_ENTRIES = 2_000_000
SITES_SHOWN = 40  # rows of memory_peak.json's table (the rest summed in one row)
GIB = 2**30

# Frames that say nothing about which tensor it is: torch's own Python, the standard library's plumbing.
_PLUMBING = re.compile(r"(/torch/|/contextlib\.py$|/functools\.py$|^<frozen |/threading\.py$|/runpy\.py$)")
_OOMB = re.compile(r"(?:^|/)(oomb/[^/].*)$")
_PACKAGE = re.compile(r"/(?:site|dist)-packages/(.+)$")


def check_memory_snapshot(cfg: Config, device: torch.device) -> None:
    """Refuse train.memory_snapshot where there is nothing to record, before the run folder opens."""
    steps = cfg.train.memory_snapshot
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"train.memory_snapshot={steps!r}: the number of steps to record (0: no record)")
    if steps and device.type != "cuda":
        raise ConfigError(f"train.memory_snapshot={steps} records the CUDA allocator, and this run is on "
                          f"{device.type}: set train.memory_snapshot=0")


class MemoryRecord:
    """The record of one run (module docstring): ``start()`` before the model is built, ``after_step(n)`` after
    each step, ``stop(reason)`` where the run stops early (out of memory); each returns the line to print, if any."""

    def __init__(self, steps: int, out: Path, device: torch.device, plan_items: dict[str, int] | None = None
                 ) -> None:
        self.steps, self.out, self.device = steps, out, device
        self.plan_items = plan_items or {}
        self.recording = False

    def start(self) -> None:
        if self.steps:
            # Stacks of allocations only ("alloc"): what made a tensor is what the summary and the viewer show.
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=MAX_ENTRIES, device=self.device)
            self.recording = True

    def after_step(self, steps_done: int, last: bool) -> str | None:
        if not self.recording or (steps_done < self.steps and not last):
            return None
        return self.stop(f"after step {steps_done}")

    def discard(self) -> None:
        """End a record that is still on without writing it (a run stopped early by something else)."""
        if self.recording:
            self.recording = False
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)

    def stop(self, when: str) -> str | None:
        """Write the two files and end the record; the line that says where they are and what led the peak."""
        if not self.recording:
            return None
        self.recording = False
        try:
            snapshot = torch.cuda.memory._snapshot(self.device)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        summary = peak_allocations(snapshot, index, self.plan_items)
        summary.update(recorded=when, max_memory_allocated_gib=round(torch.cuda.max_memory_allocated(self.device)
                                                                     / GIB, 4))
        tmp = self.out / (SNAPSHOT + ".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(snapshot, f)
        os.replace(tmp, self.out / SNAPSHOT)
        write_text_atomic(self.out / PEAK, json.dumps(summary, indent=1) + "\n")
        return describe(summary, self.out)


def peak_allocations(snapshot: dict, device_index: int, plan_items: dict[str, int] | None = None) -> dict:
    """What was alive at the peak of ``snapshot``'s record on one device (torch.cuda.memory._snapshot's dict):
    the peak, when it came, and the live allocations summed by site (module docstring)."""
    trace = snapshot["device_traces"][device_index] if device_index < len(snapshot["device_traces"]) else []
    # Replay 1: the allocated count, relative to where the record starts, and where it peaks.
    total = peak = 0
    peak_at = -1
    for i, event in enumerate(trace):
        total += _change(event)
        if total > peak:
            peak, peak_at = total, i
    alive_now = sum(block.get("requested_size", block["size"]) for segment in snapshot["segments"]
                    if segment.get("device", device_index) == device_index
                    for block in segment["blocks"] if block["state"] == "active_allocated")
    before = alive_now - total  # allocated before the record's first event
    # Replay 2: the allocations made within the record and alive at its peak.
    alive: dict[int, dict] = {}
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == "free_requested":
            alive.pop(event["addr"], None)
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for event in alive.values():
        groups[site_of(event.get("frames", []))].append(event["size"])
    rows = sorted(({"site": site, "via": via, "gib": sum(sizes) / GIB, "tensors": len(sizes),
                    "largest_mib": [round(s / 2**20, 2) for s in sorted(sizes, reverse=True)[:3]]}
                   for (site, via), sizes in groups.items()), key=lambda row: -row["gib"])
    rest = rows[SITES_SHOWN:]
    rows = rows[:SITES_SHOWN] + ([{"site": f"{len(rest)} other sites", "via": "", "gib": sum(r["gib"] for r in rest),
                                   "tensors": sum(r["tensors"] for r in rest), "largest_mib": []}] if rest else [])
    earlier = before + peak - sum(event["size"] for event in alive.values())  # alive at the peak, made before it
    if earlier > 0:
        rows.append({"site": "allocated before the record's first event (the model's build, where the record "
                             "filled up and dropped its oldest events)", "via": "", "gib": earlier / GIB,
                     "tensors": None, "largest_mib": []})
    for row in rows:
        row["gib"] = round(row["gib"], 4)
    out_of_memory = [event for event in trace if event["action"] == "oom"]
    return {
        "peak_gib": round((before + peak) / GIB, 4),
        "peak_event": peak_at,
        "events": len(trace),
        "record_full": len(trace) >= MAX_ENTRIES,
        "out_of_memory_asked_gib": round(out_of_memory[-1]["size"] / GIB, 4) if out_of_memory else None,
        "sites": rows,
        "plan_gpu_gib": {name: round(nbytes / GIB, 4) for name, nbytes in (plan_items or {}).items()},
    }


def _change(event: dict) -> int:
    """How an event moves the allocator's allocated count."""
    if event["action"] == "alloc":
        return event["size"]
    if event["action"] == "free_requested":
        return -event["size"]
    return 0


def site_of(frames: list[dict]) -> tuple[str, str]:
    """(site, via) of a stack, innermost frame first as the record gives it: the innermost oomb frame, and the
    innermost frame that is neither torch's nor plumbing where it is another (module docstring)."""
    own = next((f for f in frames if _OOMB.search(f["filename"])), None)
    outside = next((f for f in frames if not _PLUMBING.search(f["filename"])), None)
    if own is None:
        return (_frame_text(outside) if outside else (_frame_text(frames[0]) if frames else "no stack"), "")
    return _frame_text(own), ("" if outside is own or outside is None else _frame_text(outside))


def _frame_text(frame: dict) -> str:
    name = frame["filename"]
    short = _OOMB.search(name) or _PACKAGE.search(name)
    return f"{short.group(1) if short else name}:{frame['line']} {frame['name']}"


def describe(summary: dict, out: Path) -> str:
    """The console line: where the files are, the peak, and its three largest sites."""
    top = ", ".join(f"{row['site']}{' via ' + row['via'] if row['via'] else ''} {row['gib']:.2f} GiB"
                    for row in summary["sites"][:3])
    return (f"memory record ({summary['recorded']}): {out / SNAPSHOT} (open it on https://pytorch.org/memory_viz) "
            f"and {out / PEAK}: {summary['peak_gib']:.2f} GiB allocated at its peak; largest: {top}")
