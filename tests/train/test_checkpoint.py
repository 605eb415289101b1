"""Checkpoints: atomic, verified, exact resume after SIGKILL, and an export transformers loads."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from oomb.cli import main
from oomb.train.config.presets import build_model
from oomb.train.runfolder.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

SMALL_RUN = ["data.seq_len=512", "train.chunk_size=256", "train.page_size=64", "train.lr=0.01",
             "train.warmup_steps=2", "train.device=cpu"]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _model_and_optimizer():
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_round_trip_and_latest(tmp_path):
    model, opt, sched = _model_and_optimizer()
    save_checkpoint(tmp_path, 3, model, opt, sched)
    ckpt = save_checkpoint(tmp_path, 5, model, opt, sched)
    assert find_checkpoint(tmp_path) == ckpt and ckpt.name == "step-00000005"
    assert not list(tmp_path.glob("checkpoints/*.tmp"))
    fresh, opt2, sched2 = _model_and_optimizer()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    assert load_checkpoint(ckpt, fresh, opt2, sched2) == 5
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_checkpoint_is_detected(tmp_path, damage):
    model, opt, sched = _model_and_optimizer()
    ckpt = save_checkpoint(tmp_path, 1, model, opt, sched)
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        f.unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        verify_checkpoint(ckpt)


def test_crash_while_writing_keeps_the_previous_checkpoint(tmp_path):
    model, opt, sched = _model_and_optimizer()
    good = save_checkpoint(tmp_path, 2, model, opt, sched)
    debris = tmp_path / "checkpoints" / "step-00000004.tmp"  # what a kill mid-write leaves
    debris.mkdir()
    (debris / "model.safetensors").write_bytes(b"partial")
    assert find_checkpoint(tmp_path) == good
    verify_checkpoint(good)
    assert save_checkpoint(tmp_path, 4, model, opt, sched).name == "step-00000004"  # debris replaced


def test_resume_after_sigkill_gives_the_same_losses(tmp_path):
    steps = 8
    straight = tmp_path / "straight"
    assert main(["train", f"out_dir={straight}", f"train.steps={steps}", "train.export=false", *SMALL_RUN]) == 0

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "oomb.cli", "train", f"out_dir={run}", f"train.steps={steps}",
           "train.save_every=2", "train.export=false", *SMALL_RUN]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    deadline = time.monotonic() + 600  # ends a hang only: the wait is for the fifth step, however long it takes
    while proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no fifth step after 600 s: the run hangs")
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-500:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    latest = find_checkpoint(run)
    done = json.loads((latest / "state.json").read_text())["step"]
    assert 2 <= done < steps

    assert main(["train", f"resume={run}"]) == 0
    resumed = _losses(run)
    expected = _losses(straight)
    assert sorted(resumed) == list(range(1, steps + 1))  # rolled-back steps ran again, once each
    for step in range(1, steps + 1):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6), step
    if (run / "metrics.rolled-back.jsonl").exists():  # steps after the last checkpoint are kept aside
        assert all(json.loads(x)["step"] > done for x in (run / "metrics.rolled-back.jsonl").read_text().splitlines())


def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=3", *SMALL_RUN]) == 0
    exported = AutoModelForCausalLM.from_pretrained(run / "export", attn_implementation="eager")
    trained = build_model("tiny", dtype=torch.float32, device="cpu", attn_implementation="eager")
    trained.load_state_dict(load_file(find_checkpoint(run) / "model.safetensors"), strict=False)
    ids = torch.randint(0, 64, (1, 300))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, rtol=0, atol=0)


def test_resume_without_checkpoint_is_refused(tmp_path, capsys):
    assert main(["train", f"resume={tmp_path}"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().out


def test_resume_with_fewer_steps_than_done_is_refused_before_work(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=4", "train.export=false", *SMALL_RUN]) == 0
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    capsys.readouterr()
    assert main(["train", f"resume={run}", "train.steps=2"]) == 2
    said = capsys.readouterr().out.replace("\n", "")
    assert "after step 4, past train.steps=2" in said and "train.steps=6" in said
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before  # untouched
    # As many steps as were done: it finishes (the export), and the progress line shows no nan loss.
    assert main(["train", f"resume={run}", "train.steps=4"]) == 0
    said = capsys.readouterr().out
    assert "all 4 steps were done before" in said and "nan" not in said


def test_a_changed_lr_on_resume_is_applied_not_ignored(tmp_path, capsys):
    """resume=... train.lr=X: the schedule continues with the new peak rate (it used to keep the saved one)."""
    run = tmp_path / "run"
    base = [f"out_dir={run}", "train.steps=4", "train.save_every=2", "train.keep_last=0", *SMALL_RUN]
    assert main(["train", *base]) == 0
    before = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    capsys.readouterr()
    ckpt = run / "checkpoints" / "step-00000002"
    assert main(["train", f"resume={ckpt}", "train.lr=0.005"]) == 0
    assert "replaces the checkpoint's 0.01" in capsys.readouterr().out
    after = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert after[2] == before[2]  # steps before the resume are kept as they were
    for step in (3, 4):
        assert after[step] == pytest.approx(before[step] / 2, rel=1e-12), step
    # config.json now holds the resumed settings (the first one kept), so a plain resume continues them.
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 0.005
    assert json.loads((run / "config.before-step-00000002.json").read_text())["train"]["lr"] == 0.01
    capsys.readouterr()
    assert main(["train", f"resume={run}", "train.steps=5"]) == 0
    out = capsys.readouterr().out
    assert "replaces the checkpoint" not in out
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 5 and last["lr"] < before[4]  # on the new, halved schedule


def test_lora_trains_only_adapters_and_exports_merged(tmp_path):
    pytest.importorskip("peft")
    run = tmp_path / "lora"
    assert main(["train", f"out_dir={run}", "train.steps=3", "lora.r=4", "lora.targets=q_proj,v_proj",
                 *SMALL_RUN]) == 0
    saved = load_file(find_checkpoint(run) / "model.safetensors")
    assert saved and all("lora_" in name for name in saved)  # the checkpoint holds the adapters only
    assert any(float(t.abs().max()) > 0 for n, t in saved.items() if "lora_B" in n)  # and they moved

    # Rebuild: the run's seed gives the same base weights; the merged export must equal base + adapters.
    import peft

    torch.manual_seed(0)  # train.seed
    base = build_model("tiny", dtype=torch.float32, device="cpu", attn_implementation="eager")
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16.0, target_modules=["q_proj", "v_proj"]))
    missing, unexpected = adapted.load_state_dict(saved, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    merged = AutoModelForCausalLM.from_pretrained(run / "export", attn_implementation="eager")
    ids = torch.randint(0, 64, (1, 200))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)
    exported = merged.state_dict()
    for name, value in initial.items():  # frozen weights left as initialised, adapted ones merged
        same = torch.equal(exported[name], value)
        assert same != ("q_proj" in name or "v_proj" in name), name


def test_lora_with_unknown_targets_is_refused(tmp_path, capsys):
    pytest.importorskip("peft")
    assert main(["train", f"out_dir={tmp_path / 'r'}", "lora.r=4", "lora.targets=qkv", *SMALL_RUN]) == 2
    assert "lora.targets names no layer" in capsys.readouterr().out
