"""The validation loss: held-out sequences, fixed when the run starts, scored forward only by the engine.

Held-out data, by task::

    text, chat      data.val_paths (files, folders, hub splits such as owner/name:validation), or
                    data.val_fraction of data.paths' rows (oomb.train.data.windows.held_out: a hash of
                    the file and row picks them; training never reads them)
    passkey/needle  sequences drawn from indices far past any a run trains on

The first ``train.val_batches`` batches of ``train.batch_size`` sequences of that data,
packed as training packs it (sources and rows in their own order, so the same ones in
every run), are built once; every ``train.val_every`` steps and after the last one the
model scores them with ``oomb.engine.evaluate.chunked_eval`` — the training step's chunks,
store and attention, without a backward — and ``val_loss`` is the mean NLL over their target
tokens, as the training loss is over a step's. The schedule is a function of the step
alone, so a resumed run validates at the same steps, on the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oomb.engine.evaluate import chunked_eval
from oomb.train.config.settings import Config, ConfigError
from oomb.train.config.step import step_options
from oomb.train.data.chat import read_template
from oomb.train.data.chat_packing import ChatCorpus
from oomb.train.data.corpus import DataError, find_sources
from oomb.train.data.inputs import ChatInputs, SyntheticInputs, TextInputs, loss_on, text_suffixes
from oomb.train.data.packing import PackedCorpus
from oomb.train.data.rows import check_sources
from oomb.train.data.windows import held_out
from oomb.train.loop.faults import StepAbandoned

# passkey/needle: held-out sequence i is the task's sequence 2**31 + i, which a run reaches only after
# 2**31 training sequences (torch's CPU generator keeps 32 bits of a seed: 2**32 + i would be sequence i).
SYNTHETIC_OFFSET = 2**31


@dataclass
class Validation:
    """The held-out batches and when to score them."""

    batches: list
    every: int  # train.val_every: 0 = after the last step only
    targets: int  # target tokens over all batches (what the mean is over)
    what: str  # where the batches come from, for the startup line
    notes: tuple[str, ...] = ()  # lines for the startup log: what is validated when, then counts and warnings
    last: tuple[int, float] | None = field(default=None)  # (step, val_loss) of the latest validation

    def due(self, step: int, steps: int) -> bool:
        """Whether to validate after step ``step`` (counted from 1) of ``steps``."""
        return step == steps or (self.every > 0 and step % self.every == 0)

    def run(self, model: torch.nn.Module, device: torch.device, cfg: Config, step: int) -> float:
        """Score the batches with the current weights; remembers and returns the loss."""
        loss = validation_loss(model, self.batches, device, cfg)
        self.last = (step, loss)
        return loss


def validate_if_due(run, step: int, record: dict) -> None:
    """After step ``step`` (from 1): the validation loss into ``record`` when due (``run.validation``).

    A signal during it (StepAbandoned) leaves the record without it; the loop then saves step
    ``step`` and stops, as after any step.
    """
    validation, steps = run.validation, run.cfg.train.steps
    if validation is None or not validation.due(step, steps):
        return
    try:
        record["val_loss"] = validation.run(run.model, run.device, run.cfg, step)
    except StepAbandoned:
        return
    record["val_tokens"] = validation.targets


def validation_loss(model: torch.nn.Module, batches: list, device: torch.device, cfg: Config) -> float:
    """Mean NLL over every target token of ``batches``: the training loss's definition, forward only."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    options = step_options(cfg)  # the training step's chunks, pages, page selection and offload
    for batch in batches:
        doc_ids = batch.doc_ids.to(device) if batch.doc_ids is not None else None
        result = chunked_eval(model, batch.input_ids.to(device), batch.labels.to(device), doc_ids=doc_ids,
                              options=options)
        nll = result.nll[result.has_target]
        total += nll.double().sum().cpu()  # host sync, once per batch
        count += nll.numel()
    return float(total / count)


def wants_validation(cfg: Config) -> bool:
    d = cfg.data
    return cfg.train.val_every > 0 or bool(d.val_paths) or d.val_fraction > 0


def build_validation(cfg: Config, inputs, ctx) -> Validation | None:
    """The run's held-out batches (None without validation); ConfigError for what cannot be built."""
    if not wants_validation(cfg):
        return None
    d, t = cfg.data, cfg.train
    if ctx.torchrun:
        raise ConfigError("the validation loss (train.val_every, data.val_paths, data.val_fraction) runs in one "
                          "process for now: leave those keys out under torchrun, and score checkpoints with "
                          "oomb eval --perplexity")
    if isinstance(inputs, SyntheticInputs):
        task = inputs.task
        batches = [task.batch(SYNTHETIC_OFFSET // t.batch_size + v, t.batch_size) for v in range(t.val_batches)]
        return _validation(cfg, batches, f"unseen {d.task} sequences")
    if not d.val_paths and not d.val_fraction:
        raise ConfigError(f"train.val_every={t.val_every} needs held-out data for data.task={d.task}: set "
                          "data.val_paths (files, folders, or a hub split such as owner/name:validation) or "
                          "data.val_fraction (e.g. 0.01 of data.paths' rows)")
    paths = d.val_paths or d.paths
    what = f"data.val_paths={paths}" if d.val_paths else f"data.val_fraction={d.val_fraction:g} of data.paths"
    keep = None if d.val_paths else (lambda source, number: held_out(source, number, d.val_fraction))
    batches = []
    try:
        corpus = _corpus(cfg, inputs, paths, keep)
        while len(batches) < t.val_batches and corpus.rows.epoch == 0:  # never the same held-out data twice
            batches.append(corpus.batch(t.batch_size))
    except DataError as e:
        raise ConfigError(f"{'data.val_paths' if d.val_paths else 'data.val_fraction'}: {e}") from e
    notes = (f"validation {corpus.counts.summary(d.seq_len)}",) if isinstance(inputs, ChatInputs) else ()
    if len(batches) < t.val_batches:
        notes += (f"note: the held-out data fills {len(batches)} of train.val_batches={t.val_batches} batches; "
                  "validation uses those",)
    return _validation(cfg, batches, what, notes)


def _corpus(cfg: Config, inputs: TextInputs, paths: list[str], keep) -> PackedCorpus | ChatCorpus:
    """The held-out data packed as training packs it: in its own order (seed 0, no shuffle), the same every run."""
    d = cfg.data
    if isinstance(inputs, ChatInputs):
        template = read_template(d.chat_template) if d.chat_template is not None else None
        return ChatCorpus(paths, inputs.tokenizer, d.seq_len, template=template, loss_on=loss_on(cfg),
                          overlong=d.overlong, keep=keep, shuffle=False)
    if d.val_paths:
        check_sources(find_sources(paths, text_suffixes(cfg)), d.text_field)  # a bad file is named now
    return PackedCorpus(paths, inputs.tokenizer, d.seq_len, text_field=d.text_field, document_mask=d.document_mask,
                        text_suffixes=text_suffixes(cfg), keep=keep, shuffle=False)


def _validation(cfg: Config, batches: list, what: str, notes: tuple[str, ...] = ()) -> Validation:
    t = cfg.train
    targets = sum(int((b.labels[:, 1:] != -100).sum()) for b in batches)  # the shifted targets
    if targets == 0:
        raise ConfigError(f"the held-out batches from {what} hold no token that carries loss: give other data")
    when = f"every {t.val_every} steps and after the last" if t.val_every else "after the last step"
    summary = (f"validation: {len(batches)} batch{'es' if len(batches) > 1 else ''} of {t.batch_size} x "
               f"{cfg.data.seq_len:,} tokens ({targets:,} targets) from {what}, {when}")
    return Validation(batches, t.val_every, targets, what, (summary, *notes))
