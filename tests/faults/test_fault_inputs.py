"""Bad inputs to `oomb train` are refused before any work with a message that says what to change;
non-finite updates and checkpoints are never saved or reported intact; Ctrl-C before the first step
leaves nothing behind; a resumed run says which steps it ran."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from faultrun import RUN, finish, leftovers, losses, run_process, start_process, wait_for
from helpers import overridden

import oomb.train.loop.trainer as trainer
from oomb.cli import main
from oomb.train.config.presets import build_model
from oomb.train.loop.faults import EXIT_NONFINITE, EXIT_SIGINT
from oomb.train.runfolder.checkpoint import (
    CheckpointError,
    NonFiniteCheckpointError,
    find_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if the model is built: every refusal below must come before it."""
    def refuse(*a, **k):
        raise AssertionError("the model was built before the bad input was refused")

    monkeypatch.setattr(trainer, "build", refuse)


def refused(capsys, *args) -> str:
    assert main(["train", *args]) == 2
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("override,message", [
    ("train.lr=.inf", "train.lr (command line) must be a finite number, got inf"),
    ("train.lr=.nan", "train.lr (command line) must be a finite number, got nan"),
    ("train.lr=1e39", "train.lr=1e+39 must be in (0, 1]"),
    ("train.lr=1e30", "train.lr=1e+30 must be in (0, 1]"),
    ("train.lr=0", "train.lr=0 must be in (0, 1]"),
    ("train.weight_decay=-5", "train.weight_decay=-5 must be >= 0"),
    ("train.weight_decay=200", "train.lr * train.weight_decay < 1"),
    ("lora.r=-4", "lora.r=-4 must be >= 0"),
    ("lora.alpha=0", "lora.alpha=0 must be > 0"),
    ("train.seed=-1", "train.seed=-1 must be in [0, 2**63)"),
    ("train.grad_clip=-1", "train.grad_clip must be >= 0"),
])
def test_out_of_range_numbers_are_refused_before_any_work(tmp_path, capsys, no_build, override, message):
    out = refused(capsys, f"out_dir={tmp_path / 'run'}", *overridden(RUN, override))
    assert message in out, out
    assert not (tmp_path / "run").exists()


def test_a_config_file_that_is_not_utf8_is_refused_naming_the_byte(tmp_path, capsys, no_build):
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(b"train:\n  steps: 3 # caf\xe9\n")
    out = refused(capsys, str(cfg), f"out_dir={tmp_path / 'run'}")
    assert f"{cfg} is not UTF-8 text (byte 23 is b'\\xe9')" in out


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, capsys, no_build):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("train:\n  steps: 3\n  lr: 0.01\n  steps: 30\n")
    out = refused(capsys, str(cfg), f"out_dir={tmp_path / 'run'}")
    assert "found the key 'steps' twice" in out


@pytest.mark.parametrize("name,content,message", [
    ("latin1.txt", b"caf\xe9 au lait", "latin1.txt is not UTF-8 text: byte 3 is b'\\xe9'"),
    ("rows.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "rows.jsonl is not UTF-8 text: byte 28 is b'\\xe9'"),
    ("rows2.jsonl", b'{"text": "ok"}\n{"body": "no text"}\n', "rows2.jsonl:2 has no field 'text'"),
    ("cut.txt", "ok \u00e9".encode()[:-1], "cut.txt is not UTF-8 text: it ends inside a character"),
    ("broken.parquet", b"PAR1 not really", "broken.parquet cannot be read"),
])
def test_every_data_file_is_read_before_the_first_step(tmp_path, capsys, no_build, name, content, message):
    data = tmp_path / "data"
    data.mkdir()
    (data / "good.txt").write_text("fine text " * 50)
    (data / name).write_bytes(content)
    out = refused(capsys, f"out_dir={tmp_path / 'run'}", *RUN, "data.task=text", f"data.paths=[{data}]")
    assert message in out, out
    assert not (tmp_path / "run").exists()


def test_an_unreadable_data_file_is_named(tmp_path, capsys, no_build):
    data = tmp_path / "data"
    data.mkdir()
    (data / "gone.txt").symlink_to(tmp_path / "nowhere.txt")  # a file that cannot be opened
    out = refused(capsys, f"out_dir={tmp_path / 'run'}", *RUN, "data.task=text", f"data.paths=[{data}]")
    assert "gone.txt" in out and ("cannot be read" in out or "does not exist" in out), out


def test_ctrl_c_before_the_first_step_leaves_nothing_and_prints_no_traceback(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "building"
    proc = start_process("slow-build", f"out_dir={run}", *RUN, marker=marker)
    wait_for(marker.exists, proc, "the model build")
    proc.send_signal(signal.SIGINT)  # the build waits for it: nothing here depends on how fast the machine is
    out, err = finish(proc)
    assert proc.returncode == EXIT_SIGINT, (out, err)
    assert "interrupted before the first step: nothing was trained; nothing was left behind" in " ".join(out.split())
    assert "Traceback" not in err and not run.exists()


def test_an_update_that_makes_a_weight_non_finite_is_caught_before_the_save(tmp_path):
    run = tmp_path / "run"
    proc = run_process("poison-update", f"out_dir={run}", "train.save_every=1", *RUN, fault_step=3)
    assert proc.returncode == EXIT_NONFINITE, (proc.stdout, proc.stderr)
    out = " ".join(proc.stdout.split())
    assert "the update of step 3 made model.embed_tokens.weight non-finite (NaN or inf) from finite gradients" in out
    assert f"the newest checkpoint, {run / 'checkpoints' / 'step-00000002'}, is intact" in out
    assert find_checkpoint(run).name == "step-00000002" and leftovers(run) == []
    assert sorted(losses(run)) == [1, 2]  # step 3 is not logged as done
    verify_checkpoint(find_checkpoint(run))


def _checkpoint(tmp_path: Path, poison: bool = False) -> Path:
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    if poison:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
    return save_checkpoint(tmp_path, 1, model, opt, sched)


def test_a_checkpoint_with_non_finite_weights_is_never_written(tmp_path):
    with pytest.raises(NonFiniteCheckpointError,
                       match=r"non-finite values \(NaN or inf\) in \['model.embed_tokens.weight'\]"):
        _checkpoint(tmp_path, poison=True)
    assert not (tmp_path / "checkpoints" / "step-00000001").exists()


def _rewrite(ckpt: Path, name: str, data: bytes) -> None:
    """Change a file and its manifest entry, as an older oomb or an attacker could have written it."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_with_non_finite_weights_is_never_reported_intact(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = _checkpoint(tmp_path)
    weights = load_file(ckpt / "model.safetensors")
    weights["model.norm.weight"][0] = float("inf")
    save_file(weights, tmp_path / "w.safetensors")
    _rewrite(ckpt, "model.safetensors", (tmp_path / "w.safetensors").read_bytes())
    state = json.loads((ckpt / "state.json").read_text())
    del state["finite"]  # written before oomb checked values: verify reads them
    _rewrite(ckpt, "state.json", json.dumps(state).encode())
    with pytest.raises(CheckpointError, match=r"holds non-finite values \(NaN or inf\) in \['model.norm.weight'\]"):
        verify_checkpoint(ckpt)


@pytest.mark.parametrize("damage,message", [
    ("list", "manifest.json is not a mapping of the folder's files"),
    ("no-sha", "manifest.json is not a mapping of the folder's files"),
    ("escape", "manifest.json is not a mapping of the folder's files"),
    ("drop-optimizer", "its manifest.json does not list ['optimizer.pt']"),
    ("extra-file", "holds files its manifest.json does not list: ['extra.pt']"),
])
def test_a_manifest_of_the_wrong_shape_or_missing_a_file_is_refused(tmp_path, damage, message):
    ckpt = _checkpoint(tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    if damage == "list":
        manifest = list(manifest)
    elif damage == "no-sha":
        del manifest["rng.pt"]["sha256"]
    elif damage == "escape":
        manifest["../../outside"] = manifest.pop("rng.pt")
    elif damage == "drop-optimizer":
        del manifest["optimizer.pt"]
        (ckpt / "optimizer.pt").unlink()
    elif damage == "extra-file":
        shutil.copy(ckpt / "rng.pt", ckpt / "extra.pt")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(ckpt)
    assert message in str(error.value)


def test_a_resumed_run_says_which_steps_it_ran(tmp_path, straight, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight / "checkpoints" / "step-00000004", tmp_path / "keep")
    shutil.copytree(straight, run)
    assert main(["train", f"resume={run / 'checkpoints' / 'step-00000004'}"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "done: steps 5-6 of 6 (resumed after step 4)" in out
    assert main(["train", f"resume={run}"]) == 0  # nothing left to train
    assert "done: all 6 steps were done before (resumed to finish)" in " ".join(capsys.readouterr().out.split())


def test_a_fine_tuning_learning_rate_resumes_and_applies(tmp_path, straight, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    assert main(["train", f"resume={run / 'checkpoints' / 'step-00000004'}", "train.lr=2e-05"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "train.lr=2e-05 replaces the checkpoint's 0.01" in out
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 2e-05
    assert main(["train", f"resume={run}", "train.steps=7"]) == 0  # config.json written with 2e-05 reads back
    assert os.path.exists(run / "checkpoints" / "step-00000007")
