"""What a run trains on, built and checked before any work: synthetic tasks, packed text or conversations.

``build_inputs`` returns an object with ``batches(step)`` (the ``train.grad_accum``
batches of one optimizer step), ``state_dict()``/``load_state_dict()`` (the data
position a checkpoint stores), ``tokenizer`` (None for the synthetic tasks, which
use fixed token ids) and ``notes`` (lines for the startup log). Everything that would
stop the run later — missing files, a bad row, a tokenizer larger than the model's
embedding — raises ConfigError here, before a model or a run folder exists. Sequences
longer than the model's positions are warned about (``positions_warning``), not refused.
"""

from __future__ import annotations

from oomb.train.config.demo import demo_note
from oomb.train.config.hub import model_folder, pin_dataset_revisions, pin_model_revision, tokenizer_folder
from oomb.train.config.rope import SCALINGS, apply_rope, describe_rope, rope_is_scaled
from oomb.train.config.settings import Config, ConfigError
from oomb.train.data.chat import read_template
from oomb.train.data.chat_packing import ChatCorpus
from oomb.train.data.corpus import (
    TEXT_SUFFIXES,
    DataError,
    check_tokenizer_fits,
    find_sources,
    has_tokenizer,
    load_tokenizer,
)
from oomb.train.data.packing import PackedCorpus
from oomb.train.data.rows import check_sources
from oomb.train.data.sources import NeedleTask, PasskeyTask, padding_id
from oomb.train.data.windows import held_out

TASKS = ("passkey", "needle", "text", "chat")
# data.loss_on: what each task accepts; the first is what "auto" means.
LOSS_ON = {"passkey": ("all", "answer"), "needle": ("all", "answer"), "text": ("all",), "chat": ("assistant", "all")}


def model_config(cfg: Config):
    """The model's transformers config with model.rope applied, read without building the model."""
    if cfg.model.path is not None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_folder(cfg.model.path, weights=False), local_files_only=True,
                                                trust_remote_code=cfg.model.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path={cfg.model.path!r}: cannot read its config.json: {e}") from e
    else:
        from oomb.train.config.presets import preset_config

        config = preset_config(cfg.model.preset)
    try:
        apply_rope(cfg.model.rope, config, cfg.data.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return config


def position_notes(cfg: Config, config) -> list[str]:
    """The startup lines (of `oomb train` and `oomb plan`) on the model's positions: the RoPE model.rope.* set,
    and positions_warning's."""
    lines = [f"note: model.rope: {describe_rope(config)}"] if any(vars(cfg.model.rope).values()) else []
    warning = positions_warning(cfg, config)
    return lines + ([f"warning: {warning}"] if warning is not None else [])


def positions_warning(cfg: Config, config) -> str | None:
    """What to say when data.seq_len passes the model's positions and its RoPE is not scaled (None: fine).

    Not refused: a model can be trained past its positions (and a random-init one has none trained),
    but a pretrained one extends its context far better with a RoPE scaling, which the message names.
    """
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or cfg.data.seq_len <= limit or rope_is_scaled(config):
        return None
    return (f"data.seq_len={cfg.data.seq_len} is longer than the model's max_position_embeddings={limit} and its "
            f"RoPE is not scaled: positions past {limit} are outside the range it was trained on. To extend its "
            f"context, set model.rope.type=yarn (model.rope.factor then defaults to data.seq_len / {limit} = "
            f"{cfg.data.seq_len / limit:g}; linear, dynamic and llama3 are the other scalings; docs/config.md), or "
            f"set data.seq_len<={limit}")


def wanted_tokenizer(cfg: Config):
    """The run's tokenizer: data.tokenizer, else the model folder's (byte level when it has none).

    For the synthetic tasks, only a model folder's own tokenizer is loaded (to go into the export).
    """
    try:
        if cfg.data.tokenizer is not None:
            return load_tokenizer(tokenizer_folder(cfg.data.tokenizer))
        folder = model_folder(cfg.model.path, weights=False) if cfg.model.path is not None else None
        if cfg.data.task in ("text", "chat"):
            return load_tokenizer(folder)
        if folder is not None and has_tokenizer(folder):
            return load_tokenizer(folder)
    except DataError as e:
        raise ConfigError(str(e)) from e
    return None


def tokenizer_source(cfg: Config) -> str:
    """Which tokenizer ``wanted_tokenizer`` gives, for messages."""
    if cfg.data.tokenizer is not None:
        return f"the tokenizer in {cfg.data.tokenizer}"
    if cfg.model.path is not None and has_tokenizer(model_folder(cfg.model.path, weights=False)):
        return f"the tokenizer of {cfg.model.path}"
    return "the byte-level tokenizer"


def training_rows(cfg: Config):
    """The rows a run trains on: all, or (data.val_fraction) those not held out for validation."""
    fraction = cfg.data.val_fraction
    if fraction <= 0:
        return None
    return lambda source, number: not held_out(source, number, fraction)


class SyntheticInputs:
    """passkey / needle: batch ``step * grad_accum + m`` is a pure function of (seed, index)."""

    notes: tuple[str, ...] = ()

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

    notes: tuple[str, ...] = ()

    def __init__(self, corpus: PackedCorpus | ChatCorpus, batch_size: int, grad_accum: int, tokenizer) -> None:
        self.corpus, self.batch_size, self.grad_accum, self.tokenizer = corpus, batch_size, grad_accum, tokenizer

    def batches(self, step: int) -> list:
        return [self.corpus.batch(self.batch_size) for _ in range(self.grad_accum)]

    STATE_KEY, TASK = "corpus", "text"  # where a checkpoint keeps the position, and the task that writes it

    def state_dict(self) -> dict:
        return {self.STATE_KEY: self.corpus.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.STATE_KEY not in state:
            raise ConfigError(f"the checkpoint holds no {self.TASK}-data position (was it written by a "
                              f"data.task={self.TASK} run?)")
        try:
            self.corpus.load_state_dict(state[self.STATE_KEY])
        except DataError as e:
            raise ConfigError(str(e)) from e


class ChatInputs(TextInputs):
    """Conversations packed whole; the position in them is the state a checkpoint keeps."""

    STATE_KEY, TASK = "chat", "chat"

    def __init__(self, corpus: ChatCorpus, batch_size: int, grad_accum: int, tokenizer) -> None:
        super().__init__(corpus, batch_size, grad_accum, tokenizer)
        self.notes = (corpus.counts.summary(corpus.seq_len),)


def loss_on(cfg: Config) -> str:
    """data.loss_on for this task ("auto": all, or assistant for chat), checked."""
    d = cfg.data
    allowed = LOSS_ON[d.task]
    if d.loss_on == "auto":
        return allowed[0]
    if d.loss_on not in allowed:
        raise ConfigError(f"data.loss_on={d.loss_on!r} with data.task={d.task}: choose auto or "
                          f"{' or '.join(allowed)}")
    return d.loss_on


def text_suffixes(cfg: Config) -> tuple[str, ...]:
    """The suffixes folders and glob patterns take as text: the known ones and data.suffixes (".py", lower case)."""
    extra = []
    for raw in cfg.data.suffixes or ():
        suffix = raw.strip().lower()
        suffix = suffix if suffix.startswith(".") else f".{suffix}"
        if len(suffix) < 2 or any(c in suffix[1:] for c in "./\\*? "):
            raise ConfigError(f"data.suffixes: {raw!r} is not a file suffix; write e.g. data.suffixes=[.py, .rs]")
        extra.append(suffix)
    return tuple(dict.fromkeys((*TEXT_SUFFIXES, *extra)))


def _check_task_keys(cfg: Config) -> None:
    """data.task is one of TASKS, and keys that belong to another task are refused, not silently ignored."""
    d = cfg.data
    if d.task not in TASKS:
        raise ConfigError(f"data.task={d.task!r}: choose passkey, needle (built-in retrieval), text (data.paths) or "
                          "chat (conversations in data.paths)")
    for key, value, default, tasks in (("document_mask", d.document_mask, False, ("text", "chat")),
                                       ("text_field", d.text_field, "text", ("text",)),
                                       ("suffixes", d.suffixes, None, ("text",)),
                                       ("chat_template", d.chat_template, None, ("chat",)),
                                       ("overlong", d.overlong, "drop", ("chat",)),
                                       ("val_paths", d.val_paths, None, ("text", "chat")),
                                       ("val_fraction", d.val_fraction, 0.0, ("text", "chat"))):
        if value != default and d.task not in tasks:
            shown = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(f"data.{key}={shown} needs data.task={' or data.task='.join(tasks)} (data.task is "
                              f"{d.task}); leave it at its default ({default!r})")
    if d.val_paths and d.val_fraction:
        raise ConfigError(f"data.val_paths and data.val_fraction={d.val_fraction:g} both choose held-out data: "
                          "give one of them")
    if d.overlong not in ("drop", "truncate"):
        raise ConfigError(f"data.overlong={d.overlong!r}: choose drop (leave out samples longer than data.seq_len) "
                          "or truncate (keep their first data.seq_len tokens)")


def pin_run_inputs(cfg: Config) -> None:
    """What a new run resolves now, written into cfg so config.json records it and a resume gets the same: its
    hub model, tokenizer and datasets at the commits they resolve to (hub.pin_model_revision,
    hub.pin_dataset_revisions; after the data keys' own checks, so a wrong setting is named before the network
    is asked; only data.task=text and chat read data.paths), and a RoPE scaling factor left null (data.seq_len /
    the original positions): a resume at another data.seq_len keeps the positions the weights were trained at."""
    _check_task_keys(cfg)
    cfg.model.path = pin_model_revision(cfg.model.path)
    cfg.data.tokenizer = pin_model_revision(cfg.data.tokenizer, "data.tokenizer", tokenizer_only=True)
    d = cfg.data
    if d.task in ("text", "chat"):
        d.paths, d.val_paths = pin_dataset_revisions(d.paths), pin_dataset_revisions(d.val_paths, "data.val_paths")
    rope = cfg.model.rope
    if rope.type in SCALINGS and rope.factor is None:
        rope.factor = float(model_config(cfg).rope_parameters["factor"])


def build_inputs(cfg: Config, config) -> SyntheticInputs | TextInputs | ChatInputs:
    """The run's data, checked against the model's config (vocabulary, positions)."""
    d, t = cfg.data, cfg.train
    _check_task_keys(cfg)
    loss = loss_on(cfg)
    if d.needles < 1:
        raise ConfigError(f"data.needles must be >= 1, got {d.needles}")
    if d.needles > 1 and d.task != "needle":
        raise ConfigError(f"data.needles={d.needles} needs data.task=needle (passkey and text have no needles)")
    if d.needles > 1 and d.depth is not None:
        raise ConfigError(f"data.needles={d.needles} spreads its needles over the sequence: leave data.depth null "
                          f"(it is {d.depth})")
    vocab = config.vocab_size
    if d.task in ("text", "chat") and not d.paths:
        what = "text" if d.task == "text" else "conversations (.jsonl, .parquet or save_to_disk folders)"
        raise ConfigError(f"data.task={d.task} needs data.paths: files, folders or glob patterns of {what}")
    if d.task == "text":
        try:  # every file read once: a bad one is named now
            check_sources(find_sources(d.paths, text_suffixes(cfg)), d.text_field)
        except DataError as e:
            raise ConfigError(f"data.paths: {e}") from e
    elif d.paths and d.task != "chat":
        raise ConfigError(f"data.paths is set but data.task={d.task!r} is a built-in task; set data.task=text or chat")
    tokenizer = wanted_tokenizer(cfg)
    if tokenizer is not None:
        try:
            check_tokenizer_fits(tokenizer, vocab, where=tokenizer_source(cfg))
        except DataError as e:
            raise ConfigError(str(e)) from e
    if d.task == "text":
        try:
            corpus = PackedCorpus(d.paths, tokenizer, d.seq_len, text_field=d.text_field, seed=t.seed,
                                  document_mask=d.document_mask, text_suffixes=text_suffixes(cfg),
                                  keep=training_rows(cfg))
            corpus.rows.current()  # the first window: a held-out split that leaves nothing to train is named now
        except DataError as e:
            raise ConfigError(f"data.paths: {e}") from e
        return TextInputs(corpus, t.batch_size, t.grad_accum, tokenizer)
    if d.task == "chat":
        return ChatInputs(_chat_corpus(cfg, tokenizer, loss), t.batch_size, t.grad_accum, tokenizer)
    kind, extra = (NeedleTask, {"needles": d.needles}) if d.task == "needle" else (PasskeyTask, {})
    try:
        task = kind(d.seq_len, digits=d.passkey_digits, depth=d.depth, loss_on=loss, seed=t.seed,
                    avoid_id=padding_id(config), **extra)
    except ValueError as e:
        raise ConfigError(f"data: {e}") from e
    if vocab < task.vocab_size:
        raise ConfigError(f"the model's vocabulary ({vocab}) is smaller than the {d.task} task's ({task.vocab_size})")
    inputs = SyntheticInputs(task, t.batch_size, t.grad_accum, tokenizer)
    inputs.notes = tuple(note for note in (demo_note(cfg),) if note is not None)
    return inputs


def _chat_corpus(cfg: Config, tokenizer, loss: str) -> ChatCorpus:
    """Every conversation read, rendered and checked now; a run with data.chat_template exports that template."""
    d = cfg.data
    try:
        template = read_template(d.chat_template) if d.chat_template is not None else None
        corpus = ChatCorpus(d.paths, tokenizer, d.seq_len, template=template, loss_on=loss, overlong=d.overlong,
                            seed=cfg.train.seed, keep=training_rows(cfg))
    except DataError as e:  # its message names the file and row, or the key to change
        raise ConfigError(str(e)) from e
    if template is not None:
        tokenizer.chat_template = template  # the export's tokenizer then renders conversations as training did
    return corpus
