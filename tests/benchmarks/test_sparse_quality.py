"""The sparse-quality study (benchmarks/studies/sparse_quality.py) at smoke sizes on CPU: files, structure,
exactness."""

import json

import pytest

from benchmarks.studies import sparse_quality as sq


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("sq") / "run"
    assert sq.main(["--out", str(out), "--smoke", "--device", "cpu"]) == 0
    return out, json.loads((out / "sparse_quality.json").read_text())


def test_report_holds_every_setting_and_number(smoke):
    out, report = smoke
    s = sq.SMOKE
    assert report["command"].startswith("python -m benchmarks.studies.sparse_quality")
    assert "--smoke" in report["command"]
    assert report["date"] and report["device"] and report["settings"]["train_len"] == s.train_len
    for arm in ("dense", "sparse"):
        learned = report["learning"][arm]
        assert len(learned["training"]["losses"]) == s.steps
        for evaluation in ("retrieval_dense_eval", "retrieval_sparse_eval"):
            cells = learned[evaluation]["cells"]
            assert [(c["length"], c["depth"]) for c in cells] == [(n, d) for n in s.eval_lengths for d in s.eval_depths]
            assert all(0.0 <= c["accuracy"] <= 1.0 for c in cells)
    assert report["learning"]["sparse"]["training"]["page_budget"] == s.learn_budget
    pre = report["pretraining"]  # the shared short-context start
    assert len(pre["training"]["losses"]) == s.pretrain_steps and pre["training"]["page_budget"] is None
    assert set(pre["retrieval_dense_eval"]["mean_accuracy_by_length"]) == {str(s.pretrain_len), str(s.train_len)}
    assert set(report["learning"]["points_minus_dense"]["sparse"]) == {str(n) for n in s.eval_lengths}
    rows = report["gradient_quality"]
    assert {(r["length"], r["loss_on"], r["budget"], r["option"]) for r in rows} == {
        (n, loss, b, o) for n in s.grad_lengths for loss in ("all", "answer") for b in s.budgets for o in sq.OPTIONS}
    assert all(len(r["attention_by_layer"]) == s.layers for r in rows)
    assert (out / "dense_model" / "config.json").is_file()
    # the dense phase at the gradient length before the gradient study
    assert len(report["gradient_model"]["training"]["losses"]) == s.grad_model_steps > 0


def test_budget_covering_every_page_gives_the_dense_gradient(smoke):
    _, report = smoke
    rows = report["gradient_quality"]
    covering = [r for r in rows if r["covers_history"]]
    partial = [r for r in rows if not r["covers_history"]]
    assert covering and partial
    for r in covering:
        assert r["cosine"] == pytest.approx(1.0, abs=1e-12) and r["rel_err"] == 0.0, r
    # Pages left out change the gradient: the comparison is not vacuous.
    assert all(r["rel_err"] > 0 for r in partial)


def test_markdown_has_the_tables(smoke):
    out, report = smoke
    text = (out / "sparse_quality.md").read_text()
    assert text.startswith("# Page-sparse attention")
    assert "## Learning" in text and "## Gradient quality" in text
    for n in sq.SMOKE.grad_lengths:
        assert f"### {n} tokens" in text
    assert "| 64 (= dense) | 1.0000 / 0.000 |" in text
    header = "| budget (pages) | " + " | ".join(f"`{o}`" for o in sq.OPTIONS) + " |"
    assert text.count(header) == 2 * len(sq.SMOKE.grad_lengths)


def test_one_sparse_arm_per_selection_option_without_the_gradient_study(tmp_path):
    out = tmp_path / "run"
    assert sq.main(["--out", str(out), "--smoke", "--device", "cpu", "--learn-options", "bound,sink1",
                    "--no-gradient-study"]) == 0
    report = json.loads((out / "sparse_quality.json").read_text())
    learning = report["learning"]
    assert "gradient_quality" not in report and "sparse" not in learning
    assert set(learning["points_minus_dense"]) == {"sparse:bound", "sparse:sink1"}
    for option in ("bound", "sink1"):
        arm = learning[f"sparse:{option}"]
        assert arm["option"] == option and len(arm["training"]["losses"]) == sq.SMOKE.steps
        # each arm read with its own selection, and the dense-trained model with every arm's
        assert f"retrieval_sparse_eval:{option}" in arm and f"retrieval_sparse_eval:{option}" in learning["dense"]
    text = (out / "sparse_quality.md").read_text()
    assert "sparse training (budget 8, `bound`)" in text and "## Gradient quality" not in text
    assert "retrieval at 512, budget 8 `sink1` attention" in text
    assert sq.main(["--out", str(tmp_path / "bad"), "--smoke", "--learn-options", "fastest"]) == 2


def test_refuses_a_used_folder_and_bad_settings(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    assert sq.main(["--out", str(used), "--smoke"]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert (used / "keep.txt").read_text() == "mine"
    fresh = tmp_path / "fresh"
    assert sq.main(["--out", str(fresh), "--smoke", "--train-len", "128"]) == 2  # 4 past pages <= budget 8
    assert "sparse training would be dense" in capsys.readouterr().err
    assert not fresh.exists()


def test_batches_built_in_worker_processes_equal_the_serial_ones():
    import dataclasses

    import torch

    study = dataclasses.replace(sq.SMOKE, train_len=256, steps=3, batch_size=2)
    serial = list(sq.task_batches(study))
    pooled = list(sq.task_batches(dataclasses.replace(study, data_workers=2)))
    assert len(pooled) == len(serial) == 3
    for a, b in zip(pooled, serial, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.answer_positions, b.answer_positions)


def test_the_chunk_block_option_lists_pages_once_per_chunk():
    s = sq.SMOKE
    assert sq.selection(s, 8, "bound+chunk_block").block == s.chunk_size
    assert sq.selection(s, 8, "bound").block == s.block != s.chunk_size
    assert sq.selection(s, 8, "bound+chunk_block").score == sq.selection(s, 8, "bound").score == "bound"


def test_the_chunk_pages_options_cap_a_chunk_at_one_or_two_budgets():
    s = sq.SMOKE
    for option, times in (("bound+chunk_pages", 1), ("bound+chunk_pages2x", 2)):
        policy = sq.selection(s, 8, option)
        assert (policy.chunk_pages, policy.block, policy.score) == (8 * times, s.block, "bound")
    assert sq.selection(s, 8, "bound").chunk_pages is None
