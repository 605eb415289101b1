"""Helpers of the fault-injection suite: real processes, signals, exact-resume checks.

Every test runs the tiny preset for 6 steps of 512 tokens in 2 chunks, the same as the
uninterrupted reference run (built once per session), so losses compare step by step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomb.cli import main
from oomb.train.runfolder.checkpoint import find_checkpoint, verify_checkpoint

HERE = Path(__file__).resolve().parent
STEPS = 6
RUN = ["data.seq_len=512", "train.chunk_size=256", "train.page_size=64", "train.lr=0.01",
       "train.warmup_steps=2", "train.device=cpu", f"train.steps={STEPS}", "train.export=false"]
# How long a test waits for a process to reach a point or to end. The tests wait on events (a marker file, the
# process's exit), never on a time: this bound only ends a hang, so a slow or loaded machine does not reach it.
HANG_S = 600.0


def losses(run: Path) -> dict[int, float | None]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _env(fault_step: int | None, marker: Path | None, fault_batch: int | None = None,
         disk: Path | None = None) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    if disk is not None:
        env["FAULT_DISK"] = str(disk)
    if fault_step is not None:
        env["FAULT_STEP"] = str(fault_step)
    if fault_batch is not None:
        env["FAULT_BATCH"] = str(fault_batch)
    if marker is not None:
        env["FAULT_MARKER"] = str(marker)
    return env


def command(fault: str | None, *args: str) -> list[str]:
    """`oomb train ARGS` in a new process, with ``fault`` injected by inject.py (None = none)."""
    if fault is None:
        return [sys.executable, "-m", "oomb.cli", "train", *args]
    return [sys.executable, str(HERE / "inject.py"), fault, *args]


def run_process(fault: str | None, *args: str, fault_step: int | None = None,
                fault_batch: int | None = None, disk: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command(fault, *args), capture_output=True, text=True, timeout=HANG_S,
                          env=_env(fault_step, None, fault_batch, disk))


def start_process(fault: str | None, *args: str, fault_step: int | None = None,
                  marker: Path | None = None, fault_batch: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(command(fault, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(fault_step, marker, fault_batch))


def leftovers(run: Path) -> list[str]:
    """Debris a failure must not leave: temporary files and folders, half lines of metrics."""
    found = [str(p.relative_to(run)) for p in run.rglob("*") if ".tmp" in p.name]
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines(keepends=True):
            try:
                json.loads(line)
                assert line.endswith("\n")
            except (ValueError, AssertionError):
                found.append(f"metrics.jsonl line {line!r}")
    return found


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = HANG_S) -> None:
    """Until ``condition()`` holds; fails at once if the process ends first (``timeout`` only ends a hang)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended before {what}: rc {proc.returncode}\n{out[-2000:]}\n{err[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"no {what} after {timeout:.0f} s: the run hangs (killed)")
        time.sleep(0.02)


def finish(proc: subprocess.Popen, timeout: float = HANG_S) -> tuple[str, str]:
    """The process's (stdout, stderr) once it has ended; one that has not ended after ``timeout`` (a hang, not a
    slow machine) is killed and the test fails."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the run did not end within {timeout:.0f} s (killed)\n{out[-2000:]}\n{err[-2000:]}"
                             ) from None


def signalled(marker: Path) -> Path:
    """The file inject.py touches once oomb's signal handler has taken a run's first SIGINT/SIGTERM."""
    return marker.with_name(marker.name + ".signalled")


def send(proc: subprocess.Popen, signum: int) -> None:
    proc.send_signal(signum)


def step_of(ckpt: Path) -> int:
    return json.loads((ckpt / "state.json").read_text())["step"]


def assert_resumes_exactly(run: Path, straight: Path, *resume_args: str, resume: Path | None = None,
                           rel: float = 1e-6) -> None:
    """The newest checkpoint is intact, and resuming gives the uninterrupted run's losses, each step once."""
    verify_checkpoint(find_checkpoint(resume or run))
    assert main(["train", f"resume={resume or run}", *resume_args]) == 0
    got, expected = losses(run), losses(straight)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=rel), (step, got, expected)


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}


def fill_disk(folder: Path) -> None:
    """Fill the file system holding ``folder`` to its last byte (a file ``filler`` in it): the kernel's ENOSPC."""
    fd = os.open(Path(folder) / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for size in (1 << 20, 1 << 12, 1):  # tmpfs allocates pages: fill them, then the last page's bytes
        while True:
            try:
                os.write(fd, b"\0" * size)
            except OSError:
                break
    os.close(fd)
