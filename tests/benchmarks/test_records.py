"""benchmarks/records.py: records built from a GPU run's printed lines and from a long run's folder."""

import json

import pytest

from benchmarks import records

PYTEST_OUTPUT = """\
global relative gradient error vs fp32: oomb 0.0144, transformers bf16 0.0135; oomb vs transformers bf16: 0.0113
.global relative gradient error vs fp32: oomb 0.0142, transformers bf16 0.0134; oomb vs transformers bf16: 0.0094
.gradient pages bf16: error vs fp32 full sequence 0.01269; fp32 pages: 0.01268
.sparse+documents bf16 vs fp32: triton 0.01408, torch path 0.01430
15 passed, 366 deselected in 122.44s (0:02:02)
"""


def test_gradient_accuracy_reads_each_test_line():
    r = records.gradient_accuracy(PYTEST_OUTPUT)
    dense = r["dense_8269_tokens_chunk_2048"]
    assert dense["torch"] == {"oomb_vs_fp32": 0.0144, "transformers_bf16_vs_fp32": 0.0135,
                              "oomb_vs_transformers_bf16": 0.0113}
    assert dense["triton"]["oomb_vs_fp32"] == 0.0142 and dense["triton"]["oomb_vs_transformers_bf16"] == 0.0094
    assert r["gradient_pages_16384_tokens"] == {"bf16_pages_vs_fp32": 0.01269, "fp32_pages_vs_fp32": 0.01268}
    assert r["sparse_documents_bf16_vs_fp32"] == {"triton": 0.01408, "torch": 0.0143}


def test_gradient_accuracy_refuses_output_without_the_lines():
    with pytest.raises(records.RecordError, match="with -s"):
        records.gradient_accuracy("15 passed in 12.0s\n")


def _phase(run, name, seq_len, losses, done_seconds=None):
    folder = run / name
    folder.mkdir(parents=True)
    config = {"data": {"seq_len": seq_len}, "train": {"batch_size": 1, "steps": len(losses), "lr": 1e-4,
                                                      "chunk_size": min(seq_len, 4096)}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n"
                                                  for i, x in enumerate(losses)))
    if done_seconds is not None:
        (run / f"{name}.done").write_text(f"  {name}: ..., {done_seconds} s: answer loss ...")


def test_longrun_record_holds_phases_in_order_and_the_eval(tmp_path, capsys):
    run = tmp_path / "longrun"
    run.mkdir()
    (run / "settings.txt").write_text("PRESET=tiny DIGITS=1 CURRICULUM=128:4:20:5e-4 1024:2:10:4e-4 LONG_LEN=8192 "
                                      "LONG_LR=1e-4 EXTRA=")
    _phase(run, "len128", 128, [5.0] * 2 + [1.0] * 16 + [0.5] * 2, done_seconds=12)
    _phase(run, "len1024", 1024, [0.4] * 10, done_seconds=7)
    _phase(run, "long8192", 8192, [0.3, 0.2, 0.1])  # stopped by the time guard: no .done
    (run / "eval").mkdir()
    (run / "eval" / "results.json").write_text(json.dumps({"retrieval": {"accuracy": [[1.0]]}}))
    out = tmp_path / "record.json"
    assert records.main(["longrun", str(run), "--command", "bash x", "--machine", "m", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["command"] == "bash x" and r["machine"] == "m" and r["date"]
    assert r["settings"]["CURRICULUM"] == "128:4:20:5e-4 1024:2:10:4e-4" and r["settings"]["EXTRA"] == ""
    assert [p["name"] for p in r["phases"]] == ["len128", "len1024", "long8192"]
    first = r["phases"][0]
    assert first["answer_loss_first_tenth"] == 5.0 and first["answer_loss_last_tenth"] == 0.5  # 2 of 20 steps
    assert first["seconds"] == 12 and first["finished"] and len(first["metrics"]) == 20
    assert r["phases"][2]["seconds"] is None and not r["phases"][2]["finished"]
    assert r["eval"]["retrieval"]["accuracy"] == [[1.0]]

    (run / "eval" / "results.json").unlink()
    assert records.main(["longrun", str(run), "--command", "x", "--out", str(out)]) == 2
    assert "eval did not finish" in capsys.readouterr().err


def _unsloth_and_oomb(machine="1 x NVIDIA H100 80GB HBM3 (79.2 GiB)", day="2026-12-07"):
    unsloth = {"command": "python -m benchmarks.unsloth_step ...", "machine": "1 x NVIDIA H100 80GB HBM3 (79.2 GiB)",
               "date": "2026-12-07T15:03:48+00:00", "settings": {"lora": {"r": 32}}, "versions": {"unsloth": "x"},
               "results": [{"seq_len": 16384, "step_s": 2.0, "peak_gpu_gib": 10.0},
                           {"seq_len": 65536, "step_s": 16.0, "peak_gpu_gib": 20.0},
                           {"seq_len": 131072, "error": "out of memory"}]}
    oomb = {"command": "python -m benchmarks.train_steps ...", "machine": machine, "date": day, "keys": "lora.r=32",
            "results": [{"seq_len": 16384, "warm_step_s": 1.0, "chunk_size": 16384, "steps": [
                            {"peak_gpu_gib": 15.0}, {"peak_gpu_gib": 16.0}]},
                        {"seq_len": 65536, "warm_step_s": 12.0, "steps": [{"peak_gpu_gib": 30.0}]},
                        {"seq_len": 131072, "warm_step_s": 30.0, "steps": [{"peak_gpu_gib": 35.0}]}]}
    return unsloth, oomb


def test_oomb_beside_unsloth_at_the_lengths_both_ran_on_one_machine():
    from benchmarks.records import RecordError, versus_unsloth

    body = versus_unsloth(*_unsloth_and_oomb())
    assert [r["seq_len"] for r in body["rows"]] == [16384, 65536]  # Unsloth ran out of memory at 128K
    first, second = body["rows"]
    assert (first["time_ratio"], first["peak_ratio"], first["oomb_peak_gpu_gib"]) == (0.5, 1.6, 16.0)
    assert (second["time_ratio"], second["peak_ratio"]) == (0.75, 1.5)
    assert first["oomb_settings"]["chunk_size"] == 16384
    with pytest.raises(RecordError, match="different machines or days"):
        versus_unsloth(*_unsloth_and_oomb(machine="1 x NVIDIA H200 (139.8 GiB)"))
    with pytest.raises(RecordError, match="different machines or days"):
        versus_unsloth(*_unsloth_and_oomb(day="2026-12-08"))
    unsloth, oomb = _unsloth_and_oomb()
    oomb["results"] = oomb["results"][2:]
    with pytest.raises(RecordError, match="no length has a completed step in both"):
        versus_unsloth(unsloth, oomb)


def test_versus_unsloth_takes_one_oomb_record_per_setting(tmp_path):
    unsloth, oomb = _unsloth_and_oomb()
    lean = dict(oomb, keys="lora.r=32 train.offload=true", results=[
        {"seq_len": 65536, "warm_step_s": 14.0, "steps": [{"peak_gpu_gib": 19.0}]},
        {"seq_len": 65536, "variant": "layer-host", "keys": "train.recompute=layer-host", "warm_step_s": 12.0,
         "steps": [{"peak_gpu_gib": 19.5}]}])
    paths = []
    for name, body in (("u", unsloth), ("fast", oomb), ("lean", lean)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(body))
    out = tmp_path / "vs.json"
    assert records.main(["versus-unsloth", str(paths[0]), "--oomb", str(paths[1]), "--oomb", str(paths[2]),
                         "--command", "bash benchmarks/h200.sh ...", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [(r["seq_len"], r["oomb_keys"], r["oomb_variant"]) for r in got["rows"]] == [
        (16384, "lora.r=32", None), (65536, "lora.r=32", None), (65536, "lora.r=32 train.offload=true", None),
        (65536, "lora.r=32 train.offload=true train.recompute=layer-host", "layer-host")]  # a variant's keys added
    assert got["rows"][2]["peak_ratio"] == 0.95 and got["oomb_keys"] == ["lora.r=32", "lora.r=32 train.offload=true"]
    assert got["date"] == "2026-12-07" and got["machine"] == unsloth["machine"]
    assert records.main(["versus-unsloth", str(paths[0]), "--command", "x", "--out", str(out)]) == 2  # no --oomb
