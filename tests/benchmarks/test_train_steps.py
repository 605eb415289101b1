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


def _chunk_lines(stages, peak=None):
    """chunks.jsonl lines of step 1: (stage, i, n, seconds) each."""
    return [{"step": 1, "batch": 1, "stage": st, "chunk": i, "of": n, "seconds": t,
             **({"peak_gpu_gib": peak + k} if peak is not None else {})} for k, (st, i, n, t) in enumerate(stages)]


def test_a_step_cut_short_is_predicted_from_its_measured_chunks():
    from benchmarks.train_steps import partial_step

    # 4 chunks, whole-chunk recompute: stage 1 fills chunks 0-2 (1, 2 and 3 s; the newest, skipped, extrapolated to
    # 4 s); stage 2 ran chunk 3 in 12 s and chunk 2 in 9 s (3x their stage-1 times), then was killed in chunk 1.
    lines = _chunk_lines([("fill", 1, 3, 0.0), ("fill", 2, 3, 1.0), ("fill", 3, 3, 3.0), ("backward", 1, 4, 6.0),
                          ("backward", 2, 4, 18.0), ("backward", 3, 4, 27.0)], peak=50.0)
    got = partial_step(lines)
    assert (got["fill_chunks_started"], got["fill_chunks"], got["backward_chunks_started"], got["backward_chunks"]) == (
        3, 3, 3, 4)
    assert got["stage1_s"] == 6.0 and got["backward_chunk_s"] == [12.0, 9.0] and got["stage2_over_stage1"] == 3.0
    assert got["predicted_step_s"] == 6.0 + 3.0 * (1 + 2 + 3 + 4) and got["peak_gpu_gib"] == 55.0
    assert got["seconds_reached"] == 27.0
    # recompute by layer: stage 1 runs every chunk, nothing to extrapolate
    layer = partial_step(_chunk_lines([("fill", 1, 2, 0.0), ("fill", 2, 2, 2.0), ("backward", 1, 2, 5.0),
                                       ("backward", 2, 2, 14.0)]))
    assert layer["stage2_over_stage1"] == 3.0 and layer["predicted_step_s"] == 5.0 + 3.0 * (2 + 3)
    assert layer["peak_gpu_gib"] is None  # a CPU run's lines carry no GPU peak
    # killed in stage 1, or before a stage-2 chunk finished: how far, no prediction
    early = partial_step(lines[:2])
    assert early["predicted_step_s"] is None and early["stage1_s"] is None and early["backward_chunks"] is None
    assert partial_step(lines[:4])["predicted_step_s"] is None and partial_step(lines[:4])["stage1_s"] == 6.0
    # only the first step's first batch is read
    later = _chunk_lines([("fill", 1, 3, 0.0)])
    assert partial_step(lines + [{**later[0], "step": 2}])["predicted_step_s"] == 36.0


def test_a_run_cut_short_keeps_how_far_its_step_got(tmp_path):
    from benchmarks.train_steps import row_of_run

    run, log = tmp_path / "run", tmp_path / "run.log"
    run.mkdir()
    log.write_text("memory plan: GPU 60.00 GiB of 78.50 GiB, host 90.00 GiB of 120.00 GiB\nstep 0/1\n")
    (run / "chunks.jsonl").write_text("".join(json.dumps(line) + "\n" for line in _chunk_lines(
        [("fill", 1, 1, 0.0), ("backward", 1, 2, 4.0), ("backward", 2, 2, 16.0)], peak=57.0)))
    row = row_of_run(run, log, 1 << 20)
    assert row["warm_step_s"] is None and row["partial"]["predicted_step_s"] == 4.0 + 3.0 * (4 + 4)
    assert row["planned_gpu_gib"] == 60.0 and row["planned_over_measured_peak"] == round(60 / 59.0, 4)
    (run / "chunks.jsonl").unlink()
    assert "partial" not in row_of_run(run, log, 1 << 20)  # refused before any chunk: the log's lines only


def test_a_finished_run_keeps_its_chunk_lines(tmp_path, monkeypatch):
    import benchmarks.train_steps as train_steps

    run, log = tmp_path / "run", tmp_path / "run.log"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setattr(train_steps, "record_of", lambda run, log, seq_len: {"seq_len": seq_len, "warm_step_s": 2.0})
    assert "chunks" not in train_steps.row_of_run(run, log, 16384)
    lines = _chunk_lines([("fill", 1, 1, 0.0), ("backward", 1, 1, 0.8)], peak=15.0)
    (run / "chunks.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = train_steps.row_of_run(run, log, 16384)
    assert row["warm_step_s"] == 2.0 and row["chunks"] == lines
    assert "memory_peak" not in row
    (run / "memory_peak.json").write_text(json.dumps({"peak_gib": 14.9, "sites": []}))  # train.memory_snapshot's
    assert train_steps.row_of_run(run, log, 16384)["memory_peak"] == {"peak_gib": 14.9, "sites": []}


def test_a_longest_run_logs_its_chunks(tmp_path):
    from benchmarks.train_steps import run_length

    cpu = "train.device=cpu train.page_size=64 train.chunk_size=128"
    row = run_length("tiny", 256, 1, tmp_path, 120, ("c", cpu), log_chunks=True)
    assert len(row["steps"]) >= 1 and "partial" not in row  # a step ended: its metrics, not a partial
    lines = (tmp_path / "runc256" / "chunks.jsonl").read_text().splitlines()
    assert [json.loads(line)["stage"] for line in lines[:3]] == ["fill", "backward", "backward"]
