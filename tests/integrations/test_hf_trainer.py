"""OombTrainer (transformers' Trainer with oomb's step) against `oomb train`: same data, seed, settings."""

import json
import random

import pytest
import torch
from chat_tokenizer import PLAIN_TEMPLATE, chat_tokenizer
from safetensors.torch import load_file
from transformers import TrainingArguments

from oomb.cli import main
from oomb.engine import StepOptions
from oomb.integrations import OombTrainer
from oomb.train.config.presets import build_model, preset_config
from oomb.train.config.settings import load_config
from oomb.train.data.inputs import build_inputs
from oomb.train.runfolder.checkpoint import find_checkpoint

STEPS, ACCUM, LR, SEED = 3, 2, 0.01, 3
OOMB = StepOptions(chunk_size=64, page_size=32)


def _chat_args(tmp_path) -> list[str]:
    """`oomb train` on conversations: assistant-only labels (-100 elsewhere), samples packed as documents."""
    chat_tokenizer(None).save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "chat.jinja").write_text(PLAIN_TEMPLATE)
    rng = random.Random(0)
    rows = []
    for _ in range(40):
        words = " ".join(rng.choices("one two three four five six seven".split(), k=rng.randint(2, 6)))
        rows.append({"prompt": f"tell me {words}", "completion": f"{words} ."})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A constant rate (no warmup, min_lr_ratio 1): transformers' lr_scheduler_type="constant".
    return [f"data.tokenizer={tmp_path / 'tokenizer'}", f"data.chat_template={tmp_path / 'chat.jinja'}",
            "data.task=chat", f"data.paths=[{tmp_path / 'train.jsonl'}]", "data.seq_len=128",
            f"train.chunk_size={OOMB.chunk_size}", f"train.page_size={OOMB.page_size}", "train.device=cpu",
            f"train.lr={LR}", "train.warmup_steps=0", "train.min_lr_ratio=1.0", f"train.steps={STEPS}",
            f"train.grad_accum={ACCUM}", f"train.seed={SEED}", "train.export=false"]


def _rows(args: list[str]) -> list[dict]:
    """The sequences `oomb train` trains on, in its order, as a packing collator gives them: position_ids
    restarting at 0 for each sample (documents), labels -100 outside the assistant's tokens."""
    inputs = build_inputs(load_config(None, args), preset_config("tiny"))
    rows = []
    for step in range(STEPS):
        for batch in inputs.batches(step):
            doc = batch.doc_ids[0]
            starts = torch.ones_like(doc, dtype=torch.bool)
            starts[1:] = doc[1:] != doc[:-1]
            index = torch.arange(doc.numel())
            first = torch.where(starts, index, 0).cummax(0).values
            rows.append({"input_ids": batch.input_ids[0], "labels": batch.labels[0], "position_ids": index - first})
    return rows


def _trainer(tmp_path, rows, **overrides) -> OombTrainer:
    torch.manual_seed(SEED)  # as `oomb train` builds its preset
    model = build_model("tiny", dtype=torch.float32, device=torch.device("cpu"))
    settings = dict(output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=1,
                    gradient_accumulation_steps=ACCUM, learning_rate=LR, lr_scheduler_type="constant",
                    weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=True, train_sampling_strategy="sequential", seed=SEED)
    args = TrainingArguments(**{**settings, **overrides})
    return OombTrainer(model=model, args=args, train_dataset=rows, oomb_options=OOMB)


def test_oomb_trainer_trains_as_oomb_train_does(tmp_path):
    args = _chat_args(tmp_path)
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", *args]) == 0
    expected = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    rows = _rows(args)
    assert any((r["position_ids"][1:] == 0).any() for r in rows)  # packed: several documents in a row
    assert all((r["labels"] == -100).float().mean() > 0.3 for r in rows)  # prompts carry no loss
    trainer = _trainer(tmp_path, rows)
    trainer.train()

    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [r["step"] for r in expected]
    assert [h["loss"] for h in logged] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    assert [h["grad_norm"] for h in logged] == pytest.approx([r["grad_norm"] for r in expected], rel=1e-4)
    weights = load_file(find_checkpoint(run) / "model.safetensors")
    torch.manual_seed(SEED)
    start = build_model("tiny", dtype=torch.float32, device=torch.device("cpu")).state_dict()
    trained = trainer.model.state_dict()
    assert weights and set(weights) <= set(trained)
    for name, value in weights.items():
        # Against the size of the update: Adam turns rounding noise in a near-zero gradient into a full step.
        assert float((trained[name] - value).norm() / (value - start[name]).norm()) < 1e-3, name


def test_oomb_trainer_evaluates_the_loss_of_each_sample_run_alone(tmp_path):
    rows = _rows(_chat_args(tmp_path))[:4]
    trainer = _trainer(tmp_path, rows, per_device_eval_batch_size=2)
    metrics = trainer.evaluate(eval_dataset=rows)  # chunked_eval, packed rows two to a batch
    model = trainer.model.eval()
    # Trainer averages the batches' mean losses; each batch's is its samples' NLL over its targets,
    # every sample run alone through transformers' own forward.
    per_batch = [sum(_sum_nll(model, r) for r in pair) / sum(int((r["labels"][1:] != -100).sum()) for r in pair)
                 for pair in (rows[:2], rows[2:])]
    assert metrics["eval_loss"] == pytest.approx(sum(per_batch) / 2, rel=1e-5)


def _sum_nll(model, row) -> float:
    """Summed next-token NLL of a packed row, every sample run alone from position 0."""
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [row["input_ids"].numel()]
    total = 0.0
    with torch.no_grad():
        for start, end in zip(starts, starts[1:], strict=False):
            ids, labels = row["input_ids"][start:end], row["labels"][start:end].clone()
            labels[0] = -100  # nothing of the sample precedes its first token
            if end - start < 2 or not (labels[1:] != -100).any():
                continue
            logits = model(input_ids=ids[None]).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum"))
    return total
