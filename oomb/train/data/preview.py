"""`oomb data`: a run's first packed sequence as the model will see it, before any training.

    oomb data CONFIG.yaml [key=value ...]              # the text, the tokens that carry loss in «...»
    oomb data CONFIG.yaml --tokens                     # one line per token: position, id, text, loss, document

The data is read, tokenized, templated and packed by the same code as `oomb train` (the same config,
checks and refusals), and the first sequence of the first step is shown: its documents one after
the other, each token that carries loss (its label is not -100: the loss predicts it) inside «...»
and in green where the terminal has colours. Nothing is written and no model is built: a way to
check a chat template, ``data.loss_on`` or packing before spending a GPU on them (what axolotl's
``preprocess --debug`` shows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console
from rich.markup import escape

from oomb.train.config.checks import check_config
from oomb.train.config.settings import Config
from oomb.train.data.inputs import build_inputs, loss_on, model_config

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Span:
    """Consecutive tokens of one document that all carry loss, or all do not."""

    document: int
    loss: bool
    ids: list[int]


def spans(input_ids: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None) -> list[Span]:
    """A sequence's tokens [N] cut where the document or the loss changes."""
    loss = (labels != IGNORE_INDEX).tolist()
    docs = doc_ids.tolist() if doc_ids is not None else [0] * len(loss)
    out: list[Span] = []
    for token, carries, doc in zip(input_ids.tolist(), loss, docs, strict=True):
        if out and out[-1].document == doc and out[-1].loss == carries:
            out[-1].ids.append(token)
        else:
            out.append(Span(doc, carries, [token]))
    return out


def _text(tokenizer, ids: list[int]) -> str:
    """The tokens' text as the tokenizer decodes it (special tokens kept); ids where there is no tokenizer."""
    if tokenizer is None:
        return " ".join(map(str, ids)) + " "
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def show_first_sequence(cfg: Config, console: Console, *, max_tokens: int = 4096, tokens: bool = False) -> None:
    """Prints the first sequence of the run's first step (its first ``max_tokens`` tokens) and its counts."""
    check_config(cfg)
    inputs = build_inputs(cfg, model_config(cfg))
    for note in inputs.notes:
        console.print(note, highlight=False, soft_wrap=True)
    batch = inputs.batches(0)[0]
    ids, labels = batch.input_ids[0], batch.labels[0]
    docs = batch.doc_ids[0] if batch.doc_ids is not None else None
    n = ids.numel()
    carrying = int((labels != IGNORE_INDEX).sum())
    documents = int(docs.unique().numel()) if docs is not None else 1
    console.print(f"[bold]first sequence of step 1[/]: {n:,} tokens, {carrying:,} carry loss ({carrying / n:.1%}), "
                  f"{documents:,} document{'s' if documents != 1 else ''} ({cfg.data.task} data, data.loss_on="
                  f"{loss_on(cfg)})" + (f"; the first {max_tokens:,} shown" if n > max_tokens else ""),
                  highlight=False, soft_wrap=True)
    shown = slice(0, min(n, max_tokens))
    tokenizer = inputs.tokenizer
    if tokens:
        doc_list = docs.tolist() if docs is not None else [0] * n
        console.print("position  id  token  loss  document", style="dim")
        for i, (t, y) in enumerate(zip(ids[shown].tolist(), labels[shown].tolist(), strict=True)):
            text = repr(_text(tokenizer, [t]).strip() if tokenizer is None else tokenizer.convert_ids_to_tokens(t))
            console.print(f"{i} {t} {escape(text)} {int(y != IGNORE_INDEX)} {doc_list[i]}", highlight=False)
        return
    current = None
    for span in spans(ids[shown], labels[shown], None if docs is None else docs[shown]):
        if span.document != current:
            current = span.document
            console.print(f"\n[dim]--- document {span.document}[/]", highlight=False)
        text = escape(_text(tokenizer, span.ids))
        console.print(f"[bold green]«{text}»[/]" if span.loss else f"[dim]{text}[/]", end="", highlight=False,
                      soft_wrap=True)
    console.print()
