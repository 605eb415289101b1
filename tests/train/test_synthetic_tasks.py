"""The built-in passkey and needle tasks keep their ids clear of the model's padding id.

An embedding keeps its padding row at zero (transformers zeroes it at init, and it gets no gradient). A zero row
at the first position stays zero through every decoder layer, and each RMSNorm's backward multiplies the
gradient there by 1 / sqrt(eps): Gemma-3 (pad id 0, four norms a layer) overflowed to NaN within eight of its 48
layers on the device, in transformers as in oomb. The tasks' own ids start at 0, their BOS.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from oomb.train.config.settings import load_config
from oomb.train.data.inputs import build_inputs, model_config
from oomb.train.data.sources import BOS, NeedleTask, PasskeyTask, first_task_id
from oomb.train.eval.metrics import retrieval_task
from oomb.train.eval.retrieval_report import _task_factory


def _shifted(labels: torch.Tensor, by: int) -> torch.Tensor:
    return torch.where(labels == -100, labels, labels + by)


@pytest.mark.parametrize("loss_on", ["all", "answer"])
@pytest.mark.parametrize("kind,extra", [(PasskeyTask, {}), (NeedleTask, {}), (NeedleTask, {"needles": 3})])
def test_a_padding_id_among_the_tasks_ids_shifts_them_past_it(kind, extra, loss_on):
    plain = kind(300, seed=1, loss_on=loss_on, **extra)
    for pad in (0, 2, 63):
        task = kind(300, seed=1, loss_on=loss_on, avoid_id=pad, **extra)
        assert task.first_id == pad + 1 and task.vocab_size == plain.vocab_size + pad + 1
        got, want = task.batch(3, 2), plain.batch(3, 2)
        assert torch.equal(got.input_ids, want.input_ids + pad + 1)
        assert torch.equal(got.labels, _shifted(want.labels, pad + 1))
        assert torch.equal(got.answer_positions, want.answer_positions)
        assert not (got.input_ids == pad).any()
    for pad in (None, 64, 128_000, -1):  # not among the task's ids: nothing moves
        task = kind(300, seed=1, loss_on=loss_on, avoid_id=pad, **extra)
        assert task.first_id == 0 and torch.equal(task.batch(3, 2).input_ids, plain.batch(3, 2).input_ids)


def test_first_task_id():
    assert first_task_id(64, None) == 0 and first_task_id(64, 0) == 1 and first_task_id(64, 64) == 0


def _gemma3(layers: int = 24) -> Gemma3TextConfig:
    return Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                            sliding_window=32, max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=0,
                            bos_token_id=2, eos_token_id=1)


def _nonfinite_grads(config: Gemma3TextConfig, ids: torch.Tensor) -> int:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model(input_ids=ids, labels=ids).loss.backward()
    return sum(not bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def test_a_gemma3_model_learns_the_passkey_task_with_finite_gradients():
    config = _gemma3()
    task = PasskeyTask(128, seed=0, avoid_id=config.pad_token_id)
    assert _nonfinite_grads(config, task.batch(0, 1).input_ids) == 0
    # What the shift prevents: the same sequence with the padding id first (the task's BOS unshifted).
    unshifted = PasskeyTask(128, seed=0).batch(0, 1).input_ids
    assert int(unshifted[0, 0]) == BOS == config.pad_token_id
    assert _nonfinite_grads(config, unshifted) > 0


def test_oomb_train_and_eval_use_the_same_shifted_ids():
    cfg = load_config(None, ["model.preset=gemma-3-12b", "data.seq_len=1024", "train.device=cpu"])
    config = model_config(cfg)
    assert config.pad_token_id == 0
    batch = build_inputs(cfg, config).batches(0)[0]
    assert int(batch.input_ids.min()) == 1 and int(batch.input_ids[0, 0]) == 1  # BOS, moved past the pad id
    evaluated = retrieval_task("passkey", config)(1024, 0.5, cfg.train.seed, cfg.data.passkey_digits)
    reported = _task_factory(cfg, config)(1024, None, cfg.train.seed, cfg.data.passkey_digits)
    assert evaluated.first_id == reported.first_id == 1
    assert retrieval_task("text", config) is None
    # A model without a padding id among them (Llama-3-8B's preset has none) reads the ids unshifted.
    llama = load_config(None, ["model.preset=llama-3-8b", "data.seq_len=1024", "train.device=cpu"])
    assert int(build_inputs(llama, model_config(llama)).batches(0)[0].input_ids[0, 0]) == BOS
