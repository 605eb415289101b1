"""A run records its data files and base model (<run>/inputs.json, paths made absolute): a resume whose data or
base changed is refused, naming the file, how it changed and the key that accepts it; with the key it goes on
and the record follows. Real files and real runs of a tiny model on CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tiny_models import tiny_model

from oomb.cli import main
from oomb.train.data.corpus import Source
from oomb.train.data.identity import (
    SAMPLE_BYTES,
    WHOLE_BYTES,
    DataChanged,
    identify,
    unwatch,
    watch,
)
from oomb.train.data.rows import open_rows

RUN = ["data.task=text", "data.seq_len=512", "train.chunk_size=256", "train.page_size=64", "train.lr=0.01",
       "train.warmup_steps=1", "train.device=cpu", "train.export=false", "train.save_every=2"]


def said(capsys) -> str:
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def rows_file(path: Path, n: int = 40, word: str = "fox") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"row {i}: the quick brown {word}. " * (3 + i % 5)}) + "\n"
                            for i in range(n)))
    return path


def trained(tmp_path: Path, capsys, *args: str, steps: int = 2) -> Path:
    """A run of ``steps`` steps (checkpoint at step 2) on a tiny llama in tmp_path/model."""
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", f"model.path={tmp_path / 'model'}", *RUN, f"train.steps={steps}",
                 *args]) == 0, said(capsys)
    capsys.readouterr()
    return run


@pytest.fixture
def folder(tmp_path, model_dir) -> Path:
    rows_file(tmp_path / "data" / "rows.jsonl")
    return tmp_path


def test_a_new_run_records_its_files_with_absolute_paths(folder, capsys):
    run = trained(folder, capsys, f"data.paths=[{folder / 'data'}]")
    record = json.loads((run / "inputs.json").read_text())
    (rows,) = record["data"]["data.paths"]
    assert rows["path"] == str(folder / "data" / "rows.jsonl")
    assert rows["bytes"] == (folder / "data" / "rows.jsonl").stat().st_size
    assert record["model"]["path"] == str(folder / "model")
    assert [f["name"] for f in record["model"]["files"]] == ["model.safetensors"]
    config = json.loads((run / "config.json").read_text())
    assert config["data"]["accept_changed"] is False and config["model"]["accept_changed"] is False


def test_rows_appended_to_a_jsonl_refuse_the_resume_until_the_key_accepts_them(folder, capsys):
    data = folder / "data" / "rows.jsonl"
    run = trained(folder, capsys, f"data.paths=[{data}]")
    before = data.stat().st_size
    with open(data, "a") as f:
        f.write(json.dumps({"text": "a row added after the run started"}) + "\n")
    metrics = (run / "metrics.jsonl").read_text()
    assert main(["train", f"resume={run}", "train.steps=3"]) == 2
    out = said(capsys)
    assert f"cannot resume {run}: what it trains on changed since the run recorded it in {run / 'inputs.json'}" in out
    assert f"data.paths: {data}: {data.stat().st_size:,} bytes, was {before:,} (grown" in out, out
    assert f"oomb train resume={run} data.accept_changed=true" in out
    assert (run / "metrics.jsonl").read_text() == metrics  # refused before any work
    assert main(["train", f"resume={run}", "train.steps=3", "data.accept_changed=true"]) == 0
    out = said(capsys)
    assert f"note: data.accept_changed=true: the run goes on with its data as it is now (1 change); {run}" in out
    assert json.loads((run / "inputs.json").read_text())["data"]["data.paths"][0]["bytes"] == data.stat().st_size
    assert json.loads((run / "config.json").read_text())["data"]["accept_changed"] is False  # one resume's word
    assert main(["train", f"resume={run}", "train.steps=4"]) == 0  # the record follows the file


def test_a_text_file_rewritten_at_the_same_size_and_a_new_file_in_the_folder_are_named(folder, capsys):
    notes = folder / "text" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    run = trained(folder, capsys, f"data.paths=[{notes.parent}]")
    notes.write_text("THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG. " * 40)  # same size, other bytes
    (notes.parent / "more.md").write_text("another document " * 30)
    assert main(["train", f"resume={run}", "train.steps=3"]) == 2
    out = said(capsys)
    assert f"data.paths: {notes}: other content at the same size ({notes.stat().st_size:,} bytes)" in out, out
    assert f"data.paths: {notes.parent / 'more.md'}: a new file, found through '{notes.parent}'" in out, out
    assert "data.accept_changed=true" in out and "model.accept_changed" not in out
    assert main(["train", f"resume={run}", "train.steps=3", "data.accept_changed=true"]) == 0


def test_a_replaced_model_weight_file_refuses_a_lora_resume_until_the_key_accepts_it(folder, capsys):
    run = trained(folder, capsys, f"data.paths=[{folder / 'data'}]", "lora.r=4")
    weights = folder / "model" / "model.safetensors"
    other = folder / "other"
    tiny_model("llama", seed=1, vocab_size=300).save_pretrained(other)  # the same shape, other values
    os.replace(other / "model.safetensors", weights)
    assert main(["train", f"resume={run}", "train.steps=3"]) == 2
    out = said(capsys)
    assert f"model.path: {weights}: other content at the same size" in out, out
    assert "its weights were trained from that base model" in out
    assert f"oomb train resume={run} model.accept_changed=true" in out and "data.accept_changed" not in out
    assert main(["train", f"resume={run}", "train.steps=3", "model.accept_changed=true"]) == 0
    assert "note: model.accept_changed=true: the run goes on with the base model as it is now" in said(capsys)
    (recorded,) = json.loads((run / "inputs.json").read_text())["model"]["files"]
    assert recorded["fingerprint"] == identify(weights).fingerprint  # the record follows the new base


def test_another_base_model_folder_with_other_weights_is_refused(folder, capsys):
    run = trained(folder, capsys, f"data.paths=[{folder / 'data'}]", "lora.r=4")
    tiny_model("llama", seed=1, vocab_size=300).save_pretrained(folder / "other")
    assert main(["train", f"resume={run}", "train.steps=3", f"model.path={folder / 'other'}"]) == 2
    out = said(capsys)
    assert f"model.path: {folder / 'other' / 'model.safetensors'}: other content at the same size" in out, out
    assert f"model.path is {folder / 'other'}; the run started from {folder / 'model'}" in out


def test_a_missing_data_file_is_named_as_missing(folder, capsys):
    extra = rows_file(folder / "data" / "extra.jsonl", n=10)
    run = trained(folder, capsys, f"data.paths=[{folder / 'data'}]")
    extra.unlink()
    assert main(["train", f"resume={run}", "train.steps=3"]) == 2
    assert f"data.paths: {extra}: missing" in said(capsys)


def test_a_resume_from_another_folder_reads_the_run_s_own_relative_paths(tmp_path, monkeypatch, capsys):
    """Relative data.paths and model.path are recorded absolute: a resume from a folder that holds other files of
    the same names reads the first ones, and runs steps 3-4 again to the losses they had."""
    first, second = tmp_path / "first", tmp_path / "second"
    for root, word, seed in ((first, "fox", 0), (second, "cat", 1)):
        rows_file(root / "data" / "rows.jsonl", word=word)
        tiny_model("llama", seed=seed, vocab_size=300).save_pretrained(root / "model")
    monkeypatch.chdir(first)
    assert main(["train", "out_dir=run", "model.path=model", "data.paths=[data/rows.jsonl]", *RUN,
                 "train.steps=4"]) == 0
    config = json.loads((first / "run" / "config.json").read_text())
    assert config["model"]["path"] == str(first / "model")
    assert config["data"]["paths"] == [str(first / "data" / "rows.jsonl")]
    straight = losses(first / "run")
    monkeypatch.chdir(second)
    capsys.readouterr()
    assert main(["train", f"resume={first / 'run' / 'checkpoints' / 'step-00000002'}"]) == 0, said(capsys)
    assert "resuming" in said(capsys)
    assert losses(first / "run") == straight


def test_a_jsonl_reader_stops_at_rows_appended_while_it_reads(tmp_path):
    data = rows_file(tmp_path / "rows.jsonl", n=5)
    watch([identify(data)])
    try:
        reader = iter(open_rows(Source(data, "jsonl")))
        assert next(reader).number == 0
        with open(data, "a") as f:
            f.write(json.dumps({"text": "appended"}) + "\n")
        with pytest.raises(DataChanged, match=rf"{data} changed during the run: .* bytes, was .* \(grown"):
            next(reader)
    finally:
        unwatch()


def test_a_touched_file_with_the_same_bytes_is_not_a_change(tmp_path):
    data = rows_file(tmp_path / "rows.jsonl", n=5)
    watch([identify(data)])
    try:
        os.utime(data, ns=(1, 1))
        assert [row.number for row in open_rows(Source(data, "jsonl"))] == list(range(5))
    finally:
        unwatch()


def test_a_large_file_is_fingerprinted_from_spread_blocks(tmp_path):
    """Over WHOLE_BYTES: the size and sampled blocks; a change inside a block or of the size is seen."""
    big = tmp_path / "big.txt"
    size = WHOLE_BYTES + 5 * SAMPLE_BYTES
    with open(big, "wb") as f:
        f.truncate(size)
    first = identify(big)
    with open(big, "r+b") as f:
        f.seek(size - 1)  # the last block is always sampled
        f.write(b"x")
    assert identify(big).fingerprint != first.fingerprint
    with open(big, "ab") as f:
        f.write(b"more")
    assert identify(big).size == size + 4
