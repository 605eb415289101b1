"""`oomb train`: config precedence and errors, the passkey task, and a real short run."""

import json
import os

import pytest
import torch

from oomb.cli import main
from oomb.train.config.keys import describe_keys
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.data.sources import DIGIT0, KEY, QUERY, PasskeyTask


def test_precedence_cli_over_file_over_defaults(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  steps: 7\n  lr: 0.01\ndata:\n  seq_len: 2048\n")
    cfg = load_config(f, ["train.steps=9", "data.depth=0.5"])
    assert cfg.train.steps == 9  # command line wins
    assert cfg.train.lr == 0.01  # file wins over default
    assert cfg.data.seq_len == 2048 and cfg.data.depth == 0.5
    assert cfg.train.chunk_size == "auto"  # default: the memory plan chooses
    assert cfg.data.needles == 1  # default: one needle per sequence
    assert load_config(None, ["data.task=needle", "data.needles=8"]).data.needles == 8


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.stpes=3"], "unknown config key 'train.stpes'.*did you mean train.steps"),
        (["trian.steps=3"], "unknown config key 'trian'.*did you mean train"),
        (["train.steps=three"], "train.steps .* must be int, got 'three'"),
        (["train.min_lr_ratio=true"], "train.min_lr_ratio .* must be float"),
        (["train"], "must look like key=value"),
        (["train=3"], "must be a section"),
        (["train.steps="], "cannot be null"),
    ],
)
def test_bad_overrides(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(bad)


def test_every_key_is_documented():
    rows = describe_keys()
    assert {"train.steps", "data.seq_len", "model.preset", "out_dir"} <= {k for k, _, _ in rows}
    assert all(doc for _, _, doc in rows), [k for k, _, doc in rows if not doc]


def test_passkey_task_layout_and_determinism():
    task = PasskeyTask(300, digits=4, depth=0.25, seed=3)
    b = task.batch(step=2, batch_size=2)
    assert b.input_ids.shape == (2, 300)
    for row, pos in zip(b.input_ids, b.answer_positions, strict=True):
        key_at = int((row == KEY).nonzero()[0])
        assert abs(key_at - 0.25 * 300) < 10
        assert row[pos[0]] == QUERY
        passkey = row[key_at + 1 : key_at + 5]
        assert torch.equal(row[pos + 1], passkey) and (passkey >= DIGIT0).all()
    assert torch.equal(task.batch(2, 2).input_ids, b.input_ids)  # same step, same data
    answer_only = PasskeyTask(300, digits=4, loss_on="answer").batch(0, 1)
    assert int((answer_only.labels != -100).sum()) == 4


def test_passkey_task_rejects_bad_settings():
    with pytest.raises(ValueError, match="too short"):
        PasskeyTask(10, digits=5)
    with pytest.raises(ValueError, match="depth"):
        PasskeyTask(100, depth=1.5)


def test_train_writes_metrics_and_the_loss_falls(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", f"out_dir={out}", "train.steps=12", "data.seq_len=512", "train.chunk_size=256",
                 "train.page_size=64", "train.lr=0.01", "train.warmup_steps=2"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all({"step", "loss", "tokens", "seconds"} <= r.keys() for r in records)
    assert records[-1]["tokens"] == 12 * 512
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 12


def test_train_refuses_a_used_out_dir(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    assert main(["train", f"out_dir={out}", "train.steps=1"]) == 2
    said = capsys.readouterr().out
    assert "never overwrites" in said and "resume=" not in said  # not a run: nothing to continue
    assert (out / "metrics.jsonl").read_text() == "precious\n"
    (out / "config.json").write_text("{}")  # a run's folder: the message says how to continue it
    assert main(["train", f"out_dir={out}", "train.steps=1"]) == 2
    said = capsys.readouterr().out
    assert "of a run that stopped before its first checkpoint; oomb never overwrites a run" in said
    assert f"oomb train resume={out}\n" in said  # a command that works as printed


def test_train_refuses_bad_settings_before_work(tmp_path, capsys):
    assert main(["train", f"out_dir={tmp_path / 'r'}", "train.chunk_size=100"]) == 2
    out = capsys.readouterr().out
    assert "multiple of train.page_size=128: try train.chunk_size=128, or auto" in out.replace("\n", "")
    assert main(["train", f"out_dir={tmp_path / 'r'}", "data.seq_len=1"]) == 2  # a config error, not a traceback
    assert "data.seq_len=1: a sequence needs at least 2 tokens" in capsys.readouterr().out
    assert main(["train", f"out_dir={tmp_path / 'r'}", "data.task=txt", "data.document_mask=true"]) == 2
    assert "data.task='txt': choose passkey, needle" in capsys.readouterr().out  # the task first, not the mask
    assert not (tmp_path / "r").exists()
    assert main(["train", "model.preset=nope"]) == 2
    assert "unknown model preset 'nope'" in capsys.readouterr().out
    # Attention kernels: a name that is not one, and FlashAttention-4 where it cannot run, with the way out.
    assert main(["train", f"out_dir={tmp_path / 'r'}", "train.attention=flash"]) == 2
    assert "train.attention='flash': use one of auto, torch, triton, fa4" in capsys.readouterr().out
    assert main(["train", f"out_dir={tmp_path / 'r'}", "train.attention=fa4", "train.device=cpu"]) == 2
    out = capsys.readouterr().out.replace("\n", " ")
    assert "train.attention=fa4" in out and "needs a CUDA device" in out and "train.attention=auto" in out
    assert not (tmp_path / "r").exists()


def test_a_refusal_is_printed_once_and_before_the_ranks_leave_their_group(tmp_path, capsys, monkeypatch):
    # Under torchrun a rank that fails alone is stopped by torchrun as soon as the others see the group gone: what it
    # prints after leaving the group may never be written. `oomb train` prints (and flushes) first.
    from oomb.train.loop import distributed

    order = []
    leave = distributed.teardown
    monkeypatch.setattr(distributed, "teardown", lambda ctx: (order.append(("left", capsys.readouterr().out)),
                                                              leave(ctx)))
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    assert main(["train", f"out_dir={out}", "train.steps=1"]) == 2
    assert len(order) == 1 and "never overwrites" in order[0][1]  # printed before the group was left
    assert "never overwrites" not in capsys.readouterr().out  # and not again after


def test_layer_checkpointing_gives_the_same_run(tmp_path):
    common = ["train.steps=3", "data.seq_len=512", "train.chunk_size=256", "train.page_size=64", "train.export=false"]
    assert main(["train", f"out_dir={tmp_path / 'a'}", *common]) == 0
    assert main(["train", f"out_dir={tmp_path / 'b'}", "train.layer_checkpointing=true", *common]) == 0
    la = [json.loads(x)["loss"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert la == pytest.approx(lb, rel=1e-6)


def test_version_is_the_package_version(capsys):
    import oomb

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"oomb {oomb.__version__}"


def test_train_lets_the_cuda_allocator_expand_its_segments_unless_the_user_set_it(tmp_path, monkeypatch, capsys):
    from oomb.train.loop.trainer import ALLOC_CONF

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("a run\n")  # refused after the allocator is set up, before any work
    for user in (None, "PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF):
        monkeypatch.delenv(ALLOC_CONF, raising=False)
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        if user is not None:
            monkeypatch.setenv(user, "garbage_collection_threshold:0.6")
        assert main(["train", f"out_dir={out}", "train.steps=1"]) == 2
        if user is None:
            assert os.environ[ALLOC_CONF] == "expandable_segments:True"
        else:  # what the user chose, alone
            assert os.environ[user] == "garbage_collection_threshold:0.6"
            assert (ALLOC_CONF in os.environ) == (user == ALLOC_CONF)
    capsys.readouterr()


def test_a_cuda_allocator_that_started_already_is_told_too(monkeypatch):
    # Where a check used CUDA before the run set its allocator up, the environment alone would come too late.
    from oomb.train.loop.trainer import ALLOC_CONF, prefer_expandable_segments

    told = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", told.append, raising=False)
    for name in (ALLOC_CONF, "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    prefer_expandable_segments()
    assert told == ["expandable_segments:True"] and os.environ[ALLOC_CONF] == "expandable_segments:True"
    monkeypatch.setenv(ALLOC_CONF, "garbage_collection_threshold:0.6")  # the user's: left alone
    prefer_expandable_segments()
    assert told == ["expandable_segments:True"]
