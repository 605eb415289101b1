"""`oomb eval`: bucket arithmetic, the retrieval metric (it can fail), model loading, output files, errors."""

import json
import math
import shutil

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from oomb.cli import main
from oomb.engine import chunked_eval
from oomb.train.data.sources import NeedleTask, PasskeyTask
from oomb.train.eval.eval_model import EvalError, check_positions, load_eval_model, rope_is_scaled
from oomb.train.eval.metrics import (
    PositionBuckets,
    answers_correct,
    bucket_edges,
    parse_depths,
    parse_lengths,
    perplexity_by_position,
    retrieval_grid,
)

PNG = b"\x89PNG\r\n\x1a\n"


def test_bucket_edges():
    assert bucket_edges(10, "pow2") == [1, 2, 4, 8, 10]
    assert bucket_edges(9, "pow2") == [1, 2, 4, 8, 9]
    assert bucket_edges(2, "pow2") == [1, 2]
    assert bucket_edges(11, "4") == [1, 3, 6, 8, 11]  # 10 positions in 4 buckets: widths 2, 3, 2, 3
    assert bucket_edges(5, "4") == [1, 2, 3, 4, 5]


def test_bucket_means_against_a_hand_computation():
    # Column t predicts the token at position t + 1; the last column has no target (NaN).
    nan = float("nan")
    nll = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, nan],
                        [3.0, nan, 1.0, 1.0, 2.0, nan]])
    buckets = PositionBuckets(bucket_edges(6, "pow2"))  # [1,2) [2,4) [4,6)
    buckets.add(nll)
    rows = buckets.rows()
    assert [(r["start"], r["end"], r["tokens"]) for r in rows] == [(1, 2, 2), (2, 4, 3), (4, 6, 4)]
    assert rows[0]["mean_nll"] == pytest.approx((1 + 3) / 2)  # positions 1: columns 0
    assert rows[1]["mean_nll"] == pytest.approx((2 + 3 + 1) / 3)  # positions 2-3: columns 1, 2 (one NaN)
    assert rows[2]["mean_nll"] == pytest.approx((4 + 5 + 1 + 2) / 4)  # positions 4-5: columns 3, 4
    assert rows[2]["perplexity"] == pytest.approx(math.exp(3.0))
    overall = buckets.overall()
    assert overall["tokens"] == 9 and overall["mean_nll"] == pytest.approx(22 / 9)
    buckets.add(nll[:1])  # accumulates over documents
    assert buckets.rows()[0]["tokens"] == 3 and buckets.rows()[0]["mean_nll"] == pytest.approx(5 / 3)


@pytest.mark.parametrize(
    "fn,arg,match",
    [
        (parse_lengths, "4k,x", "bad length 'x'"),
        (parse_lengths, "1", "bad length '1'"),
        (parse_lengths, "1k,1024", "repeat"),
        (parse_depths, "0,1.5", r"outside \[0, 1\]"),
        (parse_depths, "0,half", "bad depth 'half'"),
        (lambda s: bucket_edges(10, s), "0", "pow2' or a positive number"),
        (lambda s: bucket_edges(10, s), "log", "pow2' or a positive number"),
        (lambda s: bucket_edges(10, s), "10", "more than the 9 predicted positions"),
    ],
)
def test_bad_grid_specs(fn, arg, match):
    with pytest.raises(EvalError, match=match):
        fn(arg)


def test_grid_specs():
    assert parse_lengths("4k, 512,1M") == [512, 4096, 1024**2]
    assert parse_depths("1,0,0.5") == [0.0, 0.5, 1.0]


def test_perplexity_by_position_equals_the_full_forward():
    model = tiny_model("qwen2")
    docs = [torch.randint(0, VOCAB, (n,)) for n in (90, 40, 100, 80)]  # the 40-token one is skipped
    result = perplexity_by_position(model, docs, length=80, edges=bucket_edges(80, "3"), max_documents=2,
                                    batch_size=2, chunk_size=32, page_size=16)
    assert result["documents"] == 2 and result["skipped_short_documents"] == 1
    ids = torch.stack([docs[0][:80], docs[2][:80]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
    nll = -logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # column t predicts position t + 1
    assert result["tokens"] == 2 * 79
    assert result["mean_nll"] == pytest.approx(nll.mean().item(), abs=1e-5)
    for row in result["buckets"]:
        ref = nll[:, row["start"] - 1 : row["end"] - 1]
        assert row["tokens"] == ref.numel()
        assert row["mean_nll"] == pytest.approx(ref.mean().item(), abs=1e-5)
    with pytest.raises(EvalError, match="no document has 200 tokens"):
        perplexity_by_position(model, docs, length=200, edges=[1, 200], max_documents=4)


class _ArgmaxAnswers:
    """A retrieval task whose answer tokens are what ``model`` predicts (shift=0) or one id off (shift=1)."""

    def __init__(self, task_cls, model, shift, seq_len, depth, seed, digits):
        self.model, self.shift = model, shift
        self.task = task_cls(seq_len, digits=digits, depth=depth, seed=seed)
        self.vocab_size = self.task.vocab_size

    def batch(self, step, batch_size):
        batch = self.task.batch(step, batch_size)
        vocab = self.model.config.vocab_size
        with torch.no_grad():
            for j in range(batch.answer_positions.shape[1]):  # each answer token given the ones before it
                logits = self.model(input_ids=batch.input_ids).logits
                for b, pos in enumerate(batch.answer_positions[:, j].tolist()):
                    batch.input_ids[b, pos + 1] = (int(logits[b, pos].argmax()) + self.shift) % vocab
        return batch


@pytest.mark.parametrize("task_cls", [PasskeyTask, NeedleTask])
@pytest.mark.parametrize("shift,expected", [(0, 1.0), (1, 0.0)])
def test_retrieval_accuracy_can_be_one_and_zero(task_cls, shift, expected):
    model = tiny_model("llama")  # vocabulary 101 >= the tasks' 64
    grid = retrieval_grid(model, lambda n, d, s, k: _ArgmaxAnswers(task_cls, model, shift, n, d, s, k),
                          lengths=[64, 100], depths=[0.0, 1.0], samples=3, digits=3, batch_size=2,
                          chunk_size=32, page_size=16)
    assert grid["accuracy"] == [[expected, expected], [expected, expected]]
    assert all(c["token_accuracy"] == expected for c in grid["cells"])


def test_answers_correct_needs_every_answer_token():
    correct = torch.tensor([[True, True, True, False], [True, False, True, True]])
    where = torch.tensor([[0, 1, 2], [1, 2, 3]])
    assert answers_correct(correct, where).tolist() == [True, False]


def test_positions_check():
    model = tiny_model("llama", max_position_embeddings=512)
    check_positions(model.config, 512, "length")
    with pytest.raises(EvalError, match="longer than the model's max_position_embeddings=512"):
        check_positions(model.config, 513, "length")
    assert not rope_is_scaled(model.config)
    model.config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                    "original_max_position_embeddings": 512}
    assert rope_is_scaled(model.config)
    check_positions(model.config, 2048, "length")


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny Hugging Face model folder without tokenizer (byte-level), 300 ids, 1024 positions."""
    path = tmp_path / "hf"
    tiny_model("qwen2", vocab_size=300, max_position_embeddings=1024).save_pretrained(path)
    return path


def test_cli_writes_results_and_plots(tmp_path, hf_dir, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(f"document {i}: " + "lorem ipsum dolor sit amet " * 20)
    (docs / "short.txt").write_text("too short")
    out = tmp_path / "eval"
    argv = ["eval", str(hf_dir), "--perplexity", str(docs), "--ppl-length", "300", "--buckets", "4",
            "--retrieval", "--lengths", "128,200", "--depths", "0,0.5,1", "--samples", "2",
            "--chunk-size", "64", "--page-size", "32", "--batch-size", "2", "--out", str(out)]
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["perplexity.png", "results.json", "retrieval.png"]
    for png in ("perplexity.png", "retrieval.png"):
        assert (out / png).read_bytes().startswith(PNG)
    results = json.loads((out / "results.json").read_text())
    assert results["command"].startswith("oomb eval ") and "--retrieval" in results["command"]
    assert results["model"]["source"] == "huggingface" and results["model"]["vocab_size"] == 300
    assert results["settings"] == {"chunk_size": 64, "page_size": 32, "batch_size": 2, "page_budget": None,
                                   "select_block": None, "select_score": None, "offload": False,
                                   "offload_gpu_bytes": 0}
    ppl = results["perplexity"]
    assert ppl["documents"] == 3 and ppl["skipped_short_documents"] == 1
    assert [b["start"] for b in ppl["buckets"]] == [1, 75, 150, 225] and ppl["tokens"] == 3 * 299
    assert math.isfinite(ppl["perplexity"]) and ppl["perplexity"] > 1
    grid = results["retrieval"]
    assert grid["lengths"] == [128, 200] and grid["depths"] == [0.0, 0.5, 1.0]
    assert len(grid["accuracy"]) == 3 and all(len(row) == 2 for row in grid["accuracy"])
    assert all(0.0 <= a <= 1.0 for row in grid["accuracy"] for a in row)
    assert len(grid["cells"]) == 6
    printed = capsys.readouterr().out
    assert "perplexity by position" in printed and "retrieval accuracy" in printed


def test_sparse_and_offloaded_evaluation(tmp_path, hf_dir):
    """--offload gives the same numbers; --page-budget at least the pages is dense; a small budget runs."""
    def grid(name, *extra):
        out = tmp_path / name
        assert main(["eval", str(hf_dir), "--retrieval", "--lengths", "256", "--depths", "0.2,0.9", "--samples",
                     "2", "--chunk-size", "64", "--page-size", "32", "--out", str(out), *extra]) == 0
        return json.loads((out / "results.json").read_text())

    dense = grid("dense")
    offloaded = grid("offload", "--offload", "--offload-gpu-memory", "1")
    assert offloaded["settings"]["offload"] is True
    assert offloaded["retrieval"]["cells"] == dense["retrieval"]["cells"]
    assert grid("wide", "--page-budget", "8")["retrieval"]["cells"] == dense["retrieval"]["cells"]  # 8 pages: all
    sparse = grid("sparse", "--page-budget", "2", "--select-block", "32")
    assert sparse["settings"]["page_budget"] == 2 and sparse["settings"]["select_block"] == 32
    assert [c["answer_mean_nll"] for c in sparse["retrieval"]["cells"]] != [
        c["answer_mean_nll"] for c in dense["retrieval"]["cells"]]  # 2 of 7 past pages: not the dense result
    mean = grid("mean", "--page-budget", "2", "--select-block", "32", "--select-score", "mean")
    assert mean["settings"]["select_score"] == "mean" and sparse["settings"]["select_score"] == "bound"
    # a chunk's blocks choose among page_budget pages by default, as train.chunk_pages=auto trains; none: any
    free = grid("free", "--page-budget", "2", "--select-block", "32", "--chunk-pages", "none")
    assert sparse["settings"]["chunk_pages"] == 2 and free["settings"]["chunk_pages"] is None
    assert [c["answer_mean_nll"] for c in free["retrieval"]["cells"]] != [
        c["answer_mean_nll"] for c in sparse["retrieval"]["cells"]]
    kept = grid("kept", "--page-budget", "3", "--select-block", "32", "--sink-pages", "1", "--local-pages", "1",
                "--select-per-head")
    assert {k: kept["settings"][k] for k in ("sink_pages", "local_pages", "select_per_head", "chunk_pages")} == {
        "sink_pages": 1, "local_pages": 1, "select_per_head": True, "chunk_pages": 3}


def test_sparse_as_trained_evaluates_with_the_run_s_own_selection(tmp_path, capsys):
    sparse_keys = ["train.page_budget=2", "train.select_block=32", "train.local_pages=1"]
    common = ["train.steps=1", "data.seq_len=256", "train.chunk_size=64", "train.page_size=32", "data.task=needle"]
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", *common, *sparse_keys]) == 0

    def evaluate(name, model, *extra):
        out = tmp_path / name
        code = main(["eval", str(model), "--retrieval", "--lengths", "256", "--depths", "0.5", "--samples", "1",
                     "--chunk-size", "64", "--page-size", "32", "--out", str(out), *extra])
        return code, (json.loads((out / "results.json").read_text()) if code == 0 else None)

    _, as_trained = evaluate("as-trained", run, "--sparse-as-trained")
    _, given = evaluate("given", run, "--page-budget", "2", "--select-block", "32", "--local-pages", "1")
    assert as_trained["settings"] == given["settings"] and as_trained["settings"]["local_pages"] == 1
    assert as_trained["retrieval"]["cells"] == given["retrieval"]["cells"]
    capsys.readouterr()
    assert evaluate("both", run, "--sparse-as-trained", "--page-budget", "2")[0] == 2
    assert "drop --page-budget" in capsys.readouterr().out
    dense = tmp_path / "dense"
    assert main(["train", f"out_dir={dense}", *common]) == 0
    capsys.readouterr()
    assert evaluate("dense-run", dense, "--sparse-as-trained")[0] == 2
    assert "trained with dense attention" in " ".join(capsys.readouterr().out.split())
    assert evaluate("no-run", "tiny", "--sparse-as-trained")[0] == 2
    assert "is not a run's checkpoint" in " ".join(capsys.readouterr().out.split())
    out = tmp_path / "other-pages"
    assert main(["eval", str(run), "--retrieval", "--lengths", "256", "--chunk-size", "128", "--out", str(out),
                 "--sparse-as-trained"]) == 2  # pages of 128 tokens against the run's 32
    assert "add --page-size 32" in " ".join(capsys.readouterr().out.split()) and not out.exists()


def test_checkpoint_loads_the_trained_weights(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=2", "data.seq_len=256", "train.chunk_size=128",
                 "train.page_size=64", "train.seed=5", "data.task=needle"]) == 0
    loaded = load_eval_model(str(run), torch.device("cpu"))
    exported = load_eval_model(str(run / "export"), torch.device("cpu"))
    assert loaded.source == "checkpoint" and loaded.run_config.train.seed == 5
    # the run's export is a transformers folder that knows its run: the same default task, seed and digits
    assert exported.source == "huggingface" and exported.run_config.data.task == "needle"
    assert exported.run_config.train.seed == 5
    ref = dict(exported.model.named_parameters())
    for name, p in loaded.model.named_parameters():
        assert torch.equal(p, ref[name]), name
    ids = torch.randint(0, 64, (1, 130))
    a = chunked_eval(loaded.model, ids, chunk_size=64, page_size=32)
    b = chunked_eval(exported.model, ids, chunk_size=64, page_size=32)
    assert torch.equal(a.nll.isnan(), b.nll.isnan()) and torch.allclose(a.nll, b.nll, equal_nan=True)
    out = tmp_path / "eval"
    assert main(["eval", str(run), "--retrieval", "--lengths", "256", "--depths", "0.5", "--samples", "1",
                 "--chunk-size", "128", "--page-size", "64", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["model"]["source"] == "checkpoint"
    assert results["retrieval"]["seed"] == 5 and results["retrieval"]["task"] == "needle"  # the run's
    assert main(["eval", str(run / "export"), "--retrieval", "--lengths", "256", "--depths", "0.5", "--samples",
                 "1", "--chunk-size", "128", "--page-size", "64", "--out", str(tmp_path / "eval-export")]) == 0
    results = json.loads((tmp_path / "eval-export" / "results.json").read_text())
    assert results["retrieval"]["seed"] == 5 and results["retrieval"]["task"] == "needle"
    shutil.copytree(run / "export", tmp_path / "export")  # the same folder away from its run: no run to read
    assert load_eval_model(str(tmp_path / "export"), torch.device("cpu")).run_config is None


@pytest.mark.parametrize(
    "args,match",
    [
        (["no/such/model", "--retrieval"], "no such folder, and not a built-in preset"),
        (["tiny"], "nothing to evaluate"),
        (["tiny", "--retrieval", "--lengths", "4k,abc"], "bad length 'abc'"),
        (["tiny", "--retrieval", "--depths", "0,2"], r"outside \[0, 1\]"),
        (["tiny", "--retrieval", "--chunk-size", "100", "--page-size", "64"], "multiple of --page-size"),
        (["tiny", "--retrieval", "--samples", "0"], "--samples must be positive"),
        (["tiny", "--retrieval", "--lengths", "16"], "too short"),
        (["tiny", "--perplexity", "no/such/docs"], "does not exist"),
        (["tiny", "--perplexity", "{docs}"], "257 ids but the model's embedding has only 64"),
        (["{hf}", "--retrieval", "--lengths", "2k"], "longer than the model's max_position_embeddings=1024"),
        (["{hf}", "--perplexity", "{docs}", "--ppl-length", "2048"], "max_position_embeddings=1024"),
        (["{hf}", "--perplexity", "{docs}", "--buckets", "pow3"], "pow2' or a positive number"),
        (["tiny", "--retrieval", "--page-budget", "0"], "--page-budget and --select-block must be positive"),
        (["tiny", "--retrieval", "--select-block", "32"], "--select-block only apply to page-sparse attention"),
        (["tiny", "--retrieval", "--page-budget", "4", "--chunk-pages", "lots"], "give a number of pages"),
        (["tiny", "--retrieval", "--page-budget", "4", "--chunk-pages", "2"], "chunk_pages .2. must be at least"),
        (["tiny", "--retrieval", "--page-budget", "2", "--sink-pages", "2", "--local-pages", "1"], "--sink-pages"),
        (["tiny", "--retrieval", "--offload-gpu-memory", "1GiB"], "add --offload"),
        (["tiny", "--retrieval", "--offload", "--offload-gpu-memory", "lots"], "not a memory size"),
    ],
)
def test_cli_refuses_bad_input_before_work(tmp_path, hf_dir, capsys, args, match):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("some text " * 50)
    out = tmp_path / "eval"
    args = [a.format(hf=hf_dir, docs=docs) for a in args]
    assert main(["eval", *args, "--out", str(out)]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert "eval error" in printed
    import re

    assert re.search(match, printed), printed
    assert not out.exists()


def test_cli_never_overwrites_results(tmp_path, capsys):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "results.json").write_text("precious\n")
    assert main(["eval", "tiny", "--retrieval", "--out", str(out)]) == 2
    assert "never overwrites" in capsys.readouterr().out
    assert (out / "results.json").read_text() == "precious\n"


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    for option in ("--perplexity", "--ppl-length", "--ppl-docs", "--buckets", "--text-field", "--tokenizer",
                   "--retrieval", "--task", "--lengths", "--depths", "--samples", "--digits", "--seed", "--out",
                   "--chunk-size", "--page-size", "--batch-size", "--device", "--dtype", "--page-budget",
                   "--select-block", "--select-score", "--chunk-pages", "--sink-pages", "--local-pages",
                   "--select-per-head", "--sparse-as-trained", "--offload", "--offload-gpu-memory"):
        assert option in text, option


def test_an_evaluation_whose_pages_cannot_fit_the_gpu_is_refused_before_work():
    from oomb.train.config.presets import preset_config
    from oomb.train.eval.evaluate import pages_shortfall

    config = preset_config("qwen2.5-7b")  # 28 layers x 4 KV heads x 128: 56 KiB of K and V a token
    gib = 2**30
    assert pages_shortfall(config, 128, torch.bfloat16, 1, 1 << 20, 80 * gib) is None  # 1M tokens: 56 GiB + summaries
    why = pages_shortfall(config, 128, torch.bfloat16, 2, 1 << 20, 80 * gib)
    assert why.startswith("2 x 1,048,576 tokens need 112.") and "80.00 GiB free" in why
    assert "--offload" in why and "--batch-size 1" in why
    assert "--batch-size" not in pages_shortfall(config, 128, torch.bfloat16, 1, 2 << 20, 80 * gib)
