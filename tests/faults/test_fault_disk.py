"""Real disk faults: a run on a small tmpfs that fills up (ENOSPC from the kernel) or turns read-only
(EROFS) just before each file a run writes, and real `kill -9` at each point of a checkpoint write.

Each failure ends with the documented message and exit code, leaves no debris (no *.tmp, no half
metrics line) and the previous checkpoint intact; once the disk is back, the run resumes (or starts
again) and gets the uninterrupted run's losses. Mounting needs root (CI runs as root).
"""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from faultrun import (
    RUN,
    STEPS,
    assert_resumes_exactly,
    fill_disk,
    finish,
    leftovers,
    losses,
    run_process,
    start_process,
    wait_for,
)

from oomb.cli import main
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.loop.faults import EXIT_WRITE
from oomb.train.runfolder.checkpoint import LATEST, find_checkpoint, verify_checkpoint
from oomb.train.runfolder.rundir import MetricsLog, check_paths


def restore(disk: Path) -> None:
    """The disk has room again and is writable."""
    subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    (disk / "filler").unlink(missing_ok=True)


def said(proc) -> str:
    return " ".join(proc.stdout.split())


# A full disk may still take a metrics line into the file's last page (see the MetricsLog test), and a
# file system with files open for writing cannot be remounted read-only: those two are tested apart.
@pytest.mark.parametrize("fault,step", [
    ("full:model.safetensors", 4), ("full:optimizer.pt", 4),
    ("full:rng.pt", 4), ("full:state.json", 4), ("full:manifest.json", 4), ("full:latest", 4),
])
def test_a_full_or_read_only_disk_mid_run_stops_cleanly_and_resumes_exactly(disk, straight, fault, step):
    run = disk / "run"
    proc = run_process(fault, f"out_dir={run}", "train.save_every=2", *RUN, fault_step=step, disk=disk)
    assert proc.returncode == EXIT_WRITE, (proc.stdout, proc.stderr)
    out = said(proc)
    assert "could not write checkpoint step 4" in out and "is full" in out, out
    assert "Traceback" not in proc.stderr, proc.stderr
    good = run / "checkpoints" / "step-00000002"
    assert f"the newest checkpoint, {good}, is intact" in out and f"oomb train resume={run}" in out
    assert (run / "checkpoints" / LATEST).read_text() == good.name
    verify_checkpoint(good)
    assert leftovers(run) == []
    assert sorted(losses(run)) == list(range(1, step + 1))  # every finished step logged, whole lines only
    restore(disk)
    assert_resumes_exactly(run, straight)
    assert leftovers(run) == []


def test_metrics_lines_are_whole_or_absent_when_the_disk_fills(disk):
    log = MetricsLog(disk / "metrics.jsonl")
    record = {"loss": 1.0, "note": "x" * 300}
    log.append({"step": 1, **record})  # the file has a page of its own
    fill_disk(disk)
    written = 1
    with pytest.raises(OSError) as failed:  # the page takes a few more lines, then one is cut short
        for written in range(2, 1000):
            log.append({"step": written, **record})
    assert failed.value.errno == errno.ENOSPC and written > 2
    lines = (disk / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == list(range(1, written)) and lines[-1].endswith("\n")
    log.close()


@pytest.mark.parametrize("fault", ["full:lock", "readonly:lock", "full:inputs", "full:config"])
def test_a_full_disk_at_the_start_leaves_nothing_and_the_same_command_runs(disk, straight, fault):
    run = disk / "run"
    args = [f"out_dir={run}", "train.save_every=2", *RUN]
    proc = run_process(fault, *args, disk=disk)
    assert proc.returncode == EXIT_WRITE, (proc.stdout, proc.stderr)
    assert f"could not write to the run folder {run}" in said(proc), said(proc)
    if fault.startswith("full"):
        assert "nothing was left behind" in said(proc) and not run.exists()
    else:  # a read-only disk keeps the folder it had made just before; empty, it does not stop a new start
        assert f"{run} is left empty" in said(proc) and not any(run.iterdir())
    restore(disk)
    assert main(["train", *args]) == 0
    assert losses(run) == pytest.approx(losses(straight), rel=1e-6)


def test_a_full_disk_when_a_resumed_run_rewrites_its_metrics_changes_nothing(disk, straight):
    run = disk / "run"
    shutil.copytree(straight, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    proc = run_process("full:rollback", f"resume={run / 'checkpoints' / 'step-00000002'}", disk=disk)
    assert proc.returncode == EXIT_WRITE, (proc.stdout, proc.stderr)
    assert f"could not write the metrics and config of {run}" in said(proc) and "is full" in said(proc)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"}  # metrics.jsonl and config.json as they were
    assert leftovers(run) == []
    restore(disk)
    assert_resumes_exactly(run, straight, resume=run / "checkpoints" / "step-00000002")


def test_a_full_disk_during_the_export_keeps_the_run_and_resume_writes_it(disk, straight):
    run = disk / "run"
    args = [*RUN[:-1], "train.export=true"]  # RUN ends with train.export=false
    proc = run_process("full:export", f"out_dir={run}", "train.save_every=2", *args, disk=disk)
    assert proc.returncode == EXIT_WRITE, (proc.stdout, proc.stderr)
    assert "could not write the export" in said(proc) and "Training is complete" in said(proc)
    assert not (run / "export").exists() and leftovers(run) == []
    assert find_checkpoint(run).name == f"step-{STEPS:08d}"
    restore(disk)
    assert main(["train", f"resume={run}"]) == 0
    assert (run / "export" / "config.json").is_file() and (run / "export" / "model.safetensors").is_file()
    assert losses(run) == pytest.approx(losses(straight), rel=1e-6)


@pytest.mark.parametrize("fault,extra", [("full:plot", []),
                                         ("full:tensorboard", ["train.report_to=[jsonl,tensorboard]"])])
def test_the_plot_and_tensorboard_give_way_to_a_full_disk_with_a_warning(disk, straight, fault, extra):
    run = disk / "run"
    proc = run_process(fault, f"out_dir={run}", "train.save_every=2", *RUN, *extra, fault_step=3, disk=disk)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "warning:" in said(proc), said(proc)
    assert not list(run.glob("training.png*")) if fault == "full:plot" else True
    assert losses(run) == pytest.approx(losses(straight), rel=1e-6)  # metrics.jsonl went on
    assert leftovers(run) == []


@pytest.mark.parametrize("point", ["model.safetensors", "optimizer.pt", "rng.pt", "state.json", "manifest.json",
                                   "publish", "latest"])
def test_kill_9_at_each_point_of_a_checkpoint_write_resumes_exactly(tmp_path, straight, point):
    run, marker = tmp_path / "run", tmp_path / "paused"
    proc = start_process(f"pause:{point}", f"out_dir={run}", "train.save_every=2", *RUN, fault_step=4,
                         marker=marker)
    wait_for(marker.exists, proc, f"checkpoint 4's write at {point}")
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    assert proc.returncode == -signal.SIGKILL
    assert find_checkpoint(run).name == "step-00000002"  # latest still names the previous checkpoint
    verify_checkpoint(find_checkpoint(run))
    assert_resumes_exactly(run, straight)
    assert not list((run / "checkpoints").glob("*.tmp"))  # the next save removed the debris


def test_kill_9_during_the_very_first_latest_write_resumes_from_that_checkpoint(tmp_path, straight):
    run, marker = tmp_path / "run", tmp_path / "paused"
    proc = start_process("pause:latest", f"out_dir={run}", "train.save_every=2", *RUN, fault_step=2, marker=marker)
    wait_for(marker.exists, proc, "the first write of latest")
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    assert not (run / "checkpoints" / LATEST).exists() and (run / "checkpoints" / "step-00000002").is_dir()
    assert find_checkpoint(run).name == "step-00000002"  # found without latest
    assert_resumes_exactly(run, straight)


def test_a_read_only_out_dir_is_refused_before_any_work(disk):
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    with pytest.raises(ConfigError, match="is not a writable folder .*Read-only file system"):
        check_paths(load_config(None, [f"out_dir={disk / 'run'}"]))
    restore(disk)
    shutil.rmtree(disk / "run", ignore_errors=True)
