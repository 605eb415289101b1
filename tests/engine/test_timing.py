"""The step-time model: its rates refit from the records they came from, and its shape."""

import json
from pathlib import Path

import pytest
import torch

from oomb.engine.timing import H200_DENSE, predict_step_seconds, step_flops
from oomb.train.presets import preset_config

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"


def _auto_step(record: str, system: str) -> tuple[int, float]:
    rows = json.loads((RESULTS / record).read_text())["results"]
    row = next(r for r in rows if r["system"] == system)
    assert row["backend"] == "fa4" and row["chunk_size"] == 16384
    assert row["options"]["cache_attention"] in (True, "host") and row["options"]["recompute"] == "layer-host"
    return row["seq_len"], row["step_s"]


def test_the_h200_rates_are_the_fit_of_the_records_they_cite():
    config = preset_config("qwen2.5-7b")
    steps = [_auto_step("core-7b-vs-transformers-64k.json", "oomb-auto"),
             _auto_step("core-7b-vs-transformers-256k.json", "oomb-auto")]
    flops = torch.tensor([step_flops(config, n) for n, _ in steps], dtype=torch.float64)
    seconds = torch.tensor([s for _, s in steps], dtype=torch.float64)
    linear, attention = torch.linalg.solve(flops, seconds).tolist()
    assert linear == pytest.approx(H200_DENSE.linear_s_per_flop, rel=1e-3)
    assert attention == pytest.approx(H200_DENSE.attention_s_per_flop, rel=1e-3)
    for n, s in steps:
        assert predict_step_seconds(config, n) == pytest.approx(s, rel=1e-3)


def test_flops_are_linear_plus_quadratic_in_the_context():
    config = preset_config("qwen2.5-7b")
    (l1, a1), (l2, a2) = step_flops(config, 1 << 16), step_flops(config, 1 << 17)
    assert l2 == 2 * l1 and a2 == 4 * a1
    assert step_flops(config, 1 << 16, batch_size=2) == (2 * l1, 2 * a1)
    # 6 x tokens x matmul parameters: Qwen2.5-7B's 7.07e9 (the embedding is a lookup, the LM head a matmul)
    assert l1 / (6 * (1 << 16)) == pytest.approx(7.07e9, rel=1e-3)


def test_without_the_cache_the_attention_forward_runs_once_more():
    config = preset_config("qwen2.5-7b")
    n = 1 << 19
    linear, attention = step_flops(config, n)
    cached, uncached = predict_step_seconds(config, n), predict_step_seconds(config, n, cache_attention=False)
    extra = attention * H200_DENSE.attention_s_per_flop * 2 / 7  # 2 of FlashAttention's 7 matmuls are the forward
    assert uncached - cached == pytest.approx(extra) and cached == pytest.approx(
        linear * H200_DENSE.linear_s_per_flop + attention * H200_DENSE.attention_s_per_flop)
