"""The fair baseline of benchmarks.core: each oomb row against the faster transformers stack at its length."""

import sys
import time

import pytest

from benchmarks.baseline import main as baseline_main
from benchmarks.core import versus_baseline


def _row(system, n, step_s=None, peak=None, error=None):
    row = {"system": system, "seq_len": n}
    if error:
        row["error"] = error
    else:
        row.update(step_s=step_s, peak_gpu_gib=peak)
    return row


def test_each_oomb_row_is_compared_with_the_faster_stack_at_its_length():
    rows = [
        _row("transformers-fa4-liger-ckpt", 65536, 11.7, 53.3),
        _row("transformers-sdpa-liger-ckpt", 65536, 12.6, 53.2),
        _row("transformers-fa4-liger-ckpt", 131072, error="out of memory"),  # a stack that failed is no baseline
        _row("transformers-sdpa-liger-ckpt", 131072, 40.0, 78.0),
        _row("transformers-sdpa-ckpt", 131072, 30.0, 70.0),  # the plain row (no Liger) is not the baseline
        _row("oomb-auto", 65536, 14.04, 82.6),
        _row("oomb+cached-attn", 131072, 36.0, 102.0),
        _row("oomb", 262144, 100.0, 90.0),  # no baseline at this length: no ratio
        _row("oomb", 65536, error="out of memory"),
    ]
    got = versus_baseline(rows)
    assert [(r["system"], r["seq_len"], r["baseline"]) for r in got] == [
        ("oomb-auto", 65536, "transformers-fa4-liger-ckpt"),
        ("oomb+cached-attn", 131072, "transformers-sdpa-liger-ckpt"),
    ]
    assert got[0]["time_ratio"] == pytest.approx(14.04 / 11.7) and got[0]["peak_ratio"] == pytest.approx(82.6 / 53.3)
    assert got[1]["time_ratio"] == pytest.approx(36.0 / 40.0)


def test_the_baseline_refuses_without_a_gpu_and_needs_its_options(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert baseline_main(["--stack", "sdpa", "--lengths", "1024", "--out", str(tmp_path / "b.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        baseline_main(["--stack", "flash", "--lengths", "1024", "--out", str(tmp_path / "b.json")])


def test_rope_is_counted_per_chunk_forward_and_backward():
    # Stage 1 runs every chunk but the last, stage 2 recomputes every chunk (the attention cache skips attention,
    # not RoPE) and backs through it once: 64K tokens in chunks of 8192, 28 layers.
    from benchmarks.core import rope_calls_per_step

    assert rope_calls_per_step(28, 65536, 8192) == {"forward": 28 * 15, "backward": 28 * 8}
    assert rope_calls_per_step(2, 100, 64) == {"forward": 2 * 3, "backward": 2 * 2}  # a ragged last chunk


def test_baselines_from_an_earlier_record_say_which_run_timed_them(tmp_path):
    import json

    from benchmarks.core import earlier_baselines

    record = tmp_path / "base.json"
    record.write_text(json.dumps({"bench": "core", "command": "python -m benchmarks.core --baseline-lengths 262144",
                                  "date": "2026-12-05", "results": [
                                      _row("transformers-fa4-liger-ckpt", 262144, 122.0, 127.0),
                                      _row("oomb", 262144, 100.0, 90.0)]}))
    rows = earlier_baselines(record)
    assert [r["system"] for r in rows] == ["transformers-fa4-liger-ckpt"]
    assert rows[0]["timed_by"] == "python -m benchmarks.core --baseline-lengths 262144 (2026-12-05)"
    assert versus_baseline([*rows, _row("oomb", 262144, 100.0, 90.0)])[0]["baseline"] == "transformers-fa4-liger-ckpt"
    record.write_text(json.dumps({"bench": "core", "command": "c", "date": "d",
                                  "results": [_row("oomb", 1, 1.0, 1.0)]}))
    with pytest.raises(ValueError, match="no transformers rows"):
        earlier_baselines(record)
    record.write_text(json.dumps({"bench": "offload", "results": []}))
    with pytest.raises(ValueError, match="not a benchmarks.core record"):
        earlier_baselines(record)


def _profiled(row, **group_ms):
    groups = {name.replace("_", " "): {"ms": ms, "count": 1} for name, ms in group_ms.items()}
    row["profile"] = {"kernel_groups": groups}
    return row


def test_the_sparse_floor_is_the_stacks_time_outside_attention_plus_the_rows_own_attention():
    from benchmarks.core import sparse_floor

    stack = _profiled(_row("transformers-fa4-liger-ckpt", 131072, 38.0, 78.0),
                      **{"attention_forward_(FA4)": 9000.0, "attention_backward_(FA4)": 16000.0, "matmul": 11500.0})
    slower = _profiled(_row("transformers-sdpa-liger-ckpt", 131072, 41.0, 78.0), matmul=11500.0)
    sparse = _profiled(_row("oomb-sparse+cached-attn+cap64", 131072, 16.6, 70.0),
                       **{"attention_forward_(FA4)": 1000.0, "attention_backward_(FA4)": 3000.0,
                          "attention_dq": 100.0, "matmul": 10700.0})
    dense = _profiled(_row("oomb+cached-attn", 131072, 33.0, 100.0), matmul=10000.0)  # not a sparse row
    unprofiled = _row("oomb-sparse+cached-attn", 131072, 17.0, 70.0)
    got = sparse_floor([slower, stack, sparse, dense, unprofiled])
    assert len(got) == 1 and got[0]["baseline"] == "transformers-fa4-liger-ckpt"
    assert got[0]["baseline_outside_attention_s"] == pytest.approx(38.0 - 25.0)
    assert got[0]["attention_s"] == pytest.approx(4.1)
    assert got[0]["floor_s"] == pytest.approx(17.1)
    assert got[0]["step_over_floor"] == pytest.approx(16.6 / 17.1)
    assert sparse_floor([sparse]) == []  # no profiled stack at its length: no floor
    assert got[0]["sm_mhz"] is None and got[0]["baseline_sm_mhz"] is None  # no clocks sampled
    stack["gpu_clocks"] = {"sm_mhz": 1755.0}
    sparse["gpu_clocks"] = {"sm_mhz": 1590.0}
    got = sparse_floor([stack, sparse])
    assert (got[0]["sm_mhz"], got[0]["baseline_sm_mhz"]) == (1590.0, 1755.0)


FAKE_SMI = """
import pathlib, sys, time
lines = ["1980, 120.5, 35, 700.00", "[N/A], 121.0, 35, 700.00", "1755, 690.1, 61, 700.00", "1590, 699.8, 66, 700.00"]
for line in lines:
    print(line, flush=True)
print("1600, 70", flush=True)  # a line with fewer fields (as one cut off mid-write): not a sample
pathlib.Path(sys.argv[1]).touch()  # every line is in the pipe
time.sleep(600)  # until the sampler stops it
"""


def test_gpu_clocks_are_sampled_beside_the_timed_steps(tmp_path):
    from benchmarks.common import GpuClocks

    smi, printed = tmp_path / "smi.py", tmp_path / "printed"
    smi.write_text(FAKE_SMI)
    with GpuClocks(command=[sys.executable, str(smi), str(printed)]) as clocks:
        deadline = time.monotonic() + 600  # the timed steps: until the sampler has printed (600 s ends a hang only)
        while not printed.exists():
            assert time.monotonic() < deadline, "the fake nvidia-smi printed nothing in 600 s"
            time.sleep(0.01)
    got = clocks.summary()
    assert got == {"sm_mhz": 1755.0, "sm_mhz_min": 1590.0, "power_w": 690.1, "power_limit_w": 700.0,
                   "temp_c_max": 66.0, "samples": 3}
    with GpuClocks(command=[]) as clocks:  # what it does without a CUDA device or nvidia-smi: nothing sampled
        pass
    assert clocks.summary() is None
