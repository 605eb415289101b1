"""SIGINT/SIGTERM: the run drops the step in progress, writes a checkpoint and says how to resume;
a second signal kills it at once, even in the middle of a checkpoint write, and nothing is damaged."""

import signal

from faultrun import RUN, assert_resumes_exactly, finish, losses, signalled, start_process, step_of, wait_for

from oomb.train.loop.faults import EXIT_INTERRUPTED
from oomb.train.runfolder.checkpoint import find_checkpoint, list_checkpoints, verify_checkpoint


def test_sigterm_between_or_during_steps_checkpoints_and_resumes(tmp_path, straight):
    run = tmp_path / "run"
    proc = start_process(None, f"out_dir={run}", *RUN)  # save_every=0: only the stop writes a checkpoint
    wait_for(lambda: (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2,
             proc, "two steps")
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == EXIT_INTERRUPTED, (out, err)
    ckpt = find_checkpoint(run)
    done = step_of(ckpt)
    assert f"interrupted by SIGTERM after step {done} of 6" in out
    assert f"oomb train resume={run}" in out
    assert sorted(losses(run)) == list(range(1, done + 1))  # no half step logged
    assert_resumes_exactly(run, straight)


def test_sigint_mid_step_drops_the_step_and_resumes(tmp_path, straight):
    run, marker = tmp_path / "run", tmp_path / "in-chunk"
    proc = start_process("slow-chunk", f"out_dir={run}", *RUN, fault_step=3, marker=marker)
    wait_for(marker.exists, proc, "step 3's second chunk")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == EXIT_INTERRUPTED, (out, err)
    assert "SIGINT received: dropping the step in progress" in err
    assert "interrupted by SIGINT after step 2 of 6 (step 3 was in progress and is dropped" in out
    assert step_of(find_checkpoint(run)) == 2
    assert sorted(losses(run)) == [1, 2]
    assert_resumes_exactly(run, straight)


def test_second_signal_during_a_checkpoint_write_kills_at_once_and_damages_nothing(tmp_path, straight):
    run, marker = tmp_path / "run", tmp_path / "saving"
    proc = start_process("slow-save", f"out_dir={run}", "train.save_every=2", *RUN, fault_step=4, marker=marker)
    wait_for(marker.exists, proc, "the write of checkpoint 4")
    proc.send_signal(signal.SIGINT)
    wait_for(signalled(marker).exists, proc, "the first SIGINT's handling")  # the save pauses until killed
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, out, err)  # killed by the signal's default action
    assert "Send it again to stop at once" in err
    assert [c.name for c in list_checkpoints(run)] == ["step-00000002"]  # no half-written step-00000004
    assert find_checkpoint(run).name == "step-00000002"
    verify_checkpoint(find_checkpoint(run))
    assert_resumes_exactly(run, straight)  # the save's debris (step-00000004.tmp) is replaced
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_ctrl_c_while_the_oomb_command_imports_torch_is_a_line_not_a_traceback(tmp_path):
    # The first seconds of `oomb ...` import torch and transformers (`import oomb`). A KeyboardInterrupt there,
    # made here by an oomb.engine whose names raise it, ends the command with code 130 and one line; a program
    # that imports oomb as a library gets the KeyboardInterrupt itself.
    import subprocess
    import sys

    script = tmp_path / "interrupted_import.py"
    script.write_text(
        "import sys, types\n"
        "engine = types.ModuleType('oomb.engine')\n"
        "def interrupted(name):\n"
        "    raise KeyboardInterrupt\n"
        "engine.__getattr__ = interrupted\n"
        "sys.modules['oomb.engine'] = engine\n"
        "sys.argv[0] = sys.argv[1]\n"
        "import oomb\n"
    )
    command = subprocess.run([sys.executable, str(script), "/usr/local/bin/oomb"], capture_output=True, text=True)
    assert command.returncode == 130 and "Traceback" not in command.stderr
    assert "interrupted while starting, before anything was read or written" in command.stderr
    library = subprocess.run([sys.executable, str(script), "train.py"], capture_output=True, text=True)
    assert library.returncode != 0 and "KeyboardInterrupt" in library.stderr
