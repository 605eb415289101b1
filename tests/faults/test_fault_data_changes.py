"""A data file that changes while a run trains stops it with exit code 6 (docs/failures.md), naming the file:
when a reader opens it (the step that would read it keeps the last step saved), or at the next checkpoint
(that checkpoint is written first). Put back as it was, the run resumes to the losses it would have had;
changed, the resume is refused until data.accept_changed=true.

The files change for real, right after the checkpoint of step 2 is written (the moment the existing data fault
test uses: the run's own save, then the change)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from faultrun import RUN, losses
from helpers import overridden
from tiny_models import tiny_model

from oomb.cli import main
from oomb.train.loop.faults import EXIT_CONFIG, EXIT_DATA
from oomb.train.loop.run import Run
from oomb.train.runfolder.checkpoint import find_checkpoint


def said(capsys) -> str:
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())


@pytest.fixture
def model(tmp_path) -> Path:
    folder = tmp_path / "model"
    tiny_model("llama", vocab_size=300).save_pretrained(folder)
    return folder


def change_after_checkpoint(monkeypatch, step: int, change) -> None:
    """Run ``change()`` once checkpoint ``step`` is written (the run's own save, then the change)."""
    save = Run.save

    def save_then_change(self, at, data_state=None):
        ckpt = save(self, at, data_state)
        if at == step:
            change()
        return ckpt

    monkeypatch.setattr(Run, "save", save_then_change)


def text_docs_run(tmp_path: Path, model: Path) -> tuple[Path, list[str]]:
    """A folder of 40 text files (a file per document: each step opens files it has not read yet), the arguments of
    a 4-step run on it, and that run made straight into tmp_path/straight (the losses a resume must reach)."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(40):
        (data / f"doc{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox. " * (3 + i % 5))
    args = [f"model.path={model}", "data.task=text", f"data.paths=[{data}]", *overridden(RUN, "train.steps=4")]
    assert main(["train", f"out_dir={tmp_path / 'straight'}", *args]) == 0
    return data, args


def test_a_text_file_rewritten_during_the_run_stops_it_where_it_is_opened_and_it_resumes_exactly(
        tmp_path, model, capsys, monkeypatch):
    data, args = text_docs_run(tmp_path, model)
    saved = {p: p.read_bytes() for p in data.iterdir()}

    def rewrite():  # every file in place, the same size, other bytes: what a script rewriting the folder does
        for path, text in saved.items():
            path.write_bytes(text.upper())

    change_after_checkpoint(monkeypatch, 2, rewrite)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", f"out_dir={run}", "train.save_every=2", *args]) == EXIT_DATA
    out = said(capsys)
    assert "could not read the data of step 3: " in out and " changed during the run: other content at the same " \
        "size" in out, out
    assert str(data / "doc") in out  # the file, named
    assert f"The model and optimizer are as after step 2; the newest checkpoint, {run / 'checkpoints'}" in out
    assert f"oomb train resume={run} data.accept_changed=true" in out
    assert find_checkpoint(run).name == "step-00000002" and sorted(losses(run)) == [1, 2]

    monkeypatch.undo()
    assert main(["train", f"resume={run}"]) == EXIT_CONFIG  # still changed: refused, naming the files
    out = said(capsys)
    assert f"{data / 'doc00.txt'}: other content at the same size" in out and "data.accept_changed=true" in out
    for path, text in saved.items():  # put back as it was
        path.write_bytes(text)
    assert main(["train", f"resume={run}"]) == 0
    assert losses(run) == losses(tmp_path / "straight")


def test_data_that_goes_missing_during_the_run_stops_it_after_a_checkpoint_and_it_resumes_exactly(
        tmp_path, model, capsys, monkeypatch):
    """Files are read as the run goes: one removed mid-run stops it with the last step saved (exit 6)."""
    data, args = text_docs_run(tmp_path, model)
    saved = tmp_path / "saved"
    shutil.copytree(data, saved)
    change_after_checkpoint(monkeypatch, 2, lambda: shutil.rmtree(data))  # a disk unmounted, a folder cleaned up
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", f"out_dir={run}", "train.save_every=2", *args]) == EXIT_DATA
    out = said(capsys)
    assert "could not read the data of step 3:" in out and "cannot be read" in out
    assert "The model and optimizer are as after step 2" in out and f"oomb train resume={run}" in out
    assert find_checkpoint(run).name == "step-00000002" and sorted(losses(run)) == [1, 2]

    monkeypatch.undo()
    shutil.copytree(saved, data)  # the data back as it was
    assert main(["train", f"resume={run}"]) == 0
    assert losses(run) == losses(tmp_path / "straight")


def test_rows_appended_to_a_jsonl_during_the_run_stop_it_at_the_next_checkpoint(tmp_path, model, capsys,
                                                                                monkeypatch):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i}: " + "the quick brown fox. " * (3 + i % 5)}) + "\n"
                            for i in range(40)))
    before = rows.stat().st_size

    def append():
        with open(rows, "a") as f:
            f.write(json.dumps({"text": "a row added while the run trains"}) + "\n")

    change_after_checkpoint(monkeypatch, 2, append)
    run = tmp_path / "run"
    args = [f"model.path={model}", "data.task=text", f"data.paths=[{rows}]", *overridden(RUN, "train.steps=4")]
    assert main(["train", f"out_dir={run}", "train.save_every=2", *args]) == EXIT_DATA
    out = said(capsys)
    assert "stopped: a data file changed during the run (found when checkpoint 4 was due): " in out, out
    assert f"{rows}: {rows.stat().st_size:,} bytes, was {before:,} (grown" in out
    assert f"The model and optimizer after step 4 were saved to {run / 'checkpoints' / 'step-00000004'}" in out
    assert find_checkpoint(run).name == "step-00000004"

    monkeypatch.undo()
    assert main(["train", f"resume={run}", "train.steps=5"]) == EXIT_CONFIG
    assert f"data.paths: {rows}: {rows.stat().st_size:,} bytes, was {before:,} (grown" in said(capsys)
    assert main(["train", f"resume={run}", "train.steps=5", "data.accept_changed=true"]) == 0
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]


def test_a_data_folder_moved_whole_resumes_without_a_key(tmp_path, model, capsys):
    """The same files, byte for byte, at other paths (a folder moved) are the run's data: no key needed."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(10):
        (data / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox. " * 5)
    run = tmp_path / "run"
    args = [f"model.path={model}", "data.task=text", f"data.paths=[{data}]", *overridden(RUN, "train.steps=2")]
    assert main(["train", f"out_dir={run}", *args]) == 0
    shutil.move(data, tmp_path / "moved")
    capsys.readouterr()
    assert main(["train", f"resume={run}", "train.steps=3", f"data.paths=[{tmp_path / 'moved'}]"]) == 0
    assert "data.paths: the same 10 files, byte for byte, at other paths (moved)" in said(capsys)
