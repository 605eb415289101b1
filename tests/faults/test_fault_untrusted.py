"""Untrusted files: no pickled code runs from a checkpoint, YAML is parsed safely, a model folder's own
code runs only with model.trust_remote_code=true given on the command line (never from a run folder),
`latest` names only the run's own checkpoints, a run folder is locked while a process trains in it,
and every path is checked before any work."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faultrun import HANG_S, HERE, RUN, finish, losses, run_process, start_process, wait_for
from helpers import overridden

import oomb.train.loop.trainer as trainer
from oomb.cli import main
from oomb.train.config.presets import build_model
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.loop.faults import EXIT_INTERRUPTED
from oomb.train.runfolder.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from oomb.train.runfolder.rundir import RunLock, check_paths, load_run_config

ROOT = HERE.parents[1]


class _MakesAFolder:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_pickled_code_in_a_checkpoint_is_never_run(tmp_path):
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = save_checkpoint(tmp_path, 1, model, opt, sched)
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _MakesAFolder(marker), "scheduler": {}}, ckpt / "optimizer.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())  # an attacker rewrites the manifest too
    data = (ckpt / "optimizer.pt").read_bytes()
    manifest["optimizer.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="holds objects other than tensors and plain data"):
        load_checkpoint(ckpt, model, opt, sched)
    assert not marker.exists()


def test_every_torch_load_in_the_repository_is_weights_only():
    calls = []
    for path in [*ROOT.joinpath("oomb").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]:
        text = path.read_text()
        for m in re.finditer(r"torch\.load\(", text):
            depth, end = 0, m.end() - 1
            for end in range(m.end() - 1, len(text)):  # to the parenthesis that closes the call
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            calls.append((path.name, text[m.start(): end + 1]))
    assert calls, "the audit found no torch.load at all: the pattern is wrong"
    assert all("weights_only=True" in call for _, call in calls if "re.finditer" not in call), calls


def test_yaml_tags_that_run_code_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "run.yaml"
    bad.write_text(f"train: !!python/object/apply:os.mkdir ['{marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not plain YAML"):
        load_config(None, [f"train.steps=!!python/object/apply:os.mkdir ['{marker}']"])
    assert not marker.exists()


def _model_folder_with_code(folder: Path, marker: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "oomb_test_remote", "architectures": ["RemoteModel"],
        "auto_map": {"AutoConfig": "remote.RemoteConfig", "AutoModelForCausalLM": "remote.RemoteModel"},
    }))
    (folder / "remote.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).mkdir()\n"
                                      "raise SystemExit('remote code ran')\n")
    return folder


def test_remote_code_runs_only_when_trusted(tmp_path, capsys):
    marker = tmp_path / "ran"
    folder = _model_folder_with_code(tmp_path / "model", marker)
    assert main(["train", f"model.path={folder}", f"out_dir={tmp_path / 'run'}", *RUN]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "needs Python code shipped in the folder (remote.RemoteConfig, remote.RemoteModel)" in out
    assert "model.trust_remote_code=true" in out
    assert not marker.exists() and not (tmp_path / "run").exists()
    # Trusted: transformers imports the folder's code (in a fresh process with its own module cache).
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "oomb.cli", "train", f"model.path={folder}",
                           "model.trust_remote_code=true", f"out_dir={tmp_path / 'run2'}", *RUN],
                          capture_output=True, text=True, env=env, timeout=HANG_S)
    assert marker.exists(), (proc.stdout, proc.stderr)


@pytest.mark.parametrize("case,match", [
    ("model-missing", "model.path=.* does not exist"),
    ("model-file", "model.path=.* is a file"),
    ("model-no-config", "has no config.json"),
    ("out-is-file", "out_dir=.* is a file, not a folder"),
    ("out-under-file", "is not a writable folder"),
    ("resume-missing", "resume=.* does not exist"),
    ("resume-not-a-run", "holds no checkpoint"),
    ("resume-no-config", "is not inside an oomb run folder"),
])
def test_every_path_is_checked_before_any_work(tmp_path, monkeypatch, case, match):
    def no_build(*a, **k):
        raise AssertionError("the model was built before the paths were checked")

    monkeypatch.setattr(trainer, "build", no_build)
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    fake_run = tmp_path / "fake"
    (fake_run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (fake_run / "checkpoints" / "step-00000001" / "manifest.json").write_text("{}")
    (fake_run / "checkpoints" / "latest").write_text("step-00000001")
    args = {
        "model-missing": [f"model.path={tmp_path / 'nope'}"],
        "model-file": [f"model.path={tmp_path / 'file'}"],
        "model-no-config": [f"model.path={tmp_path / 'empty'}"],
        "out-is-file": [f"out_dir={tmp_path / 'file'}"],
        "out-under-file": [f"out_dir={tmp_path / 'file' / 'run'}"],
        "resume-missing": [f"resume={tmp_path / 'nope'}"],
        "resume-not-a-run": [f"resume={tmp_path / 'empty'}"],
        "resume-no-config": [f"resume={fake_run}"],
    }[case]
    cfg = load_config(None, overridden([*RUN, f"out_dir={tmp_path / 'out'}"], *args))
    with pytest.raises(ConfigError, match=match):
        trainer.train(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: a read-only folder refuses nothing")
def test_an_unwritable_out_dir_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="is not a writable folder"):
        check_paths(load_config(None, [f"out_dir={locked / 'run'}"]))


def _poisoned_run(tmp_path: Path, straight: Path, marker: Path) -> Path:
    """A copy of a finished run whose config.json points at a model folder with code and trusts it."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    folder = _model_folder_with_code(tmp_path / "model", marker)
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"].update(path=str(folder), trust_remote_code=True)
    (run / "config.json").write_text(json.dumps(cfg))
    return run


def test_a_run_folder_never_turns_on_remote_code_for_resume_or_eval(tmp_path, straight, capsys):
    marker = tmp_path / "ran"
    run = _poisoned_run(tmp_path, straight, marker)
    assert main(["train", f"resume={run}", "train.steps=8"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "needs Python code shipped in the folder" in out and "model.trust_remote_code=true on the command " \
        "line" in out
    assert main(["eval", str(run), "--retrieval", "--lengths", "256", "--samples", "1",
                 "--out", str(tmp_path / "eval")]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "needs Python code shipped in the folder" in out and "--trust-remote-code" in out
    assert not marker.exists()
    assert load_run_config(None, [f"resume={run}"]).model.trust_remote_code is False
    assert load_run_config(None, [f"resume={run}", "model.trust_remote_code=true"]).model.trust_remote_code


@pytest.mark.parametrize("latest", ["../../elsewhere/checkpoints/step-00000002", "/etc", "step-2", "", "latest"])
def test_latest_must_name_one_of_the_runs_own_checkpoints(tmp_path, straight, latest, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    shutil.copytree(straight, tmp_path / "elsewhere")
    (run / "checkpoints" / "latest").write_text(latest)
    before = (tmp_path / "elsewhere" / "metrics.jsonl").read_text()
    assert main(["train", f"resume={run}"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert f"names {latest!r}, which is not a checkpoint folder (step-N) of this run" in out
    assert (tmp_path / "elsewhere" / "metrics.jsonl").read_text() == before  # the other run was not touched


def test_a_checkpoint_folder_that_is_a_link_elsewhere_is_refused(tmp_path, straight, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    shutil.copytree(straight, tmp_path / "elsewhere")
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    (run / "checkpoints" / "step-00000006").symlink_to(tmp_path / "elsewhere" / "checkpoints" / "step-00000006")
    assert main(["train", f"resume={run}"]) == 2
    assert "not a checkpoint folder (step-N) of this run" in " ".join(capsys.readouterr().out.split())
    assert main(["train", f"resume={run / 'checkpoints' / 'step-00000006'}"]) == 2  # named directly
    assert "is not inside an oomb run folder" in " ".join(capsys.readouterr().out.split())


def test_a_run_folder_in_use_is_refused_naming_the_holder(tmp_path, straight, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    lock = RunLock(run).acquire()  # as if another process trained in it
    try:
        assert main(["train", f"resume={run}", "train.steps=8"]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert f"the run folder {run} is in use: process {os.getpid()} on " in out and "kill -INT" in out
        assert sorted(losses(run)) == list(range(1, 7))  # nothing was written
    finally:
        lock.release()
    assert main(["train", f"resume={run}", "train.steps=8"]) == 0  # released: the run goes on
    assert sorted(losses(run)) == list(range(1, 9))


def test_two_processes_resuming_one_run_train_once(tmp_path, straight):
    """A real second process: the first holds the lock while it trains; the second is refused at once."""
    run, marker = tmp_path / "run", tmp_path / "slow"
    shutil.copytree(straight, run)
    first = start_process("slow-chunk", f"resume={run}", "train.steps=8", fault_step=7, marker=marker)
    wait_for(marker.exists, first, "the first process's step 7")
    second = run_process(None, f"resume={run}", "train.steps=8")
    assert second.returncode == 2 and f"process {first.pid}" in " ".join(second.stdout.split()), second.stdout
    first.send_signal(signal.SIGINT)  # step 7 waits for it: stop it the documented way
    out, err = finish(first)
    assert first.returncode == EXIT_INTERRUPTED, (out, err)
    assert sorted(losses(run)) == list(range(1, 7))  # the second process wrote nothing
