"""Every way a run can stop before its first checkpoint leaves a folder that the same command or `resume=`
continues, and the command a message advises works: each test stops a real run (a signal while the model
builds or the data is read, a kill, a crash, a non-finite step, running out of memory, a full disk), reads
the command its output advises, runs exactly that and checks that the run then trains every step.

The runs are of 2 steps with no checkpoint before the last (train.save_every=0): a stop in either step is
one before the first checkpoint.
"""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import pytest
from faultrun import RUN, finish, leftovers, losses, run_process, start_process, wait_for
from helpers import overridden

from oomb.cli import main
from oomb.train.loop.faults import (
    EXIT_CONFIG,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_OUT_OF_MEMORY,
    EXIT_SIGINT,
    EXIT_WRITE,
)
from oomb.train.runfolder.checkpoint import list_checkpoints

STEPS = 2
TWO_STEPS = overridden(RUN, f"train.steps={STEPS}")


def advised(text: str, command: list[str]) -> list[str]:
    """The `oomb train` arguments a message advises: its last `oomb train ...` line, or ``command`` itself where
    it says to run the same command again."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("oomb train ")]
    if lines:
        return shlex.split(lines[-1])[1:]
    assert "the same command again" in " ".join(text.split()), text
    return ["train", *command]


def follow(text: str, command: list[str], run: Path, capsys) -> list[str]:
    """Run the advised command in this process; it must train every step. Returns its arguments."""
    argv = advised(text, command)
    code = main(argv)
    assert code == 0, (argv, capsys.readouterr().out)
    assert sorted(losses(run)) == list(range(1, STEPS + 1)), argv
    assert list_checkpoints(run)[-1].name == f"step-{STEPS:08d}"
    return argv


def follow_refusal(command: list[str], capsys) -> str:
    """Run ``command`` (`oomb train` arguments) in this process, which refuses it: the output that says why."""
    assert main(["train", *command]) == EXIT_CONFIG
    return capsys.readouterr().out


def _output(proc) -> str:
    return proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------- signals before the first step


def test_ctrl_c_while_the_model_builds_leaves_nothing_and_the_same_command_runs(tmp_path, capsys):
    run, marker = tmp_path / "run", tmp_path / "building"
    command = [f"out_dir={run}", *TWO_STEPS]
    proc = start_process("slow-build", *command, marker=marker)
    wait_for(marker.exists, proc, "the model build")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == EXIT_SIGINT, (out, err)
    assert "Run the same command again to start" in " ".join(out.split()) and not run.exists()
    assert follow(out, command, run, capsys) == ["train", *command]


def test_sigterm_while_the_model_builds_then_ctrl_c_while_resume_builds_both_continue(tmp_path, capsys):
    """SIGTERM before the loop ends the process (the signal's default action), leaving the new run's config.json:
    the same command says to start it again with `resume=`. Ctrl-C while that resume builds leaves the folder as
    it was, and the same `resume=` command runs."""
    run, marker = tmp_path / "run", tmp_path / "building"
    command = [f"out_dir={run}", *TWO_STEPS]
    proc = start_process("slow-build", *command, marker=marker)
    wait_for(marker.exists, proc, "the model build")
    proc.send_signal(signal.SIGTERM)
    finish(proc)
    assert proc.returncode == -signal.SIGTERM
    assert (run / "config.json").is_file() and not list_checkpoints(run)
    said = follow_refusal(command, capsys)
    assert "of a run that stopped before its first checkpoint" in " ".join(said.split()), said
    resume = advised(said, command)[1:]
    assert resume == [f"resume={run}"], said
    marker.unlink()
    proc = start_process("slow-build", *resume, marker=marker)
    wait_for(marker.exists, proc, "the resumed run's model build")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == EXIT_SIGINT, (out, err)
    assert "the run folder is as it was. Run the same command again to continue" in " ".join(out.split()), out
    assert (run / "config.json").is_file()
    follow(out, resume, run, capsys)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_data_is_read_leaves_nothing_and_the_same_command_runs(tmp_path, capsys, signum):
    run, marker = tmp_path / "run", tmp_path / "reading"
    command = [f"out_dir={run}", *TWO_STEPS]
    proc = start_process("slow-data", *command, marker=marker)
    wait_for(marker.exists, proc, "the data read")
    proc.send_signal(signum)
    finish(proc)
    assert proc.returncode in (-signum, 128 + signum, EXIT_SIGINT) and not run.exists()
    assert main(["train", *command]) == 0
    assert sorted(losses(run)) == list(range(1, STEPS + 1))


def test_ctrl_c_while_the_data_is_read_prints_the_documented_line_not_a_traceback(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "reading"
    proc = start_process("slow-data", f"out_dir={run}", *TWO_STEPS, marker=marker)
    wait_for(marker.exists, proc, "the data read")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == EXIT_SIGINT and "Traceback" not in err, err
    assert "Run the same command again to start" in " ".join(out.split()), out


def test_ctrl_c_in_step_1_saves_step_0_and_the_advice_runs(tmp_path, capsys):
    run, marker = tmp_path / "run", tmp_path / "in-step"
    command = [f"out_dir={run}", *TWO_STEPS]
    proc = start_process("slow-chunk", *command, fault_step=1, marker=marker)
    wait_for(marker.exists, proc, "step 1")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == EXIT_INTERRUPTED, (out, err)
    assert "interrupted by SIGINT after step 0 of 2" in " ".join(out.split()), out
    follow(out, command, run, capsys)


def test_kill_9_during_the_first_checkpoint_write_and_the_same_commands_advice_runs(tmp_path, capsys):
    run, marker = tmp_path / "run", tmp_path / "saving"
    command = [f"out_dir={run}", *TWO_STEPS]
    proc = start_process("pause:model.safetensors", *command, fault_step=STEPS, marker=marker)
    wait_for(marker.exists, proc, "the first checkpoint's write")
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    assert not list_checkpoints(run) and list((run / "checkpoints").glob("*.tmp"))  # only the debris of the write
    said = follow_refusal(command, capsys)
    follow(said, command, run, capsys)
    assert leftovers(run) == []  # the debris is removed by the save


# ---------------------------------------------------------------------------------- failures in step 1


@pytest.mark.parametrize("fault,code,words", [
    ("crash", None, "it has no checkpoint yet (resume= starts it again from step 1 with its config.json)"),
    ("nan", EXIT_NONFINITE, "non-finite loss in step 1"),
    ("poison-update", EXIT_NONFINITE, "the update of step 1 made model.embed_tokens.weight non-finite"),
    ("oom-cuda", EXIT_OUT_OF_MEMORY, "out of memory in the forward/backward pass of step 1"),
    ("oom-optimizer", EXIT_OUT_OF_MEMORY, "out of memory in the optimizer step of step 1"),
])
def test_a_failure_in_step_1_leaves_a_run_the_advice_continues(tmp_path, capsys, fault, code, words):
    run = tmp_path / "run"
    command = [f"out_dir={run}", *TWO_STEPS]
    proc = run_process(fault, *command, fault_step=1)
    text = _output(proc)
    if code is None:  # an error oomb does not expect: its traceback, then what is on disk and how to go on
        assert proc.returncode == 1 and "injected: an error oomb does not expect" in proc.stderr, text
    else:
        assert proc.returncode == code, text
    assert words in " ".join(text.split()), text
    argv = follow(text, command, run, capsys)
    assert argv[1] == f"resume={run}", argv


# ---------------------------------------------------------------------------------- a full disk



@pytest.mark.parametrize("fault,step,words", [
    ("full:config", 0, "Nothing was trained and nothing was left behind; then run the same command again"),
    ("full:metrics", 1, "Step 1 was trained but is not saved; the run has no checkpoint yet"),
    ("full:model.safetensors", STEPS, "no partial checkpoint was left and the run has no checkpoint yet"),
])
def test_a_full_disk_before_the_first_checkpoint_and_the_advice_runs_once_there_is_room(
        disk, capsys, fault, step, words):
    run = disk / "run"
    command = [f"out_dir={run}", *TWO_STEPS]
    proc = run_process(fault, *command, fault_step=step, disk=disk)
    assert proc.returncode == EXIT_WRITE, _output(proc)
    assert words in " ".join(proc.stdout.split()) and "is full" in proc.stdout, proc.stdout
    (disk / "filler").unlink()  # room again, as the message asks
    follow(proc.stdout, command, run, capsys)
    assert leftovers(run) == []

