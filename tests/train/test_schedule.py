"""The learning-rate schedule: transformers' schedules (train.lr_scheduler), the rate a step used in metrics.jsonl,
warmup as steps or a ratio, train.epochs, resume; train.lr=auto and train.warmup_steps=auto: chosen for what is
trained, said at startup, kept on resume."""

import json
import math
import types

import pytest
import torch
import transformers

from oomb.cli import main
from oomb.train.config.checks import check_config
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.loop.distributed import DistributedContext
from oomb.train.loop.schedule import (
    MIN_LR_SCHEDULES,
    SCHEDULES,
    auto_schedule,
    build_scheduler,
    continue_schedule,
    resolve_schedule,
    sequences_per_pass,
)

RUN = ["data.seq_len=256", "train.chunk_size=128", "train.page_size=64", "train.device=cpu", "train.export=false"]
ONE = DistributedContext.single(torch.device("cpu"))  # a single process


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
    # The rate each step used: warmup from 0 (transformers'), then the peak.
    assert [r["lr"] for r in _metrics(run)] == [0.0, pytest.approx(1e-5)]


def test_an_explicit_value_wins(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=1", "train.lr=0.02", "train.warmup_steps=0", *RUN]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "lr 0.02, warmup 0, schedule cosine_with_min_lr to 0.1x, chunk 128" in out
    assert _metrics(run)[0]["lr"] == pytest.approx(0.02)  # the rate the only step used: the peak


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


# --- transformers' schedules ------------------------------------------------------------------------------------


def _optimizer(lr):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _rates(scheduler, steps):
    """The rate each of ``steps`` optimizer steps uses, as the trainer logs it (before the scheduler steps)."""
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


def _transformers_rates(name, lr, warmup, steps, min_lr_ratio=0.1):
    extra = {"min_lr_rate": min_lr_ratio} if name in MIN_LR_SCHEDULES else None
    scheduler = transformers.get_scheduler(name, _optimizer(lr), num_warmup_steps=warmup, num_training_steps=steps,
                                           scheduler_specific_kwargs=extra)
    return _rates(scheduler, steps)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_is_transformers_own(name):
    warmup = 0 if name == "constant" else 4
    cfg = load_config(None, [f"train.lr_scheduler={name}", "train.steps=20", f"train.warmup_steps={warmup}",
                             "train.lr=0.1"])
    ours = _rates(build_scheduler(cfg, _optimizer(0.1)), 20)
    assert ours == _transformers_rates(name, 0.1, warmup, 20)
    if warmup and name != "cosine_warmup_with_min_lr":  # (its warmup starts at 1/warmup of the peak by design)
        assert ours[0] == 0.0 and ours[warmup] == pytest.approx(0.1)  # warmup from 0 to the peak


def test_the_default_keeps_the_hand_written_cosine_after_warmup():
    """cosine_with_min_lr is the schedule oomb had: warmup, then a half cosine to train.min_lr_ratio of the peak.
    Only the warmup changed: from 0 (step / warmup), where it started at 1/(warmup + 1) of the peak."""
    cfg = load_config(None, ["train.steps=30", "train.warmup_steps=5", "train.lr=1.0", "train.min_lr_ratio=0.2"])
    assert cfg.train.lr_scheduler == "cosine_with_min_lr"
    rates = _rates(build_scheduler(cfg, _optimizer(1.0)), 30)
    for step, rate in enumerate(rates):
        if step < 5:
            assert rate == pytest.approx(step / 5)
        else:
            old = 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * (step - 5) / 25))
            assert rate == pytest.approx(old, rel=1e-12)


def test_a_run_logs_the_rates_transformers_gives_with_a_warmup_ratio(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=4", "train.lr=0.02", "train.lr_scheduler=linear",
                 "train.warmup_ratio=0.5", *RUN]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "lr 0.02, warmup 2 (train.warmup_ratio=0.5 of 4 steps), schedule linear," in out
    assert [r["lr"] for r in _metrics(run)] == pytest.approx(_transformers_rates("linear", 0.02, 2, 4))
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["warmup_ratio"], saved["warmup_steps"], saved["lr_scheduler"]) == (0.5, "auto", "linear")


def test_a_resume_continues_this_runs_schedule_from_the_checkpoints_step():
    """The scheduler's state (step, peaks) comes from the checkpoint; the rates from this run's schedule and lr."""
    first = load_config(None, ["train.steps=10", "train.warmup_steps=3", "train.lr=0.1"])
    optimizer = _optimizer(0.1)
    scheduler = build_scheduler(first, optimizer)
    _rates(scheduler, 5)
    saved = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    resumed = load_config(None, ["train.steps=20", "train.warmup_steps=3", "train.lr=0.05"])
    optimizer = _optimizer(0.05)  # built as the trainer does: scheduler first, then the checkpoint loaded
    scheduler = build_scheduler(resumed, optimizer)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    assert continue_schedule(scheduler, 0.05) == 0.1  # the peak it replaced
    expected = _transformers_rates("cosine_with_min_lr", 0.05, 3, 20)[5:]
    assert _rates(scheduler, 15) == pytest.approx(expected, rel=1e-12)
    assert continue_schedule(scheduler, 0.05) is None


def test_a_checkpoint_of_the_hand_written_schedule_resumes_on_transformers():
    """Checkpoints written before: a LambdaLR over a closure (its state names no lambda); it loads, and the run
    continues on transformers' schedule from the checkpoint's step."""
    optimizer = _optimizer(0.1)
    old = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    _rates(old, 2)
    state = torch.load(_saved(old.state_dict()), weights_only=True)  # as a checkpoint holds it
    cfg = load_config(None, ["train.steps=10", "train.warmup_steps=3", "train.lr=0.1"])
    fresh = _optimizer(0.1)
    scheduler = build_scheduler(cfg, fresh)
    fresh.load_state_dict(optimizer.state_dict())
    scheduler.load_state_dict(state)
    assert continue_schedule(scheduler, 0.1) is None
    assert _rates(scheduler, 8) == pytest.approx(_transformers_rates("cosine_with_min_lr", 0.1, 3, 10)[2:])


def _saved(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("overrides,message", [
    (["train.lr_scheduler=cosine_annealing"], r"train.lr_scheduler='cosine_annealing': choose one of "
                                              r"cosine_with_min_lr, linear, cosine"),
    (["train.lr_scheduler=reduce_lr_on_plateau"], r"it follows a validation metric .*; choose one of"),
    (["train.warmup_steps=3", "train.warmup_ratio=0.1"], r"train.warmup_steps=3 and train.warmup_ratio=0.1 both "
                                                         r"set the warmup: give one of them"),
    (["train.warmup_ratio=1.5"], r"train.warmup_ratio=1.5 must be in \[0, 1\]"),
    (["train.lr_scheduler=constant", "train.warmup_steps=2"], r"constant has no warmup .* constant_with_warmup"),
    (["train.lr_scheduler=linear", "train.min_lr_ratio=0.3"], r"train.min_lr_ratio=0.3 is used by "
                                                               r"cosine_with_min_lr and cosine_warmup_with_min_lr"),
    (["train.lr_scheduler=polynomial", "train.lr=1e-8"], r"polynomial with train.lr=1e-08: transformers refuses"),
    (["train.epochs=2"], r"train.epochs: data.task=passkey draws new sequences every step.* set train.steps"),
    (["train.epochs=0", "data.task=text"], r"train.epochs=0 must be > 0"),
])
def test_schedule_settings_that_cannot_work_are_refused_before_any_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(None, ["train.device=cpu", *overrides]))


def test_constant_without_warmup_settles_warmup_auto_to_none():
    cfg = load_config(None, ["train.lr_scheduler=constant", "train.lr=0.01"])
    assert resolve_schedule(cfg, None, ONE) == "lr 0.01, warmup 0 (constant has none), schedule constant"
    assert cfg.train.warmup_steps == 0


# --- train.epochs -----------------------------------------------------------------------------------------------


def test_steps_and_epochs_are_one_choice():
    with pytest.raises(ConfigError, match=r"train.steps=50 and train.epochs=2 both set how long the run trains: give "
                                          r"one of them \(train.epochs=null trains train.steps steps\)"):
        load_config(None, ["train.epochs=2", "train.steps=50"])
    assert load_config(None, ["train.epochs=2"]).train.epochs == 2.0


def test_a_pass_is_counted_by_packing_it_and_the_position_stays(tmp_path):
    from oomb.train.data.corpus import load_tokenizer
    from oomb.train.data.packing import PackedCorpus

    docs = ["a" * 100, "b" * 37, "c" * 250]
    for i, text in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(text)
    corpus = PackedCorpus(tmp_path, load_tokenizer(None), 64, seed=1)
    inputs = types.SimpleNamespace(corpus=corpus)
    tokens = sum(len(d) + 1 for d in docs)  # each document and its end-of-text token
    assert sequences_per_pass(inputs, ONE) == math.ceil(tokens / 64) == 7
    fresh = PackedCorpus(tmp_path, load_tokenizer(None), 64, seed=1)
    for _ in range(9):  # the count left the stream where it was: the same sequences as a corpus never counted
        assert torch.equal(corpus.next_sequence()[0], fresh.next_sequence()[0])


def test_streamed_data_has_no_pass_to_count():
    stream = types.SimpleNamespace(kind="stream", name="owner/name:train")
    with pytest.raises(ConfigError, match=r"train.epochs: data.paths streams owner/name:train, and how many "
                                          r"sequences .* set train.steps instead"):
        sequences_per_pass(types.SimpleNamespace(corpus=types.SimpleNamespace(sources=[stream])), ONE)


def test_epochs_become_steps_at_startup_and_a_resume_keeps_them(tmp_path, capsys, model_dir):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"{i}.txt").write_text(f"document {i} " * 20)  # 4 x (11 x 20 + 1) = 884 tokens: 7 sequences of 128
    spec = tmp_path / "run.yaml"
    spec.write_text(f"model:\n  path: {model_dir}\ndata:\n  task: text\n  paths: [{data}]\n  seq_len: 128\n"
                    "train:\n  epochs: 1.5\n  batch_size: 2\n  save_every: 2\n  chunk_size: 64\n  page_size: 64\n"
                    "  device: cpu\n  lr: 0.01\n  export: false\n")
    run = tmp_path / "run"
    assert main(["train", str(spec), f"out_dir={run}"]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "; 6 steps x 2 x 128 tokens (text)" in out  # ceil(1.5 x 7 / 2)
    assert "1.5 epochs = 6 steps (7 packed sequences a pass, 2 a step), lr 0.01" in out
    assert len(_metrics(run)) == 6
    saved = json.loads((run / "config.json").read_text())["train"]
    assert (saved["epochs"], saved["steps"]) == (1.5, 6)
    # The same file on resume: the steps the run counted (no count), from config.json.
    assert main(["train", str(spec), f"out_dir={run}", f"resume={run / 'checkpoints' / 'step-00000004'}"]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "1.5 epochs = 6 steps (as the run started)" in out and "settings differ" not in out
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4, 5, 6]
