"""benchmarks.train_steps: a run folder and its log become a record of what `oomb train` picked and reported."""

import json

from benchmarks.train_steps import main, record_of


def _run(tmp_path, seconds):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "seconds": s, "loss": 1.0,
                                                           "peak_gpu_gib": 80.0 + i}) + "\n"
                                               for i, s in enumerate(seconds)))
    (run / "config.json").write_text(json.dumps({"train": {"chunk_size": 8192, "cache_attention": True,
                                                           "master_weights": False}}))
    log = tmp_path / "run.log"
    log.write_text("note: something\noomb train: qwen2.5-7b ...; chunk 8192, attention\ncache on (chosen by the "
                   "memory plan), page 128\nstep 1/3 ...\n")
    return run, log


def test_the_record_keeps_the_choice_and_the_steps_after_the_first(tmp_path):
    run, log = _run(tmp_path, [25.0, 14.0, 13.0])
    r = record_of(run, log, 65536)
    assert (r["chunk_size"], r["cache_attention"], r["master_weights"]) == (8192, True, False)
    assert r["warm_step_s"] == 13.5 and [s["step"] for s in r["steps"]] == [1, 2, 3]
    assert r["startup"][0] == "note: something" and "chosen by the memory plan" in " ".join(r["startup"])


def test_a_record_is_built_from_runs_made_earlier(tmp_path):
    run, log = _run(tmp_path, [25.0, 14.0])
    out = tmp_path / "r.json"
    assert main(["--lengths", "65536", "--steps", "2", "--out", str(out), "--from-runs", f"{run}={log}"]) == 0
    report = json.loads(out.read_text())
    assert report["bench"] == "train_steps" and report["results"][0]["warm_step_s"] == 14.0


def test_a_variant_adds_its_keys_to_the_run_and_a_refused_one_is_recorded(tmp_path):
    from benchmarks.train_steps import run_length

    cpu = "train.device=cpu train.page_size=64 train.chunk_size=128"
    row = run_length("tiny", 256, 2, tmp_path, 120, ("qlora", f"{cpu} lora.r=8 model.quantize=nf4"))
    assert (row["variant"], row["lora_r"], row["quantize"]) == ("qlora", 8, "nf4")
    assert len(row["steps"]) >= 2 and row["warm_step_s"] is not None
    assert "base in NF4" in row["startup"][0]  # the startup line of `oomb train`
    refused = run_length("tiny", 256, 2, tmp_path, 120, ("nolora", f"{cpu} model.quantize=nf4"))
    assert refused["warm_step_s"] is None and "lora.r" in " ".join(refused["error"])


def test_the_plan_s_prediction_is_read_from_the_startup_line_and_set_against_the_peak():
    from benchmarks.train_steps import planned_against_measured

    log = "oomb train: llama-3-8b\nmemory plan: GPU 66.00 GiB of 78.50 GiB, host 20.00 GiB of 120.00 GiB (oomb...)\n"
    metrics = [{"step": 1, "peak_gpu_gib": 62.5}, {"step": 2, "peak_gpu_gib": 64.0}]
    assert planned_against_measured(log, metrics) == {
        "planned_gpu_gib": 66.0, "planned_over_measured_peak": 1.0312,
        # less the plan's 1 GiB CUDA-context allowance, which max_memory_allocated does not see
        "planned_allocated_gib": 65.0, "planned_allocated_over_measured_peak": 1.0156,
        "measured_card_gib": None, "planned_over_measured_card": None}
    # Steps that read the allocator's reserved peak and the memory outside it: the card's use, context included.
    card = [{"step": 1, "peak_gpu_gib": 62.5, "peak_gpu_reserved_gib": 63.0, "gpu_outside_allocator_gib": 0.5},
            {"step": 2, "peak_gpu_gib": 64.0, "peak_gpu_reserved_gib": 64.5, "gpu_outside_allocator_gib": 0.7}]
    result = planned_against_measured(log, card)
    assert result["measured_card_gib"] == 65.2 and result["planned_over_measured_card"] == round(66 / 65.2, 4)
    assert planned_against_measured(log.replace("66.00 GiB", "512.00 MiB"), metrics)["planned_gpu_gib"] == 0.5
    assert planned_against_measured("memory plan: host 2.00 GiB of 8.00 GiB\n", metrics) == {}  # a CPU run
    assert planned_against_measured(log, [{"step": 1}])["planned_over_measured_peak"] is None


def test_the_longest_length_is_the_plan_s():
    from benchmarks.train_steps import longest_planned

    cpu = "train.device=cpu train.page_size=64 train.chunk_size=128"
    n = longest_planned("tiny", cpu)
    assert isinstance(n, int) and n > 256
    assert longest_planned("tiny", f"{cpu} no.such.key=1") is None  # a refused config: no length, no crash
