"""The names transformers' TrainingArguments, TRL and axolotl give oomb's settings, for the hint an unknown key gets
(oomb.train.config.settings), re-exported by oomb.train.config.keys."""

from __future__ import annotations

__all__ = ["OTHER_NAMES", "other_tools_hint"]


_HF = "transformers' TrainingArguments"
_TRL = "TRL's SFTConfig"
_TRL_MODEL = "TRL's ModelConfig"
_AXOLOTL = "axolotl"
# A setting's name in transformers' TrainingArguments, TRL's configs or axolotl's YAML -> (where, oomb's key, what
# to say after "<where>'" instead of "<where> calls <key> that", or None). Matched on the last part of an unknown
# key, in any section: train.gradient_accumulation_steps finds train.grad_accum, not the spelling closest to it.
OTHER_NAMES: dict[str, tuple[str, str | None, str | None]] = {
    "learning_rate": (_HF, "train.lr", None),
    "num_train_epochs": (_HF, "train.epochs", None),
    "max_steps": (_HF, "train.steps", None),
    "per_device_train_batch_size": (_HF, "train.batch_size", None),
    "gradient_accumulation_steps": (_HF, "train.grad_accum", None),
    "warmup_steps": (_HF, "train.warmup_steps", None),
    "warmup_ratio": ("transformers 4's TrainingArguments", "train.warmup_ratio", None),
    "lr_scheduler_type": (_HF, "train.lr_scheduler", None),
    "weight_decay": (_HF, "train.weight_decay", None),
    "max_grad_norm": (_HF, "train.grad_clip", None),
    "output_dir": (_HF, "out_dir", None),
    "save_steps": (_HF, "train.save_every", None),
    "save_total_limit": (_HF, "train.keep_last", None),
    "logging_steps": (_HF, None, "logging_steps has no key here: every step is logged (metrics.jsonl, "
                                 "train.report_to)"),
    "seed": (_HF, "train.seed", None),
    "bf16": (_HF, "model.dtype", "bf16=true is model.dtype=bfloat16 here (auto: bfloat16 on CUDA)"),
    "fp16": (_HF, "model.dtype", "fp16=true is model.dtype=float16 here"),
    "gradient_checkpointing": (_HF, "train.layer_checkpointing", None),
    "optim": (_HF, "train.optimizer", None),
    "report_to": (_HF, "train.report_to", None),
    "eval_steps": (_HF, "train.val_every", None),
    "resume_from_checkpoint": (_HF, "resume", None),
    "max_length": (_TRL, "data.seq_len", None),
    "max_seq_length": (_TRL, "data.seq_len", None),
    "dataset_text_field": (_TRL, "data.text_field", None),
    "model_name_or_path": (_TRL_MODEL, "model.path", None),
    "torch_dtype": (_TRL_MODEL, "model.dtype", None),
    "trust_remote_code": (_TRL_MODEL, "model.trust_remote_code", None),
    "lora_r": (_TRL_MODEL, "lora.r", None),
    "lora_alpha": (_TRL_MODEL, "lora.alpha", None),
    "lora_target_modules": (_TRL_MODEL, "lora.targets", None),
    "load_in_4bit": (_TRL_MODEL, "model.quantize", "load_in_4bit=true is model.quantize=nf4 here (with lora.r > 0)"),
    "base_model": (_AXOLOTL, "model.path", None),
    "sequence_len": (_AXOLOTL, "data.seq_len", None),
    "micro_batch_size": (_AXOLOTL, "train.batch_size", None),
    "num_epochs": (_AXOLOTL, "train.epochs", None),
    "lr_scheduler": (_AXOLOTL, "train.lr_scheduler", None),
    "optimizer": (_AXOLOTL, "train.optimizer", None),
    "val_set_size": (_AXOLOTL, "data.val_fraction", None),
    "datasets": (_AXOLOTL, "data.paths", None),
    "chat_template": (_AXOLOTL, "data.chat_template", None),
}


def other_tools_hint(name: str) -> str | None:
    """What an unknown key (its last part) is called here, where transformers, TRL or axolotl use that name, e.g.
    "transformers' TrainingArguments calls train.lr that" for learning_rate; None for other names."""
    entry = OTHER_NAMES.get(name.rsplit(".", 1)[-1])
    if entry is None:
        return None
    where, key, text = entry
    return f"{where} calls {key} that" if text is None else f"{where}' {text}"
