"""Untrusted files: no pickled code runs from a checkpoint, YAML is parsed safely, a model folder's own
code runs only with model.trust_remote_code=true, and every path is checked before any work."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faultrun import HERE, RUN

import oomb.train.trainer as trainer
from oomb.cli import main
from oomb.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from oomb.train.config import ConfigError, load_config
from oomb.train.presets import build_model

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
                          capture_output=True, text=True, env=env, timeout=300)
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
    cfg = load_config(None, [*RUN, f"out_dir={tmp_path / 'out'}", *args])
    with pytest.raises(ConfigError, match=match):
        trainer.train(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere: a read-only folder refuses nothing")
def test_an_unwritable_out_dir_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="is not a writable folder"):
        trainer.check_paths(load_config(None, [f"out_dir={locked / 'run'}"]))
