"""Collator batches through OombTrainer's step: the loss and gradients of transformers' own Trainer step,
for padded (left and right), packed (position_ids) and shift_labels batches; what it refuses, and why."""

import pytest
import torch
from helpers import rel_err
from tiny_models import VOCAB, tiny_model
from transformers import Trainer, TrainingArguments

from oomb.engine import StepOptions
from oomb.integrations import OombTrainer, oomb_batch

OOMB = StepOptions(chunk_size=32, page_size=16)


def _args(tmp_path, **overrides) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **overrides)


def _padded(side: str) -> dict:
    """Two rows of 40 and 27 tokens padded to 40 on ``side``; labels -100 on padding, as collators set them, and on
    a row's first token (after left padding, the last pad would predict it: from nothing in either step)."""
    lengths, n = (40, 27), 40
    ids = torch.zeros(2, n, dtype=torch.long)
    mask = torch.zeros(2, n, dtype=torch.long)
    for row, length in enumerate(lengths):
        span = slice(0, length) if side == "right" else slice(n - length, n)
        ids[row, span] = torch.randint(1, VOCAB, (length,))
        mask[row, span] = 1
    labels = torch.where(mask.bool(), ids, -100)
    labels[torch.arange(2), mask.argmax(dim=1)] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _packed() -> dict:
    """Samples of 30, 25 and 15 tokens in one row (padding-free), position_ids restarting at 0 for each."""
    lengths = (30, 25, 15)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[positions == 0] = -100  # no sample predicts the next one's first token
    labels[0, 5:12] = -100  # a prompt without loss
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _collated(side: str) -> dict:
    """As DataCollatorForLanguageModeling(mlm=False) pads: labels -100 on padding only, so after left padding the
    last pad position predicts the row's first token."""
    batch = _padded(side)
    batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    return batch


def _step(trainer_class, tmp_path, batch: dict, family: str = "llama", attn_implementation: str = "eager",
          **kwargs):
    torch.manual_seed(1)
    model = tiny_model(family, attn_implementation=attn_implementation)
    trainer = trainer_class(model=model, args=_args(tmp_path), **kwargs)
    count = int((batch["labels"][:, 1:] != -100).sum())
    loss = trainer.training_step(trainer.model, dict(batch), num_items_in_batch=torch.tensor(count))
    return float(loss), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("kind", ["right", "left", "packed"])
def test_the_step_equals_transformers_own_on_padded_and_packed_batches(tmp_path, kind):
    batch = _packed() if kind == "packed" else _padded(kind)
    loss, grads = _step(OombTrainer, tmp_path, batch, oomb_options=OOMB)
    want_loss, want_grads = _step(Trainer, tmp_path, batch)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases, so padding's keys and values are not 0
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_trains_as_transformers_sdpa_step_with_a_target_after_left_padding(tmp_path, family, side):
    # transformers' SDPA attention gives a padding query (every key masked) a zero output; oomb's padding attends
    # nothing, so the last left pad's prediction of the first token is the same. (Its eager attention differs: a
    # fully masked row there attends every key of the row uniformly.)
    batch = _collated(side)
    loss, grads = _step(OombTrainer, tmp_path, batch, family, oomb_options=OOMB)
    want_loss, want_grads = _step(Trainer, tmp_path, batch, family, attn_implementation="sdpa")
    assert rel_err(torch.tensor(loss), torch.tensor(want_loss)) <= 1e-5
    errors = {name: rel_err(grads[name], want) for name, want in want_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: relative gradient error {errors[worst]:.2e}"


def test_shift_labels_are_labels_moved_by_one():
    batch = _packed()
    shifted = torch.cat([batch["labels"][:, 1:], torch.full((1, 1), -100)], dim=1)
    moved = oomb_batch({"input_ids": batch["input_ids"], "shift_labels": shifted})
    assert torch.equal(moved.labels[:, 1:], batch["labels"][:, 1:]) and moved.labels[0, 0] == -100
    with pytest.raises(ValueError, match="shift_labels gives the last position"):
        oomb_batch({"input_ids": batch["input_ids"], "shift_labels": batch["input_ids"]})


def test_document_ids_from_positions_and_masks():
    assert oomb_batch({"input_ids": torch.ones(2, 5, dtype=torch.long), "labels": torch.ones(2, 5, dtype=torch.long),
                       "attention_mask": torch.ones(2, 5)}).doc_ids is None  # nothing to separate
    packed = oomb_batch(_packed())
    assert packed.doc_ids[0].bincount().tolist() == [30, 25, 15]
    left = oomb_batch(_padded("left"))
    assert left.doc_ids[1].bincount().tolist() == [13, 27] and left.doc_ids[0].unique().tolist() == [0]
    assert torch.equal(left.attention_mask, _padded("left")["attention_mask"])


@pytest.mark.parametrize("batch,message", [
    ({"attention_mask": torch.tensor([[1, 1, 0, 1, 1, 1]])}, "ones are not one run"),
    ({"attention_mask": torch.ones(1, 1, 6, 6)}, "4-D attention_mask"),
    ({"pixel_values": torch.ones(1, 3)}, r"the batch holds \['pixel_values'\]"),
    ({"labels": None}, "the batch has no labels"),
    ({"position_ids": torch.arange(5)[None]}, r"position_ids must have the shape of input_ids \(1, 6\)"),
])
def test_batches_oomb_cannot_train_are_refused_with_what_to_change(batch, message):
    base = {"input_ids": torch.ones(1, 6, dtype=torch.long), "labels": torch.ones(1, 6, dtype=torch.long)}
    inputs = {k: v for k, v in {**base, **batch}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        oomb_batch(inputs)


@pytest.mark.parametrize("settings,message", [
    ({"fp16": True}, "fp16=True scales the loss"),
    ({"bf16": True}, r"bf16=True asks for autocast, but the model's weights are torch.float32"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
    ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),
    ({"optim": "lomo"}, "runs the backward inside the optimizer"),
])
def test_settings_oomb_cannot_honour_are_refused_before_training(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        OombTrainer(model=tiny_model("llama"), args=_args(tmp_path, **settings))


def test_a_custom_loss_and_wrong_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="compute_loss_func is not supported"):
        OombTrainer(model=tiny_model("llama"), args=_args(tmp_path), compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(TypeError, match="oomb_options must be an oomb.engine.StepOptions"):
        OombTrainer(model=tiny_model("llama"), args=_args(tmp_path), oomb_options={"chunk_size": 64})


def test_bf16_weights_with_bf16_true_train(tmp_path):
    torch.manual_seed(1)
    model = tiny_model("llama").to(torch.bfloat16)
    trainer = OombTrainer(model=model, args=_args(tmp_path, bf16=True), oomb_options=OOMB)
    loss = trainer.training_step(trainer.model, _packed(), num_items_in_batch=None)
    assert torch.isfinite(loss) and all(p.grad is not None and p.grad.dtype == torch.bfloat16
                                        for p in trainer.model.parameters())


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_step(tmp_path, reentrant):
    rows = [{k: v[0] for k, v in _packed().items()} for _ in range(2)]

    def train(**settings):
        torch.manual_seed(1)
        trainer = OombTrainer(model=tiny_model("llama"), oomb_options=OOMB, train_dataset=rows,
                              args=_args(tmp_path, max_steps=2, per_device_train_batch_size=1, learning_rate=0.01,
                                         save_strategy="no", **settings))
        trainer.train()
        assert trainer.model.is_gradient_checkpointing == bool(settings)
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer.model.state_dict()

    losses, weights = train()
    checkpointed, checkpointed_weights = train(gradient_checkpointing=True,
                                               gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert checkpointed == pytest.approx(losses, rel=1e-6)
    for name, value in weights.items():
        torch.testing.assert_close(checkpointed_weights[name], value, rtol=1e-5, atol=1e-7)
