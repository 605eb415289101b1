"""What a run trains on, built and checked before any work: synthetic tasks or packed text.

``build_inputs`` returns an object with ``batches(step)`` (the ``train.grad_accum``
batches of one optimizer step), ``state_dict()``/``load_state_dict()`` (the data
position a checkpoint stores) and ``tokenizer`` (None for the synthetic tasks, which
use fixed token ids). Everything that would stop the run later — missing files, a
tokenizer larger than the model's embedding, sequences longer than the model's
positions — raises ConfigError here, before a model or a run folder exists.
"""

from __future__ import annotations

from oomb.train.config import Config, ConfigError
from oomb.train.corpus import (
    DataError,
    check_sources,
    check_tokenizer_fits,
    find_sources,
    has_tokenizer,
    load_tokenizer,
)
from oomb.train.data import NeedleTask, PasskeyTask
from oomb.train.packing import PackedCorpus

TASKS = ("passkey", "needle", "text")


def model_config(cfg: Config):
    """The model's transformers config, read without building the model."""
    if cfg.model.path is not None:
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(cfg.model.path, local_files_only=True,
                                              trust_remote_code=cfg.model.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path={cfg.model.path!r}: cannot read its config.json: {e}") from e
    from oomb.train.presets import preset_config

    return preset_config(cfg.model.preset)


def _rope_scaled(config) -> bool:
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_type", rope.get("type", "default")) not in ("default", None)


def check_positions(cfg: Config, config) -> None:
    """data.seq_len must fit the model's positions unless its RoPE is scaled for longer contexts."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or cfg.data.seq_len <= limit or _rope_scaled(config):
        return
    where = f"{cfg.model.path}/config.json" if cfg.model.path else "the preset's config"
    raise ConfigError(
        f"data.seq_len={cfg.data.seq_len} is longer than the model's max_position_embeddings={limit}, and "
        f"{where} sets no RoPE scaling: set data.seq_len<={limit}, or give the model a rope_scaling entry "
        f'(e.g. "rope_scaling": {{"rope_type": "yarn", "factor": {cfg.data.seq_len / limit:g}, '
        f'"original_max_position_embeddings": {limit}}}) in a local model folder (model.path)'
    )


def wanted_tokenizer(cfg: Config):
    """The run's tokenizer: data.tokenizer, else the model folder's (byte level when it has none).

    For the synthetic tasks, only a model folder's own tokenizer is loaded (to go into the export).
    """
    try:
        if cfg.data.tokenizer is not None:
            return load_tokenizer(cfg.data.tokenizer)
        if cfg.data.task == "text":
            return load_tokenizer(cfg.model.path)
        if cfg.model.path is not None and has_tokenizer(cfg.model.path):
            return load_tokenizer(cfg.model.path)
    except DataError as e:
        raise ConfigError(str(e)) from e
    return None


class SyntheticInputs:
    """passkey / needle: batch ``step * grad_accum + m`` is a pure function of (seed, index)."""

    def __init__(self, task: PasskeyTask, batch_size: int, grad_accum: int, tokenizer=None) -> None:
        self.task, self.batch_size, self.grad_accum, self.tokenizer = task, batch_size, grad_accum, tokenizer

    def batches(self, step: int) -> list:
        return [self.task.batch(step * self.grad_accum + m, self.batch_size) for m in range(self.grad_accum)]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class TextInputs:
    """Packed local documents; the position in the corpus is the state a checkpoint keeps."""

    def __init__(self, corpus: PackedCorpus, batch_size: int, grad_accum: int, tokenizer) -> None:
        self.corpus, self.batch_size, self.grad_accum, self.tokenizer = corpus, batch_size, grad_accum, tokenizer

    def batches(self, step: int) -> list:
        return [self.corpus.batch(self.batch_size) for _ in range(self.grad_accum)]

    def state_dict(self) -> dict:
        return {"corpus": self.corpus.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "corpus" not in state:
            raise ConfigError("the checkpoint holds no text-data position (was it written by a data.task=text run?)")
        self.corpus.load_state_dict(state["corpus"])


def build_inputs(cfg: Config, config) -> SyntheticInputs | TextInputs:
    """The run's data, checked against the model's config (vocabulary, positions)."""
    d, t = cfg.data, cfg.train
    if d.task not in TASKS:
        raise ConfigError(f"data.task={d.task!r}: choose passkey, needle (built-in retrieval) or text (data.paths)")
    if d.document_mask and d.task != "text":
        raise ConfigError("data.document_mask=true needs data.task=text (the built-in tasks hold one document)")
    if d.needles < 1:
        raise ConfigError(f"data.needles must be >= 1, got {d.needles}")
    if d.needles > 1 and d.task != "needle":
        raise ConfigError(f"data.needles={d.needles} needs data.task=needle (passkey and text have no needles)")
    if d.needles > 1 and d.depth is not None:
        raise ConfigError(f"data.needles={d.needles} spreads its needles over the sequence: leave data.depth null "
                          f"(it is {d.depth})")
    check_positions(cfg, config)
    vocab = config.vocab_size
    if d.task == "text":
        if not d.paths:
            raise ConfigError("data.task=text needs data.paths: files, folders or glob patterns of text")
        try:
            check_sources(find_sources(d.paths), d.text_field)  # every file read once: a bad one is named now
        except DataError as e:
            raise ConfigError(f"data.paths: {e}") from e
    elif d.paths:
        raise ConfigError(f"data.paths is set but data.task={d.task!r} is a built-in task; set data.task=text")
    tokenizer = wanted_tokenizer(cfg)
    if tokenizer is not None:
        where = (f"the tokenizer in {d.tokenizer}" if d.tokenizer is not None
                 else f"the tokenizer of {cfg.model.path}" if cfg.model.path and has_tokenizer(cfg.model.path)
                 else "the byte-level tokenizer")
        try:
            check_tokenizer_fits(tokenizer, vocab, where=where)
        except DataError as e:
            raise ConfigError(str(e)) from e
    if d.task == "text":
        try:
            corpus = PackedCorpus(d.paths, tokenizer, d.seq_len, text_field=d.text_field, seed=t.seed,
                                  document_mask=d.document_mask)
        except DataError as e:
            raise ConfigError(f"data.paths: {e}") from e
        return TextInputs(corpus, t.batch_size, t.grad_accum, tokenizer)
    kind, extra = (NeedleTask, {"needles": d.needles}) if d.task == "needle" else (PasskeyTask, {})
    try:
        task = kind(d.seq_len, digits=d.passkey_digits, depth=d.depth, loss_on=d.loss_on, seed=t.seed, **extra)
    except ValueError as e:
        raise ConfigError(f"data: {e}") from e
    if vocab < task.vocab_size:
        raise ConfigError(f"the model's vocabulary ({vocab}) is smaller than the {d.task} task's ({task.vocab_size})")
    return SyntheticInputs(task, t.batch_size, t.grad_accum, tokenizer)

