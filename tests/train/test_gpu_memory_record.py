"""On a GPU: `oomb train train.memory_snapshot=1` records the allocator from the model's build to the end of step 1,
and memory_peak.json's replayed peak is the allocator's own (sizes as asked, not rounded to blocks). Run with
`pytest -m gpu`."""

import json
import pickle

import pytest
import torch

from oomb.cli import main

pytestmark = pytest.mark.gpu


def test_a_recorded_run_writes_its_snapshot_and_the_peak_it_replays(tmp_path):
    out = tmp_path / "run"
    assert main(["train", f"out_dir={out}", "data.seq_len=2048", "train.chunk_size=512", "train.steps=2",
                 "train.memory_snapshot=1", "train.device=cuda"]) == 0
    peak = json.loads((out / "memory_peak.json").read_text())
    assert peak["recorded"] == "after step 1" and not peak["record_full"]
    # Every allocation of the run is in the record: nothing made before it, and the replayed peak at most the
    # allocator's (blocks round sizes up) and near it.
    assert not [row for row in peak["sites"] if row["site"].startswith("allocated before")]
    assert 0.8 * peak["max_memory_allocated_gib"] <= peak["peak_gib"] <= peak["max_memory_allocated_gib"]
    assert any(row["site"].startswith("oomb/") for row in peak["sites"])
    assert peak["plan_gpu_gib"]["paged store"] > 0
    snapshot = pickle.loads((out / "memory_snapshot.pickle").read_bytes())
    assert snapshot["device_traces"][torch.cuda.current_device()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2  # the run went on after its record
