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
