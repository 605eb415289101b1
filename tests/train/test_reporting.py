"""train.report_to: metrics to W&B (offline here: no network) and TensorBoard, every field metrics.jsonl holds,
continued on resume; what a missing package, a W&B run that cannot start, an unknown name and an old run folder's
train.tensorboard get."""

import importlib.util
import json
import shutil
import struct
from pathlib import Path

import pytest

from oomb.cli import main
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.loop.monitor import metric_fields
from oomb.train.loop.reporting import check_report_to

FAST = ["data.seq_len=256", "train.chunk_size=128", "train.page_size=64", "train.device=cpu", "train.lr=0.01",
        "train.warmup_steps=1", "train.export=false"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _wandb_history(offline_run: Path) -> tuple[dict, list[dict]]:
    """The run record and history rows of an offline W&B run's .wandb file: a LevelDB-format log of protobuf
    Records (32 KiB blocks; each piece a 7-byte header of crc, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(offline_run.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pieces, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += room
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pieces = payload if kind in (1, 2) else pieces + payload
        if kind in (1, 4):
            records.append(pieces)
    run, history = None, []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"id": record.run.run_id, "project": record.run.project, "name": record.run.display_name}
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return run, history


def test_wandb_offline_run_holds_the_metrics_and_a_resume_continues_it(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=4", "train.save_every=2", "train.report_to=[jsonl,wandb]",
                 *FAST]) == 0
    wandb.teardown()  # W&B's service writes the run's file behind finish(); it is whole once the service stops,
    # as at the end of the `oomb train` process (CI read it empty once without this)
    ident = json.loads((run / "wandb-run.json").read_text())
    assert ident["project"] == "oomb"
    (first,) = (run / "wandb").glob(f"offline-run-*-{ident['id']}")  # W&B's files stay in the run folder
    record, history = _wandb_history(first)
    assert record == {"id": ident["id"], "project": "oomb", "name": "run"}
    losses = {r["step"]: r["loss"] for r in _metrics(run)}
    assert {h["train/step"]: h["train/loss"] for h in history} == pytest.approx(losses, rel=1e-6)
    for h, r in zip(history, _metrics(run), strict=True):  # every field of metrics.jsonl, tokens and eta_s too
        assert {k: h[f"train/{k}"] for k in r if k != "step"} == pytest.approx({k: v for k, v in r.items()
                                                                                 if k != "step"}, rel=1e-6)
    assert [h["train/lr"] for h in history][:2] == [0, 0.01]  # the rate each step used: warmup from 0, the peak

    copy = tmp_path / "copy"  # what a crash after checkpoint 2 leaves, resumed
    shutil.copytree(run, copy)
    assert main(["train", f"resume={copy / 'checkpoints' / 'step-00000002'}"]) == 0
    wandb.teardown()
    assert json.loads((copy / "wandb-run.json").read_text()) == ident  # the same W&B run, continued
    (second,) = set((copy / "wandb").glob(f"offline-run-*-{ident['id']}")) - {copy / "wandb" / first.name}
    _, resumed = _wandb_history(second)
    assert {h["train/step"]: h["train/loss"] for h in resumed} == pytest.approx({3: losses[3], 4: losses[4]},
                                                                                 rel=1e-6)


def test_wandb_selected_but_not_installed_stops_before_any_work(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.report_to=[jsonl,wandb]", *FAST]) != 0
    said = " ".join(capsys.readouterr().out.split())
    assert "train.report_to lists wandb, but the wandb package is not installed: pip install 'oomb[wandb]'" in said
    assert not run.exists()


def test_a_wandb_run_that_cannot_start_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", refuse)
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.report_to=wandb", *FAST]) != 0
    said = " ".join(capsys.readouterr().out.split())
    assert "the W&B run could not start: UsageError: api_key not configured" in said
    assert "WANDB_MODE=offline" in said and "Nothing was trained; nothing was left behind" in said
    assert not run.exists()


def test_unknown_reporters_and_the_old_tensorboard_key_are_refused_with_the_new_one(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown \['mlflow'\]; choose from jsonl"):
        check_report_to(load_config(None, ["train.report_to=[jsonl,mlflow]"]))
    with pytest.raises(ConfigError, match=r"train.tensorboard \(command line\) is now train.report_to"):
        load_config(None, ["train.tensorboard=true"])
    # A run folder written before train.report_to resumes as it started.
    old = tmp_path / "config.json"
    old.write_text(json.dumps({"train": {"steps": 3, "tensorboard": True}}))
    assert load_config(old).train.report_to == ["jsonl", "tensorboard"]
    old.write_text(json.dumps({"train": {"tensorboard": False}}))
    assert load_config(old).train.report_to == ["jsonl"]


def test_tensorboard_holds_every_field_of_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=2", "train.report_to=[jsonl,tensorboard]", *FAST]) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    records = _metrics(run)
    fields = {name for r in records for name in r if name != "step"}
    assert {"tokens", "loss_tokens", "seconds", "elapsed", "eta_s", "lr", "host_rss_gib"} <= fields
    assert set(events.Tags()["scalars"]) == {f"train/{name}" for name in fields}
    for name in fields:
        logged = {e.step: e.value for e in events.Scalars(f"train/{name}")}
        assert logged == pytest.approx({r["step"]: r[name] for r in records}, rel=1e-6), name


def test_the_views_get_numbers_and_words_but_not_the_step_or_what_was_not_measured():
    numbers, words = metric_fields({"step": 3, "loss": None, "tokens": 768, "lr": 0.5, "skipped": "non-finite",
                                    "nonfinite_grad": None, "nonfinite_at": "layer 1"})
    assert numbers == {"tokens": 768, "lr": 0.5}
    assert words == {"skipped": "non-finite", "nonfinite_at": "layer 1"}
