"""`oomb train` as an application: text data, gradient accumulation, optimizers, monitoring, bad inputs."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoTokenizer

import oomb
from oomb.cli import main
from oomb.train.config.settings import load_config
from oomb.train.loop.distributed import DistributedContext
from oomb.train.loop.gradients import accumulate_gradients
from oomb.train.runfolder.checkpoint import find_checkpoint

FAST = ["data.seq_len=256", "train.chunk_size=128", "train.page_size=64", "train.device=cpu", "train.lr=0.01",
        "train.warmup_steps=1"]


@pytest.fixture
def text_dir(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(6):
        text = f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * (1 + i % 2)
        (folder / f"doc{i}.txt").write_text(text)
    (folder / "more.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 5}) + "\n" for i in range(4)))
    return folder


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _tensors(obj) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
    return [t for item in items for t in _tensors(item)]


def _tensorboard_scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _resume_from_step(run: Path, copy: Path, step: int) -> Path:
    """Copy a finished run and resume the copy from its checkpoint ``step`` (what a crash after it leaves)."""
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "export", ignore_errors=True)
    assert main(["train", f"resume={copy / 'checkpoints' / f'step-{step:08d}'}"]) == 0
    return copy


def test_gradient_accumulation_equals_one_batch_holding_the_sequences():
    model = tiny_model("llama")
    params = list(model.parameters())
    cfg = load_config(None, ["train.chunk_size=64", "train.page_size=32"])

    class Batch:
        def __init__(self, ids, labels):
            self.input_ids, self.labels, self.doc_ids = ids, labels, None

    ids = torch.randint(0, 101, (3, 150))
    labels = ids.clone()
    labels[0, :90] = -100  # different numbers of targets per sequence: the mean must weigh tokens, not batches
    labels[2, 100:] = -100
    loss = accumulate_gradients(model, [Batch(ids[i : i + 1], labels[i : i + 1]) for i in range(3)],
                                DistributedContext.single(torch.device("cpu")), cfg)
    accumulated = [p.grad.clone() for p in params]
    model.zero_grad()
    whole = oomb.chunked_backward(model, ids, labels, chunk_size=64, page_size=32)
    assert float(loss) == pytest.approx(float(whole), rel=1e-6)
    for a, p in zip(accumulated, params, strict=True):
        assert float((a - p.grad).norm() / p.grad.norm()) <= 1e-5


def test_grad_accum_run_equals_the_larger_batch_run(tmp_path):
    common = ["train.steps=2", "train.export=false", *FAST]
    assert main(["train", f"out_dir={tmp_path / 'a'}", "train.grad_accum=2", *common]) == 0
    assert main(["train", f"out_dir={tmp_path / 'b'}", "train.batch_size=2", *common]) == 0
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    assert a[-1]["tokens"] == b[-1]["tokens"] == 2 * 2 * 256


def test_text_run_resumes_exactly_and_exports_the_tokenizer(tmp_path, model_dir, text_dir):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", f"model.path={model_dir}", "data.task=text", f"data.paths=[{text_dir}]",
                 "data.document_mask=true", "train.steps=4", "train.save_every=2",
                 "train.report_to=[jsonl,tensorboard]",
                 *FAST]) == 0
    state = json.loads((find_checkpoint(run) / "state.json").read_text())
    assert state["data"]["corpus"]["epoch"] >= 1  # 4 x 256 tokens is more than the corpus: it wrapped

    resumed = _resume_from_step(run, tmp_path / "copy", 2)
    assert [r["loss"] for r in _metrics(resumed)] == [r["loss"] for r in _metrics(run)]
    final = "checkpoints/step-00000004/model.safetensors"
    assert (resumed / final).read_bytes() == (run / final).read_bytes()  # same data, same weights
    # TensorBoard drops the events of the steps that ran again, like metrics.jsonl.
    assert _tensorboard_scalars(resumed, "train/loss") == _tensorboard_scalars(run, "train/loss")

    exported = AutoTokenizer.from_pretrained(run / "export")
    assert exported.encode("héllo") == list("héllo".encode()) and exported.eos_token_id == 256


def test_monitoring_files_hold_the_logged_values(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=3", "train.report_to=[jsonl,tensorboard]",
                 "train.export=false", *FAST]) == 0
    records = _metrics(run)
    for r in records:
        assert r["host_rss_gib"] > 0.01 and r["eta_s"] >= 0 and r["tokens_per_s"] > 0
    assert records[-1]["eta_s"] == 0
    png = (run / "training.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    logged = dict(_tensorboard_scalars(run, "train/loss"))
    assert logged == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
    rss = [v for _, v in _tensorboard_scalars(run, "train/host_rss_gib")]
    assert rss == pytest.approx([r["host_rss_gib"] for r in records], rel=1e-6)


def test_the_chunk_log_has_each_chunk_s_start_in_step_order(tmp_path):
    # 256 tokens in chunks of 128: stage 1 fills the first, stage 2 runs both (newest first); with grad_accum=2 each
    # batch of the step in turn. The plain run writes no chunk log.
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=2", "train.grad_accum=2", "train.log_chunks=true",
                 "train.export=false", *FAST]) == 0
    lines = [json.loads(line) for line in (run / "chunks.jsonl").read_text().splitlines()]
    order = [("fill", 1, 1), ("backward", 1, 2), ("backward", 2, 2)]
    assert [(r["step"], r["batch"], r["stage"], r["chunk"], r["of"]) for r in lines] == [
        (step, batch, *chunk) for step in (1, 2) for batch in (1, 2) for chunk in order]
    for step in (1, 2):
        seconds = [r["seconds"] for r in lines if r["step"] == step]
        assert seconds == sorted(seconds) and seconds[-1] < _metrics(run)[step - 1]["seconds"]
    assert "peak_gpu_gib" not in lines[0]  # a CPU run has no GPU peak to report
    plain = tmp_path / "plain"
    assert main(["train", f"out_dir={plain}", "train.steps=1", "train.export=false", *FAST]) == 0
    assert not (plain / "chunks.jsonl").exists()


def test_8bit_optimizer_trains_and_resumes_exactly(tmp_path):
    pytest.importorskip("bitsandbytes")
    run = tmp_path / "run"
    # The tiny preset's embedding (64 x 128) and MLP weights have >= 4096 values: bitsandbytes quantizes them.
    assert main(["train", f"out_dir={run}", "train.optimizer=adamw8bit", "train.steps=4", "train.save_every=2",
                 "train.export=false", *FAST]) == 0
    opt = torch.load(find_checkpoint(run) / "optimizer.pt", weights_only=True)["optimizer"]
    assert any(t.dtype == torch.uint8 for t in _tensors(opt["state"]))  # the moments are stored in 8 bits
    losses = [r["loss"] for r in _metrics(run)]
    assert losses[-1] < losses[0]
    resumed = _resume_from_step(run, tmp_path / "copy", 2)
    assert [r["loss"] for r in _metrics(resumed)] == losses
    final = "checkpoints/step-00000004/model.safetensors"
    assert (resumed / final).read_bytes() == (run / final).read_bytes()


@pytest.mark.parametrize("args,match", [
    (["train.optimizer=sgd"], "train.optimizer='sgd': choose one of"),
    (["train.optimizer=paged_adamw8bit"], "needs a CUDA device"),
    (["data.task=text"], "data.task=text needs data.paths"),
    (["data.task=text", "data.paths=[/nonexistent/texts]"], "data path /nonexistent/texts does not exist"),
    (["data.task=text", "data.paths=[1, 2]"], r"data.paths .* must be a list of str or NoneType, got \[1, 2\]"),
    (["train.grad_accum=0"], "train.grad_accum must be positive"),
    (["train.grad_accum=1.5"], "train.grad_accum .* must be int"),
    (["data.document_mask=true"], "needs data.task=text"),
    (["data.task=needles"], "data.task='needles': choose passkey, needle"),
    (["data.task=needle", "data.needles=0"], "data.needles must be >= 1, got 0"),
    (["data.needles=4"], "data.needles=4 needs data.task=needle"),
    (["data.task=needle", "data.needles=4", "data.depth=0.5"], "data.needles=4 spreads .* leave data.depth null"),
    (["data.task=needle", "data.needles=20"], r"seq_len=256 is too short for 20 needles.*need >= 423"),
    (["data.task=needle", "data.needles=2.5"], "data.needles .* must be int"),
    (["train.memory_snapshot=2"], "train.memory_snapshot=2 records the CUDA allocator, and this run is on cpu"),
    (["train.memory_snapshot=-1"], "train.memory_snapshot=-1: the number of steps to record"),
    # The byte-level tokenizer (257 ids) does not fit the tiny preset's 64-row embedding.
    (["data.task=text", "data.paths=[{texts}]"], r"257 ids but the model's embedding has only 64 rows"),
])
def test_bad_inputs_stop_before_work(tmp_path, capsys, text_dir, args, match):
    if torch.cuda.is_available() and "paged" in args[0]:
        pytest.skip("CUDA is present: paged_adamw8bit is allowed")
    out = tmp_path / "out"
    args = [a.replace("{texts}", str(text_dir)) for a in args]
    assert main(["train", f"out_dir={out}", *FAST, *args]) == 2
    import re

    assert re.search(match, capsys.readouterr().out.replace("\n", "")), match
    assert not out.exists()


def test_multi_needle_run_trains_on_every_answer(tmp_path):
    from oomb.train.config.presets import preset_config
    from oomb.train.data.inputs import build_inputs

    args = ["data.task=needle", "data.needles=4", "data.passkey_digits=2", "data.loss_on=answer"]
    inputs = build_inputs(load_config(None, [*FAST, *args]), preset_config("tiny"))
    assert inputs.task.needles == 4
    (batch,) = inputs.batches(0)
    assert batch.answer_positions.shape == (1, 8) and int((batch.labels != -100).sum()) == 8
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=2", "train.export=false", *FAST, *args]) == 0
    assert json.loads((run / "config.json").read_text())["data"]["needles"] == 4
    assert all(r["loss"] == r["loss"] for r in _metrics(run))  # finite, not NaN


def test_a_bad_resume_never_touches_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=2", *FAST]) == 0
    before = _tree_digest(run)
    for bad in (["data.task=text", "data.paths=[/nonexistent]"], ["train.optimizer=nope"],
                ["model.rope.type=yarn", "model.rope.factor=0.5"]):
        assert main(["train", f"resume={run}", "train.steps=4", *bad]) == 2
    out = capsys.readouterr().out
    assert "does not exist" in out and "choose one of" in out and "model.rope.factor=0.5 must be >= 1" in out
    assert _tree_digest(run) == before
