"""Run `oomb train` in this process with one fault injected (tests only; the product has no fault hooks).

    python tests/faults/inject.py FAULT [oomb train arguments ...]

FAULT_STEP (1-based) is the step the fault hits; FAULT_BATCH (1-based, default 1) which of
its train.grad_accum batches the slow-chunk and out-of-memory faults hit; FAULT_MARKER, a
file created when the fault point is reached (so a test knows when to send its signal).

    slow-chunk      chunk 1 of step FAULT_STEP sleeps 1.5 s in layer 0 (a signal lands mid-step)
    slow-save       the save of checkpoint FAULT_STEP sleeps 1.5 s after its first file
    oom-cuda        layer 0 raises torch.OutOfMemoryError in the backward stage of step FAULT_STEP
    oom-host        layer 0 asks the CPU allocator for 32 TiB (a real failed allocation)
    memoryerror     layer 0 asks Python for 32 TiB (a real MemoryError)
    oom-optimizer   AdamW.step raises torch.OutOfMemoryError in step FAULT_STEP
    nan             layer 0's output gets an inf in chunk 1 of step FAULT_STEP (forward and diagnosis)
    enospc          writing optimizer.pt of checkpoint FAULT_STEP writes half, then raises ENOSPC
    eacces          writing model.safetensors of checkpoint FAULT_STEP raises EACCES
"""

from __future__ import annotations

import errno
import functools
import io
import os
import sys
import time
from pathlib import Path

import torch

import oomb
import oomb.train.checkpoint as checkpoint
import oomb.train.inputs as inputs
import oomb.train.trainer as trainer
from oomb.cli import main

FAULT, ARGS = sys.argv[1], sys.argv[2:]
STEP = int(os.environ.get("FAULT_STEP", "0"))
BATCH = int(os.environ.get("FAULT_BATCH", "1"))
MARKER = Path(os.environ.get("FAULT_MARKER", os.devnull))
CHUNK1_START = 256  # the tests run seq_len 512 in chunks of 256
current_step = [0]  # 1-based step whose batches the trainer asked for last
current_batch = [0]  # 1-based: which of that step's batches chunked_backward runs


def _tracking(batches):
    def tracked(self, step):
        current_step[0], current_batch[0] = step + 1, 0
        return batches(self, step)

    return tracked


for _kind in (inputs.SyntheticInputs, inputs.TextInputs):
    _kind.batches = _tracking(_kind.batches)

_chunked_backward = oomb.chunked_backward


@functools.wraps(_chunked_backward)  # keeps its signature (the trainer checks for doc_ids)
def chunked_backward(*args, **kwargs):
    current_batch[0] += 1
    return _chunked_backward(*args, **kwargs)


oomb.chunked_backward = chunked_backward


def layer0_fault(module, args, kwargs, output):
    positions = kwargs.get("position_ids")
    if current_step[0] != STEP or positions is None or int(positions[0, 0]) != CHUNK1_START:
        return None
    if FAULT != "nan" and current_batch[0] != BATCH:  # the diagnosis of a nan runs outside chunked_backward
        return None
    if FAULT == "slow-chunk":
        MARKER.touch()
        time.sleep(1.5)
    elif FAULT == "nan":
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        hidden[:, 5] = float("inf")
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
    elif torch.is_grad_enabled():  # stage 2 (the backward stage): the step's memory peak
        MARKER.touch()
        if FAULT == "oom-cuda":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                         "capacity of 139.81 GiB of which 1.20 GiB is free.")
        if FAULT == "oom-host":
            torch.empty(2**45, dtype=torch.uint8)
        if FAULT == "memoryerror":
            bytearray(2**45)
    return None


_build = trainer.build


def build(cfg, device, dtype):
    model = _build(cfg, device, dtype)
    if FAULT in ("slow-chunk", "nan", "oom-cuda", "oom-host", "memoryerror"):
        model.model.layers[0].register_forward_hook(layer0_fault, with_kwargs=True)
    return model


trainer.build = build

if FAULT == "oom-optimizer":
    _adamw_step = torch.optim.AdamW.step

    def adamw_step(self, *a, **k):
        if current_step[0] == STEP:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return _adamw_step(self, *a, **k)

    torch.optim.AdamW.step = adamw_step


def _in_checkpoint(path) -> bool:
    return Path(path).parent.name == f"step-{STEP:08d}.tmp"


if FAULT == "slow-save":
    _fsync = checkpoint._fsync_file

    def slow_fsync(path):
        if _in_checkpoint(path) and not MARKER.exists():
            MARKER.touch()
            time.sleep(1.5)
        return _fsync(path)

    checkpoint._fsync_file = slow_fsync

if FAULT == "enospc":
    _save = torch.save

    def full_disk_save(obj, f, *a, **k):
        if isinstance(f, str | Path) and _in_checkpoint(f) and Path(f).name == "optimizer.pt":
            buffer = io.BytesIO()
            _save(obj, buffer, *a, **k)
            Path(f).write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return _save(obj, f, *a, **k)

    checkpoint.torch.save = full_disk_save

if FAULT == "eacces":
    _save_file = checkpoint.save_file

    def denied_save_file(tensors, filename, *a, **k):
        if _in_checkpoint(filename):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(filename))
        return _save_file(tensors, filename, *a, **k)

    checkpoint.save_file = denied_save_file

sys.exit(main(["train", *ARGS]))
