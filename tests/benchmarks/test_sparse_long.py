"""benchmarks/studies/sparse_long.py (the sparse-training study) and its corpus: on the CPU, small.

The corpus builder on two standard-library packages; the device plan's commands, parsed by oomb's own parsers; the
time budget (a training run stopped by SIGTERM, then resumed) with a stand-in for `oomb train`; and the smoke: the
whole pipeline with a tiny model, cut after five commands, its folder then lost (a fresh machine) and continued from
the carried state.
"""

import argparse
import dataclasses
import json
import shutil
import textwrap

import pytest

from benchmarks.studies import code_corpus as cc
from benchmarks.studies import sparse_long as sl
from benchmarks.studies.sparse_long_report import group_edges, group_seconds, grouped

SMALL = ["--packages", "email", "--held-out", "json", "--vocab", "320", "--max-bytes", "60000", "--doc-tokens", "900"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "c"
    assert cc.main(["--out", str(out), *SMALL]) == 0
    return out, json.loads((out / "corpus.json").read_text())


def test_corpus_is_split_by_package_into_long_documents(corpus):
    out, d = corpus
    assert d["splits"]["train"]["packages"] == ["email"] and d["splits"]["heldout"]["packages"] == ["json"]
    assert d["tokenizer"]["vocab_size"] == 320 and d["missing_packages"] == []
    for split, package in (("train", "email"), ("heldout", "json")):
        rows = [json.loads(line) for line in (out / split / f"{package}.jsonl").read_text().splitlines()]
        assert rows and all(r["text"].startswith(f"# file: {package}/") and r["package"] == package for r in rows)
        assert all(r["tokens"] >= 900 for r in rows)  # every package here holds more than one document
        desc = next(p for p in d["packages"] if p["name"] == package)
        assert [r["tokens"] for r in rows] == desc["document_tokens"] and desc["version"].startswith("python")
        assert sum(r["files"] for r in rows) == desc["files"]
    from oomb.train.data.corpus import load_tokenizer

    tok = load_tokenizer(out / "tokenizer")  # what data.tokenizer=DIR/tokenizer loads
    assert tok.eos_token == cc.EOS and len(tok) == 320
    text = "def f(x):\n    return x  # a comment\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_corpus_is_deterministic_and_checks_its_packages(corpus, tmp_path, capsys):
    out, d = corpus
    assert cc.main(["--out", str(tmp_path / "again"), *SMALL]) == 0
    again = json.loads((tmp_path / "again" / "corpus.json").read_text())
    assert again["sha256"] == d["sha256"]
    assert (tmp_path / "again/tokenizer/tokenizer.json").read_bytes() == (out / "tokenizer/tokenizer.json").read_bytes()
    assert cc.main(["--out", str(tmp_path / "x"), "--packages", "json", "--held-out", "json"]) == 2
    assert cc.main(["--out", str(tmp_path / "y"), "--packages", "no_such_pkg_here", "--held-out", "json"]) == 2
    assert "none of the train packages" in capsys.readouterr().err


def test_documents_end_at_subtree_boundaries_and_absorb_a_short_tail():
    def f(subtree, tokens):
        return cc.SourceFile(f"{subtree}/m.py", subtree, "", tokens)

    files = [f("p/a", 6), f("p/a", 6), f("p/b", 3), f("p/c", 25), f("p/c", 1), f("p/d", 2)]
    docs = cc.documents(files, doc_tokens=10)
    # 12 >= 10 at the a -> b boundary; 28 >= 2 x 10 inside c; the last 3 tokens (c, d) join the document before
    assert [[x.tokens for x in d] for d in docs] == [[6, 6], [3, 25, 1, 2]]
    assert all(sum(x.tokens for x in d) >= 10 for d in docs)


def test_every_device_command_parses_and_the_arms_differ_only_in_the_budget(tmp_path):
    from oomb.train.config.settings import load_config
    from oomb.train.eval.evaluate import add_arguments

    steps = sl.plan(sl.FULL, tmp_path)
    for st in steps:
        if st.module == "oomb.cli" and st.args[0] == "train":
            load_config(None, st.args[1:])  # every key exists and has the right type
        elif st.module == "oomb.cli":
            p = argparse.ArgumentParser()
            add_arguments(p)
            p.parse_args(st.args[1:])
    fresh = {st.name: st.args for st in steps if st.run and not st.args[1].startswith("resume=")}
    for seed in sl.FULL.seeds:
        dense, sparse = fresh[f"B-dense-s{seed}.1"], fresh[f"B-sparse-s{seed}.1"]
        assert sorted(set(sparse) - set(dense)) == [f"out_dir={tmp_path.resolve()}/runs/B-sparse-s{seed}",
                                                    "train.page_budget=64"]
        assert f"train.seed={seed}" in dense and "model.rope.type=yarn" in dense and "model.rope.factor=16" in dense
    assert "model.rope.factor=64" in fresh["C-sparse-s1"] and "data.seq_len=1048576" in fresh["C-sparse-s1"]
    # the study's cap: three groups, each on a fresh machine (its inputs built again) started in 90 s
    total = sum(fresh + 90 for _, _, fresh in group_seconds(steps))
    assert total < 90 * 60


def test_dry_run_prints_every_command(tmp_path, capsys):
    assert sl.main(["--out", str(tmp_path / "d"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert text.count("python -m oomb.cli train") == 10 and text.count("python -m oomb.cli eval") == 12
    assert "# group 3" in text and not (tmp_path / "d").exists()
    assert sl.main(["--out", str(tmp_path / "d"), "--set", "nothing=1"]) == 2


FAKE_TRAIN = textwrap.dedent("""
    import json, signal, sys, time
    from pathlib import Path
    kv = dict(a.split("=", 1) for a in sys.argv[2:])
    run = Path(kv.get("resume") or kv["out_dir"])
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    done = [int(p.name[5:]) for p in (run / "checkpoints").glob("step-*")]
    step = max(done, default=0)
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    while step < int(kv["train.steps"]):
        if stop:
            sys.exit(75)
        time.sleep(0.1)
        step += 1
        (run / "checkpoints" / f"step-{step:08d}").mkdir()
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "loss": 1.0 / step, "seconds": 0.1}) + "\\n")
    if kv["train.export"] == "true":
        (run / "export").mkdir()
        (run / "export" / "config.json").write_text("{}")
""")


def test_a_run_stopped_at_the_budget_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "fake_oomb_train.py").write_text(FAKE_TRAIN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = tmp_path / "study"
    out.mkdir()
    s = dataclasses.replace(sl.SMOKE, save_reserve=1, est=(("start", 0.2), ("resume", 0.2)))
    step = sl.Step("R", 1, "fake_oomb_train", ["train", f"out_dir={out}/runs/R", "train.steps=40",
                                                "train.export=true"], "runs/R", [], 5.0, True, 40, True, 0.1)
    first = sl.Driver(s, out, [step], 4.0, False, None, None, "test")  # SIGTERM 1 s before the end
    with pytest.raises(sl.Stop, match="stopped at the time budget"):
        first.go()
    state = json.loads((out / "state.json").read_text())
    rec = state["steps"]["R"]
    assert rec["status"] == "partial" and rec["runs"][0]["rc"] == 75 and rec["runs"][0]["stopped_by_budget"]
    stopped_at = sl.latest_step(out / "runs/R")
    assert 0 < stopped_at < 40 and len(state["runs"]["R"]["metrics"]) == stopped_at
    second = sl.Driver(s, out, [step], None, False, None, None, "test")
    second.go()
    rec = second.state["steps"]["R"]
    assert rec["status"] == "done" and rec["attempts"] == 2 and "resume=" in rec["runs"][1]["command"]
    assert (out / "runs/R/export/config.json").is_file() and not (out / "runs/R/checkpoints").exists()
    assert [m["step"] for m in second.state["runs"]["R"]["metrics"]] == list(range(1, 41))
    # a step that reads R's export on a fresh machine (R's folder gone): R first, for which 0.5 s is too little
    other = sl.Step("R2", 1, "fake_oomb_train", ["train", f"out_dir={out}/runs/R2", "train.steps=1",
                                                 "train.export=true"], "runs/R2", ["R"], 1.0, True, 1, True, 0.1)
    (out / "runs").rename(tmp_path / "gone")
    with pytest.raises(sl.Stop, match="next: R, which needs"):
        sl.Driver(s, out, [step, other], 0.5, False, None, None, "test").go()


def test_position_groups():
    K = 1024
    assert group_edges(256 * K, 4 * K) == [0, 4 * K, 16 * K, 64 * K, 192 * K, 256 * K]
    assert group_edges(1024 * K, 4 * K) == [0, 4 * K, 16 * K, 64 * K, 256 * K, 768 * K, 1024 * K]
    ev = {"perplexity": {"mean_nll": 2.0, "buckets": [[1, 3, 2, 1.0], [3, 6, 1, 4.0], [6, 8, 0, None]]}}
    assert grouped(ev, [0, 3, 6, 8]) == [1.0, 4.0, None, 2.0]


@pytest.mark.slow
def test_smoke_runs_the_whole_study_and_survives_a_fresh_machine(tmp_path, capsys):
    out, carried, copy = tmp_path / "sl", tmp_path / "carried.json", tmp_path / "copy"
    smoke = ["--out", str(out), "--smoke", "--set", "seeds=1"]  # one pair, not two: half the commands
    assert sl.main([*smoke, "--max-commands", "5"]) == 0
    state = json.loads((out / "state.json").read_text())
    assert [k for k, v in state["steps"].items() if v["status"] == "done"] == [
        "corpus", "init", "A", "B-dense-s1.1", "B-dense-s1_step1"]
    shutil.copyfile(out / "state.json", carried)
    shutil.rmtree(out)  # a fresh machine: only the state travels
    assert sl.main([*smoke, "--state-from", str(carried), "--copy-to", str(copy)]) == 0
    assert "the study is complete" in capsys.readouterr().out
    record = json.loads((out / "sparse_long.json").read_text())
    steps = record["steps"]
    assert all(v["status"] == "done" for v in steps.values()) and len(steps) == len(record["plan"]) == 15
    # what the lost folder held was made again before the step that reads it, and the evaluation of the lost
    # checkpoint too (its group's steps all read the same A)
    assert {k: v["attempts"] for k, v in steps.items() if v["attempts"] > 1} == {
        "corpus": 2, "init": 2, "A": 2, "B-dense-s1.1": 2, "B-dense-s1_step1": 2}
    assert steps["B-dense-s1_step1"]["runs"][1]["order"] < steps["B-dense-s1.2"]["runs"][0]["order"]
    assert record["settings"]["seeds"] == [1] and record["corpus"]["splits"]["heldout"]["packages"] == ["json"]
    assert all(p["command"].startswith("python -m ") for p in record["plan"])
    evals = record["evals"]
    assert set(evals) == {"B-dense-s1_step1", "B-dense-s1_final", "B-sparse-s1_step1", "B-sparse-s1_final",
                          "B-sparse-s1_final-dense", "C-sparse-s1_final-1m", "B-sparse-s1_final-1m"}
    assert evals["C-sparse-s1_final-1m"]["perplexity"]["length"] == sl.SMOKE.c_len
    assert evals["B-sparse-s1_final"]["settings"]["page_budget"] == sl.SMOKE.budget
    assert {c["length"] for c in evals["B-dense-s1_final"]["retrieval"]["cells"]} == set(sl.SMOKE.needle_lengths)
    assert len(record["runs"]["A"]["metrics"]) == sl.SMOKE.a_steps and record["model"]["parameters"] > 0
    md = (out / "sparse_long.md").read_text()
    for row in ("| dense, seed 1 |", "| sparse vs dense, seed 1, % |", "| B-sparse-s1 at step 1 |",
                "| C: trained to 512, seed 1 |", "| C vs B, % |", "192-256 (last quarter)"):
        assert row in md
    assert sorted(p.name for p in copy.iterdir()) == ["sparse_long.json", "sparse_long.md", "state.json"]
    # the same folder with other settings is refused
    assert sl.main(["--out", str(out), "--smoke"]) == 2
