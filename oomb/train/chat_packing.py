"""Conversations packed whole into training sequences, each its own document, resumable exactly.

Every row is read, rendered and checked once when the corpus is built (``ChatCorpus``): a
bad row stops the run before the model exists, and the samples that cannot train are
counted — longer than ``seq_len`` (dropped, or cut to ``seq_len`` tokens with
``overlong="truncate"``) or without a token that carries loss. Training then reads the kept
samples and packs them whole, never cut across sequences; what is left of a sequence when
the next sample does not fit is padding (label -100, a document of its own)::

    sample    [ a a a a ]  [ b b b b b b ]  [ c c c c c c c ]
    seq 0     [ a a a a b b b b b b _ _ ]   doc_ids [0 0 0 0 1 1 1 1 1 1 2 2]
    seq 1     [ c c c c c c c _ _ _ _ _ ]   doc_ids [0 0 0 0 0 0 0 1 1 1 1 1]
    labels    the assistant tokens (data.loss_on=assistant) or every token (all), except the
              first token of each sample: nothing in the sequence before it may predict it

Positions stay those of the packed sequence: the engine's attention never crosses a document
start, and RoPE depends on the distance between tokens only, so each sample trains as it
would alone at positions 0, 1, ... (docs/design.md, "Packed documents").

Order: each epoch visits the sources in a permutation drawn from (seed, epoch) and the kept
samples of each source in one drawn from (seed, epoch, source). A sample is never split, so
the position is three integers — epoch, source, sample — that a checkpoint stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from oomb.train.chat import ChatTemplate, conversation, read_rows
from oomb.train.corpus import DataError, find_sources
from oomb.train.packing import IGNORE_INDEX, TextBatch

LOSS_ON = ("assistant", "all")
OVERLONG = ("drop", "truncate")


@dataclass(frozen=True)
class ChatCounts:
    """What the check of every row found."""

    rows: int
    kept: int
    truncated: int  # kept, cut to seq_len tokens (overlong="truncate")
    too_long: int  # dropped: longer than seq_len (overlong="drop")
    no_loss: int  # dropped: no token that carries loss (no assistant token with loss_on="assistant")

    def summary(self, seq_len: int) -> str:
        dropped = self.too_long + self.no_loss
        parts = [f"{self.kept:,} of {self.rows:,} samples kept"]
        if self.truncated:
            parts.append(f"{self.truncated:,} cut to data.seq_len={seq_len:,} tokens (data.overlong=truncate)")
        if dropped:
            why = [f"{self.too_long:,} longer than data.seq_len={seq_len:,} (data.overlong=drop)" if self.too_long
                   else "", f"{self.no_loss:,} without a token that carries loss" if self.no_loss else ""]
            parts.append(f"{dropped:,} dropped: {', '.join(w for w in why if w)}")
        return "chat data: " + "; ".join(parts)


def _permutation(n: int, *seed: int) -> np.ndarray:
    return np.random.default_rng(list(seed)).permutation(n)


class ChatCorpus:
    """An endless, seeded stream of packed conversation samples from local files."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer,
        seq_len: int,
        *,
        template: str | None = None,
        loss_on: str = "assistant",
        overlong: str = "drop",
        seed: int = 0,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
        self.sources = find_sources(paths, text_suffixes=())  # folders: .jsonl, .parquet, saved datasets
        self.template = ChatTemplate(tokenizer, template)
        self.seq_len, self.loss_on, self.overlong, self.seed = seq_len, loss_on, overlong, seed
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad = pad if pad is not None else 0  # its label is -100 and it is a document of its own
        self.kept, self.counts = self._check_rows()
        if self.counts.kept == 0:
            raise DataError(f"no sample can train: {self.counts.summary(seq_len)}")
        self.epoch = self.source = self.sample = 0
        self._loaded: tuple | None = None  # (epoch, source) -> the source's rows and its kept rows' order
        self._tokens: tuple | None = None  # (epoch, source, sample) -> ids, labels

    # --- checking ---------------------------------------------------------------------------------

    def _check_rows(self) -> tuple[list[np.ndarray], ChatCounts]:
        """Every row parsed, rendered and classified once; the kept row numbers of each source."""
        kept: list[np.ndarray] = []
        rows = truncated = too_long = no_loss = 0
        for source in self.sources:
            table, good = read_rows(source), []
            for i in range(len(table)):
                sample = self._encode(table, i)
                rows += 1
                if sample is None:
                    too_long += 1
                elif not bool((sample[1] != IGNORE_INDEX).any()):
                    no_loss += 1
                else:
                    truncated += len(sample[0]) < sample[2]
                    good.append(i)
            kept.append(np.asarray(good, dtype=np.int64))
        return kept, ChatCounts(rows, sum(len(k) for k in kept), truncated, too_long, no_loss)

    def _encode(self, table, index: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """Row ``index``'s ids and labels (cut to seq_len when truncating) and its full length; None: too long."""
        where = table.where(index)
        ids, assistant = self.template.encode(conversation(table[index], where), where, self.loss_on == "assistant")
        length = len(ids)
        if length > self.seq_len:
            if self.overlong == "drop":
                return None
            ids, assistant = ids[: self.seq_len], assistant[: self.seq_len]
        labels = ids.copy() if self.loss_on == "all" else np.where(assistant, ids, IGNORE_INDEX)
        labels[:1] = IGNORE_INDEX  # a sample's first token: predicted by nothing of its own
        return ids, labels, length

    # --- position ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The position of the next sample: what a checkpoint stores."""
        return {"epoch": self.epoch, "source": self.source, "sample": self.sample}

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = [k for k in ("epoch", "source", "sample") if k not in state]
        if missing:
            raise DataError(f"the checkpoint's chat-data position lacks {missing} (it has {sorted(state)})")
        self.epoch, self.source, self.sample = int(state["epoch"]), int(state["source"]), int(state["sample"])

    # --- reading ----------------------------------------------------------------------------------

    def _current(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Ids and labels of the sample at the position; None once the current source is exhausted."""
        key = (self.epoch, self.source)
        if self._loaded is None or self._loaded[0] != key:
            number = int(_permutation(len(self.sources), self.seed, self.epoch)[self.source])
            rows = self.kept[number]
            order = rows[_permutation(len(rows), self.seed, self.epoch, self.source)]
            self._loaded = (key, read_rows(self.sources[number]), order)
        _, table, order = self._loaded
        if self.sample >= len(order):
            return None
        key = (self.epoch, self.source, self.sample)
        if self._tokens is None or self._tokens[0] != key:
            sample = self._encode(table, int(order[self.sample]))
            if sample is None:  # kept by the check at startup: only a changed file renders differently
                raise DataError(f"{table.where(int(order[self.sample]))} changed since the run started: keep the "
                                "data files of a run as they are until it ends")
            self._tokens = (key, sample[0], sample[1])
        return self._tokens[1], self._tokens[2]

    def next_sequence(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next ``seq_len`` tokens: ids, labels and document numbers (0, 1, ...; padding the last)."""
        ids: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        docs: list[np.ndarray] = []
        filled = 0
        while filled < self.seq_len:
            sample = self._current()
            if sample is None:  # next source; after the last one, the next epoch (some source has samples)
                self.source, self.sample = self.source + 1, 0
                if self.source == len(self.sources):
                    self.epoch, self.source = self.epoch + 1, 0
                continue
            if filled + len(sample[0]) > self.seq_len:
                break  # the sample starts the next sequence, whole
            ids.append(sample[0])
            labels.append(sample[1])
            docs.append(np.full(len(sample[0]), len(docs), dtype=np.int64))
            filled += len(sample[0])
            self.sample += 1
        pad = self.seq_len - filled
        ids.append(np.full(pad, self.pad, dtype=np.int64))
        labels.append(np.full(pad, IGNORE_INDEX, dtype=np.int64))
        docs.append(np.full(pad, len(docs), dtype=np.int64))
        return tuple(torch.from_numpy(np.concatenate(x)) for x in (ids, labels, docs))

    def batch(self, batch_size: int) -> TextBatch:
        """The next ``batch_size`` sequences as a batch (moves the position)."""
        rows = [self.next_sequence() for _ in range(batch_size)]
        return TextBatch(*(torch.stack([r[k] for r in rows]) for k in range(3)))
