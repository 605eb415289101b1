"""On a GPU: `oomb train`'s auto settings take the whole sequence as one chunk (each layer computed once) where its
activations fit, and the step it runs is the step the plan predicted. Run with `pytest -m gpu`."""

import json

import pytest

from oomb.cli import main

pytestmark = pytest.mark.gpu


def test_a_sequence_that_fits_whole_runs_as_one_chunk(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", f"out_dir={out}", "data.seq_len=4096", "train.steps=2", "train.device=cuda"]) == 0
    printed = capsys.readouterr().out.replace("\n", " ")
    assert "chunk 4096 (the whole sequence: no layer computed twice)" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["chunk_size"] == 4096 and config["train"]["recompute"] == "chunk"
    assert config["train"]["cache_attention"] is False
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["loss"] is not None for m in metrics)
