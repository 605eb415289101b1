"""The step-time model: its rates refit from the records they came from, and its shape."""

import json
from pathlib import Path

import pytest
import torch

from oomb.planning import timing
from oomb.planning.timing import (
    H200_DENSE,
    H200_SPARSE,
    PageSparsity,
    attended_keys,
    predict_step_seconds,
    step_flops,
)
from oomb.train.config.presets import preset_config

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


def _sparse_step(record: str) -> tuple[dict, dict]:
    report = json.loads((RESULTS / record).read_text())
    return report, report["results"][0]


def test_the_sparse_rate_is_the_fit_of_its_record_and_predicts_the_1m_step_within_5_percent():
    config = preset_config("qwen2.5-7b")
    _, row = _sparse_step("core-7b-sparse-128k-fa4-blocks.json")
    selection = row["options"]["selection"]
    assert row["backend"] == "fa4" and row["options"]["cache_attention"] is True and selection["block"] == 128
    sparsity = PageSparsity(selection["page_budget"], row["page_size"], row["chunk_size"])
    linear, attention = step_flops(config, row["seq_len"], sparsity=sparsity)
    rate = (row["step_s"] - linear * H200_SPARSE.linear_s_per_flop) / attention
    assert rate == pytest.approx(H200_SPARSE.attention_s_per_flop, rel=1e-3)
    assert H200_SPARSE.linear_s_per_flop == H200_DENSE.linear_s_per_flop
    # The check: 1M on the same machine, offloaded (no attention cache), one page list per chunk of the same budget.
    report, row = _sparse_step("sparse-1m-7b.json")
    assert "H200" in report["gpu"] and row["seq_len"] == 1 << 20 and row["offload"]
    sparsity = PageSparsity(report["budget_pages"], report["page_size"], report["chunk_size"])
    predicted = predict_step_seconds(config, row["seq_len"], cache_attention=False, sparsity=sparsity)
    assert predicted == pytest.approx(row["step_s"], rel=0.05)


def test_a_sparse_query_attends_its_chunk_up_to_itself_and_the_budget_of_the_past():
    # dense: (n + 1) / 2 keys a query on average, and step_flops' dense count is 12 FLOPs per (query, key) pair
    assert attended_keys(8) == 4.5
    config = preset_config("qwen2.5-7b")
    # one chunk: the budget never binds, so sparse and dense attend the same keys
    n = 4096
    assert attended_keys(n, PageSparsity(64, 128, n)) == attended_keys(n)
    # chunks of 4 over 12 tokens, a budget of 1 page of 2: chunk 0 attends 2.5 keys a query, the others 2.5 + 2
    assert attended_keys(12, PageSparsity(1, 2, 4)) == pytest.approx((2.5 * 4 + 4.5 * 8) / 12)
    # long contexts: the keys a query attends stop growing, so sparse attention is linear in the context
    sparsity = PageSparsity(64, 128, 8192)
    a1, a2 = step_flops(config, 1 << 20, sparsity=sparsity)[1], step_flops(config, 1 << 21, sparsity=sparsity)[1]
    assert a2 / a1 == pytest.approx(2, rel=0.01)
    assert step_flops(config, 1 << 20, sparsity=sparsity)[1] < step_flops(config, 1 << 20)[1] / 40


def test_the_module_docstring_states_what_the_rates_were_measured_on():
    """The installed package has no records: its docstring says in words what each rate came from, with the
    seconds the records hold and the predictions the rates make."""
    doc = " ".join(timing.__doc__.split())
    config = preset_config("qwen2.5-7b")
    (n64, s64), (n256, s256) = (_auto_step("core-7b-vs-transformers-64k.json", "oomb-auto"),
                                _auto_step("core-7b-vs-transformers-256k.json", "oomb-auto"))
    assert f"{n64:,} tokens in {s64:.2f} s" in doc and f"{n256:,} tokens in {s256:.2f} s" in doc
    trained = json.loads((RESULTS / "train-7b-auto.json").read_text())["results"][1]
    assert f"predicts {predict_step_seconds(config, trained['seq_len']):.2f} s at {trained['seq_len']:,} tokens" in doc
    assert f"measured {trained['warm_step_s']:.2f} s per step" in doc
    assert f"{1 / H200_DENSE.linear_s_per_flop / 1e12:.0f} TFLOP/s of the linear FLOPs" in doc
    assert f"{1 / H200_DENSE.attention_s_per_flop / 1e12:.0f} TFLOP/s of the attention FLOPs" in doc
    _, row = _sparse_step("core-7b-sparse-128k-fa4-blocks.json")
    assert f"{row['seq_len']:,} tokens in {row['step_s']:.2f} s" in doc
    assert f"{1 / H200_SPARSE.attention_s_per_flop / 1e12:.0f} TFLOP/s of the attended keys' FLOPs" in doc
    report, row = _sparse_step("sparse-1m-7b.json")
    sparsity = PageSparsity(report["budget_pages"], report["page_size"], report["chunk_size"])
    predicted = predict_step_seconds(config, row["seq_len"], cache_attention=False, sparsity=sparsity)
    assert f"{row['step_s']:.1f} s measured, {predicted:.1f} s predicted" in doc
    assert "NVIDIA H200" in doc and all("H200" in r.gpu for r in (H200_DENSE, H200_SPARSE))


# --- other settings and the H100 (the module docstring's second part) ---------------------------------------------

LLAMA_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _train_rows(record: str) -> list[dict]:
    report = json.loads((RESULTS / record).read_text())
    assert "H100" in report["machine"]
    return report["results"]


def _h100_full_step(record: str) -> tuple[int, float]:
    report = json.loads((RESULTS / record).read_text())
    assert "H100" in report["machine"]
    row = next(r for r in report["results"] if r["system"] == "oomb+cached-attn")
    assert row["backend"] == "fa4" and row["chunk_size"] == 16384 and row["options"]["recompute"] == "layer-host"
    return row["seq_len"], row["step_s"]


@pytest.mark.parametrize(("preset", "tolerance"), [("llama-3-8b", 0.02), ("qwen3-8b", 0.02), ("granite-3.3-8b", 0.06)])
def test_the_h200_rates_predict_the_h100s_full_weight_steps(preset, tolerance):
    n, seconds = _h100_full_step(f"core-{preset}-vs-transformers-64k.json")
    predicted = predict_step_seconds(preset_config(preset), n)
    assert predicted == pytest.approx(seconds, rel=tolerance)
    assert f"{seconds:.2f} s ({predicted:.2f} predicted)" in " ".join(timing.__doc__.split())


def _lora_steps() -> list[tuple[int, float]]:
    rows = _train_rows("train-llama-3-8b-lora-64k-128k.json")
    assert all(r["lora_r"] == 16 and r["recompute"] == "layer-host" and r["quantize"] == "none" for r in rows)
    return [(r["seq_len"], r["warm_step_s"]) for r in rows]


def test_the_adapter_rate_is_the_fit_of_the_lora_steps_it_cites():
    config = preset_config("llama-3-8b")
    adapters = timing.adapter_bytes_per_token(config, LLAMA_LORA, forwards=2)
    no_adapters = timing.StepWork(weight_grads=False)
    rest = [(s - predict_step_seconds(config, n, work=no_adapters), n * 32 * adapters) for n, s in _lora_steps()]
    seconds_per_byte = sum(r * b for r, b in rest) / sum(b * b for _, b in rest)  # least squares through 0
    assert 1 / seconds_per_byte == pytest.approx(timing.ADAPTER_BYTES_PER_S, rel=1e-3)
    work = timing.StepWork(weight_grads=False, adapter_bytes=adapters)
    doc = " ".join(timing.__doc__.split())
    for n, s in _lora_steps():
        predicted = predict_step_seconds(config, n, work=work)
        assert predicted == pytest.approx(s, rel=0.015)
        assert f"{s:.2f} s" in doc and f"{predicted:.2f} s" in doc


def test_a_4bit_base_runs_a_little_slower_than_its_lora_prediction():
    config = preset_config("llama-3-8b")
    work = timing.StepWork(weight_grads=False, adapter_bytes=timing.adapter_bytes_per_token(config, LLAMA_LORA, 2))
    rows = _train_rows("train-llama-3-8b-qlora-r32.json") + _train_rows("train-llama-3-8b-qlora-r32-128k.json")
    doc = " ".join(timing.__doc__.split())
    for r in rows:
        assert r["quantize"] == "nf4" and r["recompute"] == "layer-host" and r["chunk_size"] == 16384
        over = r["warm_step_s"] / predict_step_seconds(config, r["seq_len"], work=work) - 1
        assert 0 < over < 0.15, (r["seq_len"], over)
        assert f"{r['warm_step_s']:.2f} s" in doc and f"{over:.0%}" in doc


def test_the_work_a_setting_runs_is_counted_from_the_rates_setting():
    assert timing.linear_work(timing.StepWork()) == 1  # two forwards, dx and dW: the rates' own setting
    assert timing.linear_work(timing.StepWork(weight_grads=False)) == 0.75  # LoRA: no frozen weight gradient
    assert timing.linear_work(timing.StepWork(forwards=1)) == 0.75  # one chunk: each layer's forward once
    assert timing.linear_work(timing.StepWork(forwards=1, weight_grads=False)) == 0.5
    config = preset_config("qwen2.5-7b")
    n = 8192
    linear, attention = step_flops(config, n)
    once = predict_step_seconds(config, n, cache_attention=False, work=timing.StepWork(forwards=1))
    # computed once, the attention forward runs once without any cache
    rates = H200_DENSE
    assert once == pytest.approx(0.75 * linear * rates.linear_s_per_flop + attention * rates.attention_s_per_flop)


def test_the_adapters_stream_each_adapted_layers_rows():
    config = preset_config("llama-3-8b")  # hidden 4096, 32 x 128 query and 8 x 128 key/value widths, MLP 14336
    assert timing.adapter_bytes_per_token(config, ("q_proj",), forwards=2) == 2 * (2 * (4096 + 2 * 4096) + 2 * 4096
                                                                                 + 3 * 4096)
    assert timing.adapter_bytes_per_token(config, ("down_proj",), forwards=1) == 2 * ((14336 + 2 * 4096) + 2 * 4096
                                                                                    + 3 * 14336)
    assert timing.adapter_bytes_per_token(config, ("experts", "lm_head"), forwards=2) == 0  # not counted
    both = timing.adapter_bytes_per_token(config, ("k_proj", "v_proj"), forwards=2)
    assert both == 2 * timing.adapter_bytes_per_token(config, ("k_proj",), forwards=2)
