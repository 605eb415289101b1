"""The offload bench (benchmarks/offload.py): its summaries on synthetic rows, and one run on CPU.

The GPU numbers (peak memory, CUDA event timing) only exist on the H200; on CPU the bench runs
the same rows with wall-clock timing, so every code path but the CUDA calls is exercised here.
"""

import json

import pytest
import torch
from planning import plan_of, split

import oomb
from benchmarks import offload as ob
from oomb.train.config.presets import preset_config

GIB = 2**30


def _row(n, block, gpu, store, *, offload=True, kind="growth", mode="sparse", step=1.0, **extra):
    return {"kind": kind, "seq_len": n, "mode": mode, "select_block": block, "offload": offload,
            "budget_pages": 64 if mode == "sparse" else None, "step_s": step, "peak_gpu_gib": gpu,
            "store_device_gib": store, **extra}


def test_least_squares_slope():
    assert ob.least_squares_slope([1, 2, 3, 4], [5, 8, 11, 14]) == pytest.approx(3.0)
    assert ob.least_squares_slope([2, 2], [1, 5]) is None
    # Not on a line: the least-squares slope (2/7) is not the endpoint slope (1/3).
    assert ob.least_squares_slope([0, 1, 3], [0, 1, 1]) == pytest.approx(2 / 7)
    with pytest.raises(ValueError):
        ob.least_squares_slope([1, 2], [1])


def test_memory_growth_is_per_select_block_and_skips_other_rows():
    rows = [
        _row(65536, 128, 20.0, 1.0), _row(131072, 128, 20.5, 1.2), _row(262144, 128, 22.0, 1.6),
        _row(65536, 4096, 18.0, 0.5), _row(262144, 4096, 18.3, 0.6),
        _row(131072, 4096, 99.0, 9.0, offload=False, kind="pair"),  # not offloaded
        _row(1048576, 4096, 50.0, 5.0, kind="longest"),  # longest rows are not growth points
        {**_row(524288, 128, 0, 0), "error": "out of memory"},
    ]
    del rows[-1]["step_s"]
    g = ob.memory_growth(rows)
    assert list(g) == ["128", "4096"]
    g128, g4096 = g["128"], g["4096"]
    assert (g128["from"], g128["to"], g128["lengths"]) == (65536, 262144, [65536, 131072, 262144])
    per_10k = 1024 * 1e4
    assert g128["gpu_mib_per_10k_tokens"] == pytest.approx(2.0 / (262144 - 65536) * per_10k)
    xs = [65536, 131072, 262144]
    assert g128["gpu_mib_per_10k_tokens_lstsq"] == pytest.approx(
        ob.least_squares_slope(xs, [20.0, 20.5, 22.0]) * per_10k)
    assert g128["gpu_mib_per_10k_tokens_lstsq"] != pytest.approx(g128["gpu_mib_per_10k_tokens"])
    assert g128["store_device_mib_per_10k_tokens_lstsq"] == pytest.approx(
        ob.least_squares_slope(xs, [1.0, 1.2, 1.6]) * per_10k)
    assert g4096["lengths"] == [65536, 262144]
    assert g4096["gpu_mib_per_10k_tokens"] == pytest.approx(g4096["gpu_mib_per_10k_tokens_lstsq"])
    # On CPU there is no peak GPU memory: the store's slope is still computed.
    cpu = ob.memory_growth([_row(64, 16, None, 1.0), _row(128, 16, None, 2.0)])["16"]
    assert cpu["gpu_mib_per_10k_tokens"] is None and cpu["store_device_mib_per_10k_tokens"] > 0


def test_offload_overheads_pair_by_mode_length_and_block():
    rows = [
        _row(65536, None, 0, 0, offload=False, kind="pair", mode="dense", step=10.0),
        _row(65536, None, 0, 0, offload=True, kind="pair", mode="dense", step=12.0),
        _row(131072, 128, 0, 0, offload=False, kind="pair", step=4.0),
        _row(131072, 128, 0, 0, offload=True, kind="pair", step=5.0),
        _row(131072, 4096, 0, 0, offload=False, kind="pair", step=2.0),
        _row(131072, 4096, 0, 0, offload=True, kind="pair", step=2.2),
        _row(262144, 4096, 0, 0, offload=True),  # no pair
    ]
    got = ob.offload_overheads(rows)
    assert got == pytest.approx({"dense@65536": 0.2, "sparse@131072/block128": 0.25, "sparse@131072/block4096": 0.1})
    # The first (allocating, pinning) step's overhead, only where both rows of a pair have it.
    rows[0]["first_step_s"], rows[1]["first_step_s"], rows[2]["first_step_s"] = 11.0, 15.4, 4.0
    assert ob.offload_overheads(rows, "first_step_s") == pytest.approx({"dense@65536": 0.4})


def test_a_cap_on_a_chunks_pages_runs_in_the_sparse_rows_and_names_their_overhead(tmp_path):
    out = tmp_path / "capped.json"
    rc = ob.main(["--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--chunk", "64", "--page", "8",
                  "--budget", "2", "--dense-lengths", "", "--sparse-lengths", "256", "--growth-lengths", "",
                  "--select-blocks", "8", "--chunk-pages", "3", "--no-steady", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["chunk_pages"] == 3
    gpu, off = r["results"]
    assert gpu["chunk_pages"] == off["chunk_pages"] == 3
    assert list(r["offload_overhead"]) == ["sparse@256/block8/chunk_pages3"]


def test_row_settings_order_and_no_duplicates():
    rows = ob.row_settings([65536], [131072], [65536, 131072, 262144], [1048576], [4096, 128], 64)
    got = [(s.kind, s.mode, s.block, s.offload, s.seq_len) for s in rows]
    assert got == [
        ("pair", "dense", None, False, 65536), ("pair", "dense", None, True, 65536),
        ("pair", "sparse", 4096, False, 131072), ("pair", "sparse", 4096, True, 131072),
        ("pair", "sparse", 128, False, 131072), ("pair", "sparse", 128, True, 131072),
        ("growth", "sparse", 4096, True, 65536), ("growth", "sparse", 4096, True, 262144),
        ("growth", "sparse", 128, True, 65536), ("growth", "sparse", 128, True, 262144),
        ("longest", "sparse", 4096, True, 1048576),
    ]


def test_plan_prediction_leaves_out_the_optimizer():
    cfg = preset_config("qwen2.5-7b")
    kw = dict(seq_len=262144, chunk_size=512, page_size=128, page_budget=64, select_block=128, offload=True,
              optimizer="adamw", master_weights=False, host_total_bytes=125 * GIB)
    full = plan_of(cfg, **kw)
    items = {i.name: i for i in full.items}
    # Both optimizer items hold bytes here (7B, chunk 512: AdamW's foreach update outgrows a chunk's activations).
    assert items["optimizer states"].gpu_bytes > 0 and items["optimizer update"].gpu_bytes > 0
    assert items["master weights"].gpu_bytes == 0
    pred = ob.plan_prediction(full)
    dropped = sum(items[n].gpu_bytes for n in ("optimizer states", "optimizer update", "master weights"))
    assert pred["predicted_gpu_total_bytes"] == full.gpu_bytes - dropped
    assert pred["predicted_gpu_bytes"] == pred["predicted_gpu_total_bytes"] - items["CUDA context"].gpu_bytes
    assert pred["predicted_gpu_total_bytes"] >= items["parameters"].gpu_bytes + items["gradients"].gpu_bytes
    assert pred["predicted_host_bytes"] == full.host_bytes
    assert pred["predicted_new_host_bytes"] == items["offloaded pages"].host_bytes > 0
    assert set(pred["excluded"]) == set(ob.EXCLUDED_PLAN_ITEMS) and not set(pred["items"]) & set(pred["excluded"])
    # A GPU that holds the step without an optimizer but not with one: the row fits.
    between = (pred["predicted_gpu_total_bytes"] + full.gpu_bytes) // 2
    tight = plan_of(cfg, **kw, device_total_bytes=between)
    assert not tight.fits and ob.plan_prediction(tight)["fits"]
    small = ob.plan_prediction(plan_of(cfg, **{**kw, "host_total_bytes": GIB}, device_total_bytes=between))
    assert not small["fits"] and small["reason"].startswith("planner: host")


def test_auto_allowance_gives_the_store_what_the_plan_leaves_free():
    """--offload-gpu-memory auto: the GPU memory the no-optimizer plan leaves (less the margin) keeps whole
    layers on the GPU, so a length that needs more host memory than the machine has fits both together."""
    cfg = preset_config("qwen2.5-7b")
    kw = dict(seq_len=1_800_000 // 4096 * 4096, batch_size=1, chunk_size=4096, page_size=128, dtype=torch.bfloat16,
              page_budget=64, select_block=4096, offload=True, device_type="cuda",
              device_total_bytes=int(139.8 * GIB), host_total_bytes=int(125.8 * GIB))
    def plan(offload_gpu_memory=0, **change):
        options, shape, limits, _ = split(**{**kw, **change})
        return ob.plan_without_optimizer(cfg, options, shape, limits, offload_gpu_memory=offload_gpu_memory)

    none = plan()
    auto = plan("auto")
    assert none["offload_gpu_bytes"] == 0 and none["offload_resident_layers"] == 0 and not none["host_fits"]
    assert auto["offload_gpu_bytes"] == kw["device_total_bytes"] - none["predicted_gpu_total_bytes"] \
        - ob.AUTO_GPU_MARGIN_BYTES
    assert auto["offload_resident_layers"] >= 10 and auto["fits"]
    assert auto["predicted_gpu_total_bytes"] <= kw["device_total_bytes"] - ob.AUTO_GPU_MARGIN_BYTES
    # The resident layers' pages leave the host: the host side shrinks by what the GPU side grew.
    moved = auto["predicted_gpu_total_bytes"] - none["predicted_gpu_total_bytes"]
    assert none["predicted_host_bytes"] - auto["predicted_host_bytes"] == pytest.approx(moved, rel=0.02)
    fixed = plan(40 * GIB)
    assert fixed["offload_gpu_bytes"] == 40 * GIB and 0 < fixed["offload_resident_layers"] < 28
    dense = plan("auto", offload=False, seq_len=65536)
    assert dense["offload_gpu_bytes"] == 0
    # Without a GPU size (a CPU run) auto has nothing to fill.
    assert plan("auto", device_total_bytes=None)["offload_gpu_bytes"] == 0


def test_planned_longest_and_its_candidates():
    assert ob.planned_longest(lambda n: n <= 1_000_000, 4096, 1 << 26) == 1_000_000 // 4096 * 4096
    assert ob.planned_longest(lambda n: True, 4096, 10 * 4096) == 10 * 4096
    assert ob.planned_longest(lambda n: False, 4096, 1 << 26) == 0
    assert ob.longest_candidates(1_810_432, 4096) == [1_810_432, 1_716_224, 1_626_112]
    assert all(n % 4096 == 0 for n in ob.longest_candidates(1_810_432, 4096))
    assert ob.longest_candidates(4096, 4096) == [4096]
    assert ob.longest_candidates(0, 4096) == []


def test_offload_gpu_memory_and_planned_longest_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "split.json"
    rc = ob.main(["--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--chunk", "32", "--page", "8",
                  "--budget", "2", "--dense-lengths", "64", "--sparse-lengths", "", "--growth-lengths", "",
                  "--select-blocks", "32", "--offload-gpu-memory", "1GiB", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    gpu, off = r["results"]
    assert r["offload_gpu_memory"] == GIB and off["offload"] and not gpu["offload"]
    # 1 GiB holds every layer of the tiny model: the store keeps them all where the step runs, none on the host.
    assert off["offload_gpu_bytes"] == GIB and off["offload_resident_layers"] == off["plan"]["offload_resident_layers"]
    assert off["offload_resident_layers"] == preset_config("tiny").num_hidden_layers
    assert off["store_host_gib"] == 0.0
    with pytest.raises(SystemExit):
        ob.main(["--device", "cpu", "--offload-gpu-memory", "lots"])
    assert "not a memory size" in capsys.readouterr().err
    assert ob._longest_lengths("plan") == "plan" and ob._longest_lengths("8,4") == [8, 4]


def test_planner_agreement_and_admission():
    pred = {"predicted_gpu_bytes": 30 * GIB, "predicted_host_bytes": 60 * GIB, "predicted_new_host_bytes": 56 * GIB,
            "reason": None}
    a = ob.planner_agreement(pred, peak_gpu_bytes=25 * GIB, store_host_bytes=55 * GIB, rss_before_bytes=5 * GIB,
                             rss_after_bytes=61 * GIB)
    assert a["gpu_ratio"] == pytest.approx(1.2) and a["measured_host_bytes"] == 60 * GIB
    assert a["host_ratio"] == pytest.approx(1.0) and a["host_ratio_rss_after"] == pytest.approx(60 / 61)
    assert ob.planner_agreement(pred, peak_gpu_bytes=None, store_host_bytes=0, rss_before_bytes=GIB,
                                rss_after_bytes=GIB)["gpu_ratio"] is None
    assert ob.admission(pred, host_available_bytes=61 * GIB, host_margin_bytes=4 * GIB) is None
    why = ob.admission(pred, host_available_bytes=59 * GIB, host_margin_bytes=4 * GIB)
    assert why and why.startswith("host: 56.00 GiB to pin")
    why = ob.admission({**pred, "reason": "planner: GPU 150 GiB > 139 GiB"}, host_available_bytes=100 * GIB,
                       host_margin_bytes=0, gpu_free_bytes=10 * GIB, gpu_allocated_bytes=15 * GIB)
    assert why.startswith("planner: GPU") and "GPU: 15.00 GiB more" in why


def test_repeat_growth_ignores_the_allocating_first_step():
    steps = [{"rss_gib": 2.0, "store_host_gib": 10.0}, {"rss_gib": 12.0, "store_host_gib": 10.0},
             {"rss_gib": 12.5, "store_host_gib": 10.0}, {"rss_gib": 12.25, "store_host_gib": 10.0}]
    g = ob.repeat_growth(steps)
    assert g["rss_growth_gib"] == pytest.approx(0.5) and g["store_host_growth_gib"] == 0.0
    assert g["host_alloc_growth_gib"] is None and (g["from_step"], g["to_step"]) == (2, 4)
    assert ob.repeat_growth(steps[:1])["rss_growth_gib"] is None


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """One CPU run of every kind of row, with the pinning of one growth row failing on purpose."""
    out = tmp_path_factory.mktemp("offload") / "offload.json"
    real = oomb.chunked_backward
    partial = []

    def flaky(model, ids, **kw):
        if ids.shape[1] == 192 and kw.get("offload") and kw["selection"].block == 16:
            partial.append(json.loads(out.read_text()))  # what a run killed here would leave
            raise RuntimeError("could not pin 1.00 GiB of host memory for offloaded pages (test)")
        return real(model, ids, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(oomb, "chunked_backward", flaky)
    try:
        rc = ob.main(["--device", "cpu", "--dtype", "float32", "--preset", "tiny",
                      "--chunk", "32", "--page", "8", "--budget", "2",
                      "--dense-lengths", "64", "--sparse-lengths", "128", "--growth-lengths", "64,128,192",
                      "--select-blocks", "32,16", "--longest-lengths", f"{2**40},160,128", "--longest-first-fit",
                      "--repeat-steps", "3",
                      "--repeat-length", "96", "--out", str(out)])
    finally:
        mp.undo()
    assert rc == 0 and len(partial) == 1
    return {**json.loads(out.read_text()), "_partial": partial[0]}


def test_cpu_run_report(cpu_report):
    r = cpu_report
    assert r["bench"] == "offload" and r["complete"] and "in_progress" not in r
    assert r["command"].startswith("python -m benchmarks.offload")
    assert r["versions"]["torch"] == torch.__version__ and r["select_blocks"] == [32, 16]
    assert r["dtype"] == "float32" and r["planner_method"] == ob.PLAN_NO_OPTIMIZER and r["host_total_gib"] > 0
    # fused ops as `oomb train` (auto): liger's kernels only on CUDA, so none on this CPU run
    assert r["fused_ops"] == "auto" and r["fused_modules"] == [] and r["fa4_block_sparse"] is False
    # what ran is recorded, not what was asked: on CPU the reference kernels, whatever is installed
    assert r["attention_backend"] == "torch" and r["versions"]["oomb"] == oomb.__version__
    rows = r["results"]
    kinds = [(x["kind"], x["mode"], x["select_block"], x["offload"], x["seq_len"]) for x in rows]
    assert kinds[:6] == [("pair", "dense", None, False, 64), ("pair", "dense", None, True, 64),
                         ("pair", "sparse", 32, False, 128), ("pair", "sparse", 32, True, 128),
                         ("pair", "sparse", 16, False, 128), ("pair", "sparse", 16, True, 128)]
    assert len(rows) == 6 + 2 + 2 + 3
    measured = [x for x in rows if "step_s" in x]
    assert len(measured) == len(rows) - 3  # the failed growth row, the refused and the skipped longest row
    for x in measured:
        p = x["planner"]
        assert p["predicted_host_bytes"] == x["plan"]["predicted_host_bytes"] > 0
        assert p["measured_host_bytes"] == int(x["store_host_gib"] * GIB) + int(x["rss_before_gib"] * GIB)
        assert p["host_ratio"] == pytest.approx(p["predicted_host_bytes"] / p["measured_host_bytes"])
        assert x["peak_gpu_gib"] is None and x["store_device_gib"] > 0 and x["peak_rss_gib"] > 0
        assert (x["store_host_gib"] > 0) == x["offload"]
        assert ("moved_gib" in x) == x["offload"] and (not x["offload"] or x["moved_gib"]["to_host"] > 0)
        assert set(x["plan"]["excluded"]) == set(ob.EXCLUDED_PLAN_ITEMS)
    for x in measured:  # pair rows: a first step at their length, timed apart (--steady, the default)
        assert x["steady"] == (x["kind"] == "pair") and ("first_step_s" in x) == x["steady"]
        assert not x["steady"] or x["first_step_s"] > 0
    assert set(r["offload_overhead_first_step"]) == set(r["offload_overhead"])
    failed = [x for x in rows if "error" in x]
    assert [(x["seq_len"], x["select_block"]) for x in failed] == [(192, 16)]
    assert failed[0]["error"].startswith("RuntimeError: could not pin")
    longest = [x for x in rows if x["kind"] == "longest"]
    assert [x["seq_len"] for x in longest] == [2**40, 160, 128]
    assert longest[0]["refused"].startswith("planner: host") and "step_s" not in longest[0]
    assert "step_s" in longest[1] and longest[1]["host_total_gib"] > 0 and longest[1]["select_block"] == 32
    assert "first-fit" in longest[2]["skipped"]  # 160 ran: 128 is not tried


def test_cpu_run_summaries(cpu_report):
    r = cpu_report
    assert set(r["offload_overhead"]) == {"dense@64", "sparse@128/block32", "sparse@128/block16"}
    growth = r["sparse_offload_memory_growth"]
    assert growth["32"]["lengths"] == [64, 128, 192]
    assert growth["16"]["lengths"] == [64, 128]  # 192 failed
    assert growth["32"]["store_device_mib_per_10k_tokens_lstsq"] > 0
    rep = r["repeat"]
    assert rep["seq_len"] == 96 and rep["select_block"] == 32 and len(rep["steps"]) == 3
    assert all(s["store_host_gib"] > 0 for s in rep["steps"])
    # The store is kept between steps: its pinned pools do not grow after step 1.
    assert rep["growth"]["store_host_growth_gib"] == 0.0 and rep["growth"]["to_step"] == 3
    assert rep["planner"]["host_ratio"] > 0


def test_report_is_written_before_each_row(cpu_report):
    partial = cpu_report["_partial"]
    assert not partial["complete"] and partial["in_progress"]["seq_len"] == 192
    assert partial["in_progress"]["select_block"] == 16
    assert len(partial["results"]) == 6 + 2 + 1  # pairs, block 32's growth rows, block 16's 64
    assert "sparse@128/block16" in partial["offload_overhead"]


def test_table_prints_every_row(cpu_report, capsys):
    ob._print_table(cpu_report)
    text = capsys.readouterr().out
    assert "refused: planner: host" in text and "error: RuntimeError: could not pin" in text
    assert "offload overhead sparse@128/block16" in text and "select block 32" in text
    assert "repeat 3 sparse+offload steps at 96" in text


def test_bad_select_blocks_are_refused(capsys):
    with pytest.raises(SystemExit):
        ob.main(["--device", "cpu", "--select-blocks", "0"])
    assert "--select-blocks" in capsys.readouterr().err


def test_profiles_dense_then_sparse_with_and_without_offload(tmp_path):
    out = tmp_path / "p.json"
    rc = ob.main(["--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--chunk", "32", "--page", "8",
                  "--budget", "2", "--dense-lengths", "", "--sparse-lengths", "", "--growth-lengths", "",
                  "--profile-dense-length", "64", "--profile-length", "96", "--select-blocks", "16",
                  "--out", str(out)])
    assert rc == 0
    profiles = json.loads(out.read_text())["stream_profiles"]
    assert [(p["mode"], p["seq_len"], p["offload"]) for p in profiles] == [
        ("dense", 64, False), ("dense", 64, True), ("sparse", 96, False), ("sparse", 96, True)]
    assert profiles[2]["select_block"] == 16 and all(p["skipped"] == "needs CUDA" for p in profiles)


def test_a_steady_longest_row_times_its_first_step_apart(tmp_path):
    out = tmp_path / "longest.json"
    args = ["--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--chunk", "64", "--page", "8",
            "--budget", "2", "--dense-lengths", "", "--sparse-lengths", "", "--growth-lengths", "",
            "--longest-lengths", "256", "--select-blocks", "8", "--out", str(out)]
    assert ob.main(args + ["--longest-steady"]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["kind"] == "longest" and row["steady"] and len(row["step_times_s"]) == 1
    assert row["first_step_s"] > 0 and row["step_s"] > 0
    assert ob.main(args) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert not row["steady"] and "first_step_s" not in row


def test_a_profiled_longest_row_is_written_before_its_profile(tmp_path, monkeypatch):
    """The 1M step's profile runs past a device call's 10 minutes: its timed row must be on disk before."""
    out = tmp_path / "longest.json"
    written = []
    real_write = ob.write_report

    def recording_write(path, report):
        written.append(json.loads(json.dumps(report)))
        real_write(path, report)

    monkeypatch.setattr(ob, "write_report", recording_write)
    assert ob.main(["--device", "cpu", "--dtype", "float32", "--preset", "tiny", "--chunk", "64", "--page", "8",
                    "--budget", "2", "--dense-lengths", "", "--sparse-lengths", "", "--growth-lengths", "",
                    "--longest-lengths", "256", "--select-blocks", "8", "--longest-steady", "--profile-longest",
                    "--out", str(out)]) == 0
    timed = [r for r in written if r["results"] and r["results"][-1].get("profile") == "in progress"]
    assert len(timed) == 1 and not timed[0]["complete"]
    row = timed[0]["results"][-1]
    assert row["kind"] == "longest" and row["step_s"] > 0 and row["first_step_s"] > 0
    assert row["planner"]["predicted_host_bytes"] > 0 and row["offload_resident_layers"] is not None
    (final,) = json.loads(out.read_text())["results"]
    assert final["profile"] == {"skipped": "needs CUDA"} and final["step_s"] == row["step_s"]
