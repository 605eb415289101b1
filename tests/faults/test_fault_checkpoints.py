"""A truncated or altered checkpoint is refused on resume, naming the newest good one; and
train.keep_last rotates old checkpoints without touching the newest or the export. (Writes that fail
on a real full disk: test_fault_disk.py.)"""

import shutil

import pytest
import torch
from faultrun import RUN, STEPS, assert_resumes_exactly, losses

from oomb.cli import main
from oomb.train.config.presets import build_model
from oomb.train.runfolder.checkpoint import (
    LATEST,
    find_checkpoint,
    list_checkpoints,
    rotate_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_refused_and_the_good_one_offered(tmp_path, straight, damage, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    victim = run / "checkpoints" / "step-00000006" / "optimizer.pt"
    data = victim.read_bytes()
    flipped = data[:100] + bytes([data[100] ^ 4]) + data[101:]
    victim.write_bytes(data[: len(data) // 3] if damage == "truncate" else flipped)
    capsys.readouterr()
    assert main(["train", f"resume={run}"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    problem = "has" if damage == "truncate" else "does not match its checksum"
    assert f"cannot resume: checkpoint {run / 'checkpoints' / 'step-00000006'}: optimizer.pt {problem}" in out
    good = run / "checkpoints" / "step-00000004"
    assert f"The newest good checkpoint of this run is {good}; continue from it with: oomb train resume={good}" in out
    assert_resumes_exactly(run, straight, resume=good)  # steps 5 and 6 run again; step 6 is rewritten whole
    verify_checkpoint(find_checkpoint(run))


def test_keep_last_keeps_the_newest_and_the_export(tmp_path, straight):
    run = tmp_path / "run"
    args = [a for a in RUN if a != "train.export=false"]
    assert main(["train", f"out_dir={run}", "train.save_every=1", "train.keep_last=2", *args]) == 0
    assert [c.name for c in list_checkpoints(run)] == ["step-00000005", "step-00000006"]
    assert (run / "export" / "config.json").is_file()
    assert find_checkpoint(run).name == "step-00000006"
    # The older kept one is whole: resuming from it repeats step 6 of the uninterrupted run.
    assert_resumes_exactly(run, straight, resume=run / "checkpoints" / "step-00000005")
    assert sorted(losses(run)) == list(range(1, STEPS + 1))


def test_rotation_spares_latest_later_steps_and_removes_debris(tmp_path):
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(tmp_path, step, model, opt, sched)
    (tmp_path / "checkpoints" / LATEST).write_text("step-00000003")  # resumed from 3: 4 and 5 are a later branch
    (tmp_path / "checkpoints" / "step-00000006.tmp").mkdir()  # a kill mid-write
    deleted = rotate_checkpoints(tmp_path, keep_last=2)
    assert [d.name for d in deleted] == ["step-00000001"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        LATEST, "step-00000002", "step-00000003", "step-00000004", "step-00000005"]
    assert rotate_checkpoints(tmp_path, keep_last=1) and find_checkpoint(tmp_path).name == "step-00000003"
    assert rotate_checkpoints(tmp_path, keep_last=0) == []
    verify_checkpoint(find_checkpoint(tmp_path))
