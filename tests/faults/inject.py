"""Run `oomb train` in this process with one fault injected (tests only; the product has no fault hooks).

    python tests/faults/inject.py FAULT [oomb train arguments ...]

FAULT_STEP (1-based) is the step the fault hits; FAULT_BATCH (1-based, default 1) which of
its train.grad_accum batches the slow-chunk and out-of-memory faults hit; FAULT_MARKER, a
file created when the fault point is reached (so a test knows when to send its signal), and
FAULT_MARKER.signalled once oomb's handler has taken the run's first SIGINT/SIGTERM. The faults that
wait for a test's signal wait for it, not for a time: PAUSE only ends a process whose test is gone.

    slow-chunk      chunk 1 of step FAULT_STEP waits in layer 0 until oomb's handler took a signal (a signal
                    lands mid-step)
    slow-save       the save of checkpoint FAULT_STEP pauses after its first file (a second signal kills it there)
    oom-cuda        layer 0 raises torch.OutOfMemoryError in the backward stage of step FAULT_STEP
    oom-host        layer 0 asks the CPU allocator for 32 TiB (a real failed allocation)
    memoryerror     layer 0 asks Python for 32 TiB (a real MemoryError)
    oom-optimizer   AdamW.step raises torch.OutOfMemoryError in step FAULT_STEP
    poison-update   AdamW.step of step FAULT_STEP leaves an inf in the first weight (finite gradients)
    slow-build      building the model pauses after touching FAULT_MARKER (Ctrl-C before the first step)
    slow-data       reading the data pauses after touching FAULT_MARKER (Ctrl-C before the run folder is made)
    crash           layer 0 raises a RuntimeError (an error oomb does not expect) in the backward stage of step
                    FAULT_STEP
    nan             layer 0's output gets an inf in chunk 1 of step FAULT_STEP (forward and diagnosis)
    full:WHAT       just before WHAT is written, fill the (small, test-mounted) file system FAULT_DISK holding
                    the run: the write then fails for real (ENOSPC from the kernel). WHAT: lock, inputs, config,
                    metrics (step FAULT_STEP's line), a checkpoint file of step FAULT_STEP (model.safetensors,
                    optimizer.pt, rng.pt, state.json, manifest.json, latest), export, plot, tensorboard,
                    rollback (a resumed run's metrics and config)
                    (its event file); plot and tensorboard get the room back after their write failed
    readonly:WHAT   the same point, but the file system is remounted read-only (EROFS)
    pause:WHAT      in checkpoint FAULT_STEP's write, just before WHAT is written (model.safetensors, optimizer.pt,
                    rng.pt, state.json, manifest.json), just after the folder is renamed into place (publish),
                    or once latest.tmp is written but not renamed (latest): touch FAULT_MARKER and pause, for
                    a kill -9
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import time
from pathlib import Path

import torch

import oomb
import oomb.train.data.inputs as inputs
import oomb.train.loop.faults as faults
import oomb.train.loop.monitor as monitor
import oomb.train.loop.run as run_module
import oomb.train.loop.trainer as trainer
import oomb.train.runfolder.checkpoint as checkpoint
import oomb.train.runfolder.rundir as rundir
import oomb.train.runfolder.runfiles as runfiles
from oomb.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faultrun import fill_disk  # noqa: E402  (this script runs from anywhere)

FAULT, ARGS = sys.argv[1], sys.argv[2:]
STEP = int(os.environ.get("FAULT_STEP", "0"))
BATCH = int(os.environ.get("FAULT_BATCH", "1"))
MARKER = Path(os.environ.get("FAULT_MARKER", os.devnull))
SIGNALLED = MARKER.with_name(MARKER.name + ".signalled") if "FAULT_MARKER" in os.environ else None
PAUSE = 600.0  # seconds a fault waits for the test's signal at most: only a process whose test is gone sees it end
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

_handle = faults.StopRequest._handle
signal_taken = [False]


def _handle_and_tell(self, signum, frame):
    first = self.signum is None
    _handle(self, signum, frame)  # a second signal ends the process in here
    if first:
        signal_taken[0] = True
        if SIGNALLED is not None:
            SIGNALLED.touch()


faults.StopRequest._handle = _handle_and_tell


def wait_for_signal() -> None:
    """Until oomb's handler has taken a signal (the handler runs in this thread, between the short sleeps)."""
    end = time.monotonic() + PAUSE
    while not signal_taken[0] and time.monotonic() < end:
        time.sleep(0.01)

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
        wait_for_signal()
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
        if FAULT == "crash":
            raise RuntimeError("injected: an error oomb does not expect")
    return None


_build = trainer.build


def build(cfg, device, dtype):
    model = _build(cfg, device, dtype)
    if FAULT in ("slow-chunk", "nan", "oom-cuda", "oom-host", "memoryerror", "crash"):
        model.model.layers[0].register_forward_hook(layer0_fault, with_kwargs=True)
    return model


trainer.build = build

if FAULT == "poison-update":
    _poison_step = torch.optim.AdamW.step

    def poisoning_step(self, *a, **k):
        result = _poison_step(self, *a, **k)
        if current_step[0] == STEP:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return result

    torch.optim.AdamW.step = poisoning_step

if FAULT == "slow-build":
    _slow_build = trainer.build

    def slow_build(cfg, device, dtype):
        MARKER.touch()
        time.sleep(PAUSE)  # Ctrl-C raises KeyboardInterrupt out of it
        return _slow_build(cfg, device, dtype)

    trainer.build = slow_build

if FAULT == "slow-data":
    _slow_inputs = trainer.build_inputs

    def slow_inputs(cfg, config):
        MARKER.touch()
        time.sleep(PAUSE)  # Ctrl-C raises KeyboardInterrupt out of it
        return _slow_inputs(cfg, config)

    trainer.build_inputs = slow_inputs

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
    _fsync = checkpoint.fsync_file

    def slow_fsync(path):
        if _in_checkpoint(path) and not MARKER.exists():
            MARKER.touch()
            time.sleep(PAUSE)  # the test's first signal is taken here, its second ends the process here
        return _fsync(path)

    checkpoint.fsync_file = slow_fsync

KIND, _, WHAT = FAULT.partition(":")
DISK = os.environ.get("FAULT_DISK")
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json", "manifest.json")


def break_disk() -> None:
    """Make the next write to FAULT_DISK fail for real: fill it to the last byte, or remount it read-only."""
    if KIND == "readonly":
        subprocess.run(["mount", "-o", "remount,ro", DISK], check=True)
        return
    fill_disk(DISK)


def at(point: str) -> None:
    """The run reached ``point``: break the disk before it, or pause after it, as FAULT asks."""
    if point != WHAT:
        return
    if KIND in ("full", "readonly"):
        break_disk()
    elif KIND == "pause":
        MARKER.touch()
        time.sleep(PAUSE)  # for the test's kill -9


if KIND in ("full", "readonly", "pause"):
    _save_file, _torch_save, _write_text = checkpoint.save_file, checkpoint.torch.save, pathlib.Path.write_text
    _publish = checkpoint.publish_dir
    saving = [0]  # the step of the checkpoint being written (0: none)

    def in_step_checkpoint(path) -> bool:
        return Path(path).parent.name == f"step-{STEP:08d}.tmp"

    def save_file(tensors, filename, *a, **k):
        if in_step_checkpoint(filename):
            saving[0] = STEP
            at("model.safetensors")
        return _save_file(tensors, filename, *a, **k)

    def torch_save(obj, f, *a, **k):
        if isinstance(f, str | Path) and in_step_checkpoint(f):
            at(Path(f).name)
        return _torch_save(obj, f, *a, **k)

    def write_text(self, data, *a, **k):
        if in_step_checkpoint(self):
            at(self.name)
        return _write_text(self, data, *a, **k)

    _write_new = runfiles.write_new

    def write_new(path, data):  # write_text_atomic's temporary file
        latest = Path(path).name == "latest.tmp" and saving[0] == STEP
        if latest and KIND != "pause":
            at("latest")
        _write_new(path, data)
        if latest and KIND == "pause":  # latest.tmp is written, the rename that publishes it has not run
            at("latest")

    runfiles.write_new = write_new

    def publish_dir(tmp, final):
        _publish(tmp, final)
        if final.name == f"step-{STEP:08d}":
            at("publish")

    checkpoint.save_file, checkpoint.torch.save, pathlib.Path.write_text = save_file, torch_save, write_text
    checkpoint.publish_dir = publish_dir

    def before(owner, name: str, point: str, when=lambda *a, **k: True):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapped(*a, **k):
            if not when(*a, **k):
                return original(*a, **k)
            at(point)
            try:
                return original(*a, **k)
            finally:  # the plot and TensorBoard give way, the run goes on: the disk has room again
                if KIND == "full" and point == WHAT and point in ("plot", "tensorboard"):
                    os.unlink(os.path.join(DISK, "filler"))

        setattr(owner, name, wrapped)

    before(rundir.RunLock, "acquire", "lock")
    before(rundir, "write_config", "config")
    before(rundir, "write_inputs", "inputs")  # inputs.json: the run's data files and base model
    before(trainer, "roll_back_metrics", "rollback")  # a resumed run moving the lines of steps it will redo
    before(rundir.MetricsLog, "append", "metrics", when=lambda self, record: record["step"] == STEP)
    before(run_module, "export_model", "export")
    before(trainer, "plot_run", "plot")
    before(monitor.TensorBoardLog, "__init__", "tensorboard")  # the event file's first write

sys.exit(main(["train", *ARGS]))
