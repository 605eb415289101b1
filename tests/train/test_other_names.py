"""An unknown key that transformers' TrainingArguments, TRL or axolotl use finds oomb's key for it."""

import pytest

from oomb.train.config.keys import OTHER_NAMES, describe_keys
from oomb.train.config.settings import ConfigError, load_config


@pytest.mark.parametrize("name,key", [
    ("learning_rate", "train.lr"), ("num_train_epochs", "train.epochs"),
    ("per_device_train_batch_size", "train.batch_size"), ("gradient_accumulation_steps", "train.grad_accum"),
    ("lr_scheduler_type", "train.lr_scheduler"), ("max_steps", "train.steps"), ("weight_decay", "train.weight_decay"),
    ("max_grad_norm", "train.grad_clip"), ("output_dir", "out_dir"), ("save_steps", "train.save_every"),
    ("seed", "train.seed"), ("gradient_checkpointing", "train.layer_checkpointing"),
])
def test_trainingarguments_names_find_the_key(name, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{name}=1"])
    assert str(e.value) == (f"unknown config key '{name}' (command line); transformers' TrainingArguments calls {key} "
                            "that")


def test_in_a_section_too_and_before_a_spelling_that_is_close():
    """train.gradient_accumulation_steps is closest in spelling to train.fused_grad_accumulation: the name wins."""
    with pytest.raises(ConfigError, match=r"'train.gradient_accumulation_steps' \(command line\); transformers' "
                                          r"TrainingArguments calls train.grad_accum that$"):
        load_config(None, ["train.gradient_accumulation_steps=4"])
    with pytest.raises(ConfigError, match=r"'warmup_ratio' \(command line\); transformers 4's TrainingArguments calls "
                                          r"train.warmup_ratio that"):
        load_config(None, ["warmup_ratio=0.1"])


def test_names_with_no_key_or_another_form_say_so(tmp_path):
    spec = tmp_path / "run.yaml"
    spec.write_text("train:\n  logging_steps: 10\n")
    with pytest.raises(ConfigError, match=r"logging_steps has no key here: every step is logged"):
        load_config(spec)
    with pytest.raises(ConfigError, match=r"bf16=true is model.dtype=bfloat16 here"):
        load_config(None, ["bf16=true"])
    with pytest.raises(ConfigError, match=r"did you mean train.steps\?"):  # other names: the closest spelling
        load_config(None, ["train.stpes=3"])


def test_every_name_leads_to_a_key_that_exists():
    keys = {key for key, _, _ in describe_keys()}
    assert {key for _, key, _ in OTHER_NAMES.values() if key is not None} <= keys
