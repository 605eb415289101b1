"""train.lr=auto and train.warmup_steps=auto: chosen for what is trained, said at startup, kept on resume."""

import json

import pytest

from oomb.cli import main
from oomb.train.config import load_config
from oomb.train.schedule import auto_schedule

RUN = ["data.seq_len=256", "train.chunk_size=128", "train.page_size=64", "train.device=cpu", "train.export=false"]


@pytest.mark.parametrize("overrides,lr,warmup,why", [
    (["model.path=m", "train.steps=1000"], 1e-5, 30, "full fine-tune of a pretrained model"),
    (["model.path=m", "lora.r=16", "train.steps=100"], 2e-4, 3, "LoRA on a pretrained model"),
    ([], 3e-3, 5, "the built-in tiny model"),  # the README's main job keeps its toy values
    (["model.preset=qwen2.5-7b"], 3e-4, 4, "a random-init qwen2.5-7b model"),  # 3e-3 diverged it on the H200
    (["model.preset=qwen2.5-0.5b", "lora.r=8", "train.steps=10"], 2e-4, 1, "LoRA on a random-init qwen2.5-0.5b"),
])
def test_auto_values_follow_what_is_trained(overrides, lr, warmup, why):
    auto = auto_schedule(load_config(None, overrides))
    assert (auto.lr, auto.warmup_steps) == (lr, warmup) and auto.why.startswith(why)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_startup_line_config_and_steps_use_the_auto_values(tmp_path, capsys, model_dir):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", f"model.path={model_dir}", "data.task=passkey", "train.steps=2",
                 *RUN]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "lr 1e-05 (auto: full fine-tune of a pretrained model), warmup 1 (auto: 3% of 2 steps)" in out
    saved = json.loads((run / "config.json").read_text())["train"]
    assert saved["lr"] == 1e-5 and saved["warmup_steps"] == 1  # the numbers, so a resume keeps them
    assert _metrics(run)[0]["lr"] == pytest.approx(1e-5)  # the step after one warmup step: the peak


def test_an_explicit_value_wins(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=1", "train.lr=0.02", "train.warmup_steps=0", *RUN]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "lr 0.02, warmup 0, chunk 128" in out
    assert _metrics(run)[0]["lr"] == pytest.approx(0.02 * 0.1)  # after the only step: the cosine's end


def test_a_resumed_run_keeps_the_values_it_started_with(tmp_path, capsys, model_dir):
    """A config file without train.lr (auto) on resume: the run's own values, whatever auto would say today."""
    spec = tmp_path / "run.yaml"
    spec.write_text(f"model:\n  path: {model_dir}\ndata:\n  task: passkey\n  seq_len: 256\n"
                    "train:\n  steps: 2\n  save_every: 1\n  chunk_size: 128\n  page_size: 64\n  device: cpu\n"
                    "  export: false\n")
    for name, started in (("auto", []), ("explicit", ["train.lr=0.02", "train.warmup_steps=3"])):
        run = tmp_path / name
        assert main(["train", str(spec), f"out_dir={run}", *started]) == 0
        config_before = (run / "config.json").read_text()
        capsys.readouterr()
        assert main(["train", str(spec), f"out_dir={run}", f"resume={run / 'checkpoints' / 'step-00000001'}"]) == 0
        out = capsys.readouterr().out
        assert "replaces the checkpoint's" not in out and "settings differ" not in out
        assert (run / "config.json").read_text() == config_before  # the same resolved settings: nothing recorded
        lr, warmup = (0.02, 3) if started else (1e-5, 1)
        assert f"lr {lr:g}, warmup {warmup}," in out.replace("\n", "")


def test_a_word_other_than_auto_is_refused(tmp_path, capsys):
    assert main(["train", f"out_dir={tmp_path / 'r'}", "train.lr=fast", *RUN]) == 2
    assert "train.lr='fast': use auto (chosen for what is trained" in capsys.readouterr().out.replace("\n", "")
    assert main(["train", f"out_dir={tmp_path / 'r'}", "train.warmup_steps=some", *RUN]) == 2
    assert "train.warmup_steps='some': use auto" in capsys.readouterr().out.replace("\n", "")
