"""OombSFTTrainer: TRL's SFTTrainer (chat template, assistant-only loss, packing) with oomb's step."""

import random

import pytest
import torch
from chat_tokenizer import GENERATION_TEMPLATE, chat_tokenizer

from oomb.engine import StepOptions

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

OOMB = StepOptions(chunk_size=64, page_size=32)


def _conversations(n: int = 24):
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        words = " ".join(rng.choices("one two three four five six seven".split(), k=rng.randint(2, 8)))
        rows.append({"messages": [{"role": "user", "content": f"tell me {words}"},
                                  {"role": "assistant", "content": f"{words} ."}]})
    return datasets.Dataset.from_list(rows)


def _train(trainer_class, tmp_path, eval_dataset=None, **kwargs):
    from oomb.train.config.presets import build_model

    torch.manual_seed(0)
    model = build_model("tiny", dtype=torch.float32, device=torch.device("cpu"))
    config = trl.SFTConfig(output_dir=str(tmp_path / trainer_class.__name__), max_steps=3,
                           per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=0.01,
                           lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                           use_cpu=True, bf16=False, seed=0, packing=True, max_length=128, assistant_only_loss=True)
    trainer = trainer_class(model=model, args=config, train_dataset=_conversations(), eval_dataset=eval_dataset,
                            processing_class=chat_tokenizer(GENERATION_TEMPLATE), **kwargs)
    trainer.train()
    return trainer


def test_sft_trainer_with_packing_and_assistant_only_loss_trains_as_trl_does(tmp_path):
    from oomb.integrations import OombSFTTrainer

    ours = _train(OombSFTTrainer, tmp_path, oomb_options=OOMB)
    assert ours.padding_free  # packing: samples side by side in one row, position_ids restarting at 0
    theirs = _train(trl.SFTTrainer, tmp_path)
    loss = [h["loss"] for h in ours.state.log_history if "loss" in h]
    want = [h["loss"] for h in theirs.state.log_history if "loss" in h]
    assert len(loss) == 3 and loss == pytest.approx(want, rel=1e-4)
    start = dict(_tiny().named_parameters())
    for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters(), strict=True):
        # Against the size of the update: Adam turns rounding noise in a near-zero gradient into a full step.
        assert float((p - q).norm() / (q - start[name]).norm()) < 1e-3, name


def test_sft_evaluate_reports_trls_metrics(tmp_path):
    # eval_loss, eval_entropy, eval_mean_token_accuracy and eval_num_tokens as TRL's own SFTTrainer reports them,
    # and the num_tokens it logs in training.
    from oomb.integrations import OombSFTTrainer

    held_out = _conversations(10).shuffle(seed=1)
    ours = _train(OombSFTTrainer, tmp_path, eval_dataset=held_out, oomb_options=OOMB)
    theirs = _train(trl.SFTTrainer, tmp_path, eval_dataset=held_out)
    assert [h["num_tokens"] for h in ours.state.log_history if "loss" in h] == \
        [h["num_tokens"] for h in theirs.state.log_history if "loss" in h]
    got, want = ours.evaluate(), theirs.evaluate()
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"):
        assert got[key] == pytest.approx(want[key], rel=1e-3), key
    assert 0 < got["eval_mean_token_accuracy"] < 1 and got["eval_entropy"] > 0


def test_sft_settings_oomb_cannot_honour_are_refused(tmp_path):
    from oomb.integrations import OombSFTTrainer

    with pytest.raises(ValueError, match="loss_type='dft'"):
        config = trl.SFTConfig(output_dir=str(tmp_path), loss_type="dft", use_cpu=True, bf16=False, report_to="none")
        OombSFTTrainer(model=_tiny(), args=config,
                       train_dataset=_conversations(4), processing_class=chat_tokenizer(GENERATION_TEMPLATE))


def _tiny():
    from oomb.train.config.presets import build_model

    return build_model("tiny", dtype=torch.float32, device=torch.device("cpu"))
