"""A run never reads or writes outside its folder: a link or a special file in it is refused, never followed.

For each file and folder a run reads or writes, a symbolic link to something outside the run (another run's
files, any file or folder) or a named pipe is put in its place, then `oomb train` runs: it exits with the
documented code and a message naming the path and what it is, and what the link names is byte for byte as
before. Three moments: in a finished run's folder before `resume=` (the check of the whole folder refuses it),
in the folder of a new run, and put there while the model builds, after that check (the site that reads or
writes the entry refuses it itself).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest
from faultrun import RUN, losses
from helpers import overridden

import oomb.train.loop.trainer as trainer
from oomb.cli import main
from oomb.train.loop.faults import EXIT_CONFIG, EXIT_WRITE

CKPT = "checkpoints/step-00000006"  # the straight run's newest checkpoint (the one `latest` names)
# Every entry of a finished run a resume reads or writes, and what its link names outside the run: a path in
# another run (`other`, a copy of the same run) or a file or folder elsewhere.
RESUMED = {
    "checkpoints": "other/checkpoints",  # resume would rotate and write that run's checkpoints
    "checkpoints/latest": "other/checkpoints/latest",
    CKPT: f"other/{CKPT}",
    "checkpoints/step-00000002": "other/checkpoints/step-00000002",  # an older one: rotation deletes it
    **{f"{CKPT}/{name}": f"other/{CKPT}/{name}"
       for name in ("manifest.json", "state.json", "model.safetensors", "optimizer.pt", "rng.pt")},
    ".lock": "file.txt",  # opening it for the lock would truncate what it names
    "config.json": "other/config.json",
    "config.before-step-00000006.json": "other/config.json",
    "inputs.json": "other/inputs.json",  # the record a resume compares the data and the base model with
    "metrics.jsonl": "other/metrics.jsonl",
    "metrics.rolled-back.jsonl": "other/metrics.jsonl",  # lines of the steps run again would be appended
    "training.png": "other/training.png",
    "retrieval.json": "file.txt",
    "tensorboard": "folder",
    "export": "folder",
    "wandb": "folder",
    "wandb-run.json": "file.txt",
}


class Hang(BaseException):
    """A read or write blocked on a named pipe (BaseException: no handler of oomb's catches it)."""


@contextmanager
def no_hang(seconds: int = 120):
    """Fail instead of blocking: opening a pipe that nobody writes waits forever (the alarm interrupts it)."""
    def ring(signum, frame):
        raise Hang(f"blocked for {seconds} s: a named pipe in the run folder was opened")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed): a file's sha256, a link's target, a folder's kind."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            mode = os.lstat(path).st_mode
            key = str(path.relative_to(root))
            if stat.S_ISLNK(mode):
                seen[key] = f"link to {os.readlink(path)}"
            elif stat.S_ISREG(mode):
                seen[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                seen[key] = "folder" if stat.S_ISDIR(mode) else f"mode {mode:o}"
    return seen


@pytest.fixture(scope="module")
def outside(tmp_path_factory, straight) -> Path:
    """What links in a run point at: another run (a copy of the straight run), a file and a folder."""
    root = tmp_path_factory.mktemp("outside")
    shutil.copytree(straight, root / "other")
    (root / "file.txt").write_text("a file of someone else's\n")
    (root / "folder").mkdir()
    (root / "folder" / "inside.txt").write_text("a folder of someone else's\n")
    return root


def plant(run: Path, entry: str, kind: str, target: Path) -> Path:
    """Put a link to ``target`` (kind "link") or a named pipe ("fifo") at ``run / entry``, replacing what is there."""
    path = run / entry
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "link":
        path.symlink_to(target)
    else:
        os.mkfifo(path)
    return path


def named(path: Path, kind: str, target: Path) -> str:
    """The words of the refusal: the path and what it is."""
    return f"{path} is a symbolic link to {target}" if kind == "link" else f"{path} is a named pipe (FIFO)"


def said(capsys) -> str:
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())


def _bare(text: str) -> str:
    return "".join(text.split())


def copy_run(straight: Path, run: Path) -> Path:
    shutil.copytree(straight, run, symlinks=True)
    return run


# ---------------------------------------------------------------------------------- in a run folder before resume=


@pytest.mark.parametrize("kind", ["link", "fifo"])
@pytest.mark.parametrize("entry", list(RESUMED))
def test_a_link_or_pipe_in_a_resumed_run_is_refused_and_what_it_names_is_untouched(
        tmp_path, straight, outside, capsys, entry, kind):
    run = copy_run(straight, tmp_path / "run")
    target = outside / RESUMED[entry]
    path = plant(run, entry, kind, target)
    before, mine = snapshot(outside), snapshot(run)
    with no_hang():  # keep_last=1: were checkpoints/ followed, the resume would delete the other run's
        code = main(["train", f"resume={run}", "train.steps=8", "train.keep_last=1"])
    out = said(capsys)
    assert code == EXIT_CONFIG, out
    assert named(path, kind, target) in out, out
    assert snapshot(outside) == before
    assert snapshot(run) == mine  # nothing was trained, nothing of the run changed


@pytest.mark.parametrize("name", ["manifest.json", "state.json", "model.safetensors"])
def test_a_link_in_a_checkpoint_named_directly_is_refused(tmp_path, straight, outside, capsys, name):
    run = copy_run(straight, tmp_path / "run")
    target = outside / "other" / CKPT / name
    path = plant(run, f"{CKPT}/{name}", "link", target)
    before = snapshot(outside)
    assert main(["train", f"resume={run / CKPT}", "train.steps=8"]) == EXIT_CONFIG
    assert named(path, "link", target) in said(capsys)
    assert snapshot(outside) == before


def test_a_checkpoint_named_directly_through_a_linked_checkpoints_folder_is_refused(
        tmp_path, straight, outside, capsys):
    run = copy_run(straight, tmp_path / "run")
    target = outside / "other" / "checkpoints"
    path = plant(run, "checkpoints", "link", target)
    before = snapshot(outside)
    assert main(["train", f"resume={run / CKPT}", "train.steps=8", "train.keep_last=1"]) == EXIT_CONFIG
    assert named(path, "link", target) in said(capsys)
    assert snapshot(outside) == before


def test_a_checkpoint_folder_named_directly_that_is_a_link_is_named_as_one(tmp_path, straight, outside, capsys):
    run = copy_run(straight, tmp_path / "run")
    target = outside / "other" / CKPT
    path = plant(run, CKPT, "link", target)
    before = snapshot(outside)
    assert main(["train", f"resume={path}", "train.steps=8"]) == EXIT_CONFIG
    out = said(capsys)
    assert "is not inside an oomb run folder" in out and named(path, "link", target) in out, out
    assert snapshot(outside) == before


def test_the_advice_to_remove_the_link_works(tmp_path, straight, outside, capsys):
    """`checkpoints/` linked into another run: refused; replaced by a copy as the message says, the run goes on."""
    run = copy_run(straight, tmp_path / "run")
    target = outside / "other" / "checkpoints"
    plant(run, "checkpoints", "link", target)
    before = snapshot(outside)
    command = ["train", f"resume={run}", "train.steps=7", "train.keep_last=1"]
    assert main(command) == EXIT_CONFIG
    assert "Remove the link, or replace it with a copy of what it names, then run the command again" in said(capsys)
    (run / "checkpoints").unlink()
    shutil.copytree(target, run / "checkpoints")
    assert main(command) == 0
    assert sorted(losses(run)) == list(range(1, 8))
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-00000007"]  # rotated: its own copy
    assert snapshot(outside) == before


# ---------------------------------------------------------------------------------- in a new run's folder


@pytest.mark.parametrize("kind", ["link", "fifo"])
@pytest.mark.parametrize("entry", [".lock", "inputs.json", "inputs.json.tmp", "config.json.tmp", "config.json"])
def test_a_link_or_pipe_in_a_new_runs_folder_is_refused(tmp_path, outside, capsys, entry, kind):
    """A new run takes a folder holding what a run killed before its config.json leaves (.lock, inputs.json,
    config.json.tmp), checked as files; one holding a config.json is a run's folder, checked whole."""
    run = tmp_path / "run"
    run.mkdir()
    target = outside / "file.txt"
    path = plant(run, entry, kind, target)
    before = snapshot(outside)
    with no_hang():
        code = main(["train", f"out_dir={run}", *RUN])
    out = said(capsys)
    assert code == EXIT_CONFIG, out
    assert named(path, kind, target) in out, out
    assert snapshot(outside) == before
    assert [p.name for p in run.iterdir()] == [entry]


# ---------------------------------------------------------------------------------- put there during the run


def _plant_while(monkeypatch, when: str, run: Path, entry: str, kind: str, target: Path) -> None:
    """Plant the entry once the folder has been checked: as the run folder is opened ("open": before the lock and
    config.json are written) or while the model builds ("build")."""
    name = "open_run_folder" if when == "open" else "build"
    original = getattr(trainer, name)

    def planting(*args, **kwargs):
        plant(run, entry, kind, target)
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, name, planting)


ONE_STEP = overridden(RUN, "train.steps=1")
# entry, when it appears, the run (new: 1 step; resumed: the straight run resumed for step 7, or from step 4 so
# that steps 5-6 are rolled back), its extra settings, the exit code, the words of the stop or warning.
DURING = [
    (".lock", "open", "new", [], EXIT_WRITE, "could not write to the run folder"),
    ("inputs.json", "open", "new", [], EXIT_WRITE, "could not write to the run folder"),
    ("inputs.json.tmp", "open", "new", [], EXIT_WRITE, "could not write to the run folder"),
    ("config.json", "open", "new", [], EXIT_WRITE, "could not write to the run folder"),
    ("config.json.tmp", "open", "new", [], EXIT_WRITE, "could not write to the run folder"),
    ("metrics.jsonl", "build", "new", [], EXIT_WRITE, "metrics.jsonl (step 1)"),
    ("checkpoints", "build", "new", [], EXIT_WRITE, "could not write checkpoint step 1"),
    ("checkpoints/step-00000001.tmp", "build", "new", [], EXIT_WRITE, "could not write checkpoint step 1"),
    ("checkpoints/step-00000001", "build", "new", [], EXIT_WRITE, "could not write checkpoint step 1"),
    ("checkpoints/latest", "build", "new", [], EXIT_WRITE, "could not write checkpoint step 1"),
    ("training.png", "build", "new", [], 0, "warning: could not draw"),
    ("training.png.tmp.png", "build", "new", [], 0, "warning: could not draw"),
    ("tensorboard", "build", "new", ["train.report_to=[jsonl,tensorboard]"], 0,
     "warning: TensorBoard events are not written"),
    ("export", "build", "new", ["train.export=true"], EXIT_WRITE, "could not write the export"),
    ("export.tmp", "build", "new", ["train.export=true"], EXIT_WRITE, "could not write the export"),
    ("retrieval.json", "build", "new", ["train.final_eval_samples=1"], 0, "warning: could not write"),
    ("config.json", "build", "resumed", [], EXIT_WRITE, "could not write the metrics and config"),
    ("config.before-step-00000006.json", "build", "resumed", [], EXIT_WRITE, "could not write the metrics and config"),
    ("metrics.jsonl", "build", "from-4", [], EXIT_WRITE, "could not write the metrics and config"),
    ("metrics.rolled-back.jsonl", "build", "from-4", [], EXIT_WRITE, "could not write the metrics and config"),
    ("checkpoints/step-00000007", "build", "resumed", [], EXIT_WRITE, "could not write checkpoint step 7"),
    ("checkpoints/latest", "build", "resumed", [], EXIT_WRITE, "could not write checkpoint step 7"),
]
DURING_FOLDERS = {"checkpoints", "checkpoints/step-00000001.tmp", "checkpoints/step-00000001",
                  "checkpoints/step-00000007", "tensorboard", "export", "export.tmp"}
# A pipe where a folder belongs is refused by the check a link there meets: links only for folders.
DURING_CASES = [(*case, kind) for case in DURING for kind in ("link", "fifo")
                if kind == "link" or case[0] not in DURING_FOLDERS]


@pytest.mark.parametrize("entry,when,start,extra,code,words,kind", DURING_CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[-1]}" for c in DURING_CASES])
def test_a_link_or_pipe_put_in_the_folder_during_the_run_is_refused_where_it_is_used(
        tmp_path, straight, outside, capsys, monkeypatch, entry, when, start, extra, code, words, kind):
    run = tmp_path / "run"
    if start == "new":
        command = ["train", f"out_dir={run}", *overridden(ONE_STEP, *extra)]
    else:
        copy_run(straight, run)
        command = ["train", f"resume={run if start == 'resumed' else run / 'checkpoints' / 'step-00000004'}",
                   *(["train.steps=7"] if start == "resumed" else [])]
    target = outside / ("folder" if entry in DURING_FOLDERS else "file.txt")
    _plant_while(monkeypatch, when, run, entry, kind, target)
    before = snapshot(outside)
    with no_hang():
        got = main(command)
    out = said(capsys)
    assert got == code, out
    assert words in out and _bare(named(run / entry, kind, target)) in _bare(out), out  # a warning may wrap mid-path
    assert snapshot(outside) == before


# ---------------------------------------------------------------------------------- hard links


@pytest.mark.parametrize("entry", [".lock", "metrics.jsonl", "metrics.rolled-back.jsonl"])
def test_a_file_written_in_place_that_is_a_hard_link_is_refused(tmp_path, straight, capsys, entry):
    """A hard link is no symbolic link to lstat, but appending to it (the metrics) or truncating it (the lock)
    writes the file outside the run: refused. Resumed from step 4, steps 5-6 would be rolled back."""
    run = copy_run(straight, tmp_path / "run")
    outside = tmp_path / "outside.txt"
    outside.write_text("a file of someone else's\n")
    (run / entry).unlink(missing_ok=True)
    os.link(outside, run / entry)
    assert main(["train", f"resume={run / 'checkpoints' / 'step-00000004'}"]) == EXIT_CONFIG
    assert f"{run / entry} is a file with 2 names (hard links)" in said(capsys)
    assert outside.read_text() == "a file of someone else's\n"


@pytest.mark.parametrize("entry,when,words", [
    (".lock", "open", "could not write to the run folder"),
    ("config.json.tmp", "open", "could not write to the run folder"),  # truncated when opened: checked before
    ("metrics.jsonl", "build", "metrics.jsonl (step 1)"),
])
def test_a_hard_link_put_in_the_folder_during_the_run_is_refused_where_it_is_written(
        tmp_path, capsys, monkeypatch, entry, when, words):
    run, outside = tmp_path / "run", tmp_path / "outside.txt"
    outside.write_text("a file of someone else's\n")
    name = "open_run_folder" if when == "open" else "build"
    original = getattr(trainer, name)

    def planting(*args, **kwargs):
        os.link(outside, run / entry)
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, name, planting)
    assert main(["train", f"out_dir={run}", *ONE_STEP]) == EXIT_WRITE
    out = said(capsys)
    assert words in out and f"{run / entry} is a file with 2 names (hard links)" in out, out
    assert outside.read_text() == "a file of someone else's\n"


def test_a_run_copied_with_hard_links_resumes_once_its_in_place_files_are_copied(tmp_path, straight, capsys):
    """Checkpoints and config.json are only read or replaced by a rename: hard links there change nothing outside."""
    run, original = tmp_path / "run", tmp_path / "original"
    copy_run(straight, original)
    shutil.copytree(original, run, copy_function=os.link)  # cp -al
    before = snapshot(original)
    assert main(["train", f"resume={run}", "train.steps=7"]) == EXIT_CONFIG
    assert "is a file with 2 names (hard links)" in said(capsys)
    for name in (".lock", "metrics.jsonl"):  # as the message says: a copy of its own
        shutil.copyfile(run / name, run / f"{name}.copy")
        os.replace(run / f"{name}.copy", run / name)
    assert main(["train", f"resume={run}", "train.steps=7"]) == 0
    assert sorted(losses(run)) == list(range(1, 8))
    assert snapshot(original) == before
