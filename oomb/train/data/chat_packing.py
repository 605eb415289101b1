"""Conversations packed whole into training sequences, each its own document, resumable exactly.

Every row is read, rendered and checked once when the corpus is built (``ChatCorpus``): a
bad row stops the run before the model exists, and the samples that cannot train are
counted — with an empty assistant reply ("" or whitespace, and no tool call: dropped), longer than
``seq_len`` (dropped, or cut to ``seq_len`` tokens with ``overlong="truncate"``) or without a token that
carries loss. Training then reads the kept
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

Order: oomb.train.data.windows.RowStream — the sources in a seeded order each epoch, the rows
shuffled within windows, read as they are packed. A sample is never split, so the position
is the stream's; a checkpoint stores it. Rows the check at startup counted out (too long to
keep, nothing to learn) are rendered again when reached and skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from oomb.train.data.chat import ChatTemplate, conversation, empty_reply, open_chat_rows, plain_pair
from oomb.train.data.corpus import DataError, Source, find_sources
from oomb.train.data.packing import IGNORE_INDEX, TextBatch
from oomb.train.data.rows import Row
from oomb.train.data.windows import POSITION_KEYS, WINDOW_CHARS, WINDOW_ROWS, RowStream

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
    empty_reply: int = 0  # dropped: an assistant message whose content is "" or whitespace (chat.empty_reply)

    def summary(self, seq_len: int) -> str:
        dropped = self.too_long + self.no_loss + self.empty_reply
        parts = [f"{self.kept:,} of {self.rows:,} samples kept"]
        if self.truncated:
            parts.append(f"{self.truncated:,} cut to data.seq_len={seq_len:,} tokens (data.overlong=truncate)")
        if dropped:
            why = [f"{self.empty_reply:,} with an empty assistant reply" if self.empty_reply else "",
                   f"{self.too_long:,} longer than data.seq_len={seq_len:,} (data.overlong=drop)" if self.too_long
                   else "", f"{self.no_loss:,} without a token that carries loss" if self.no_loss else ""]
            parts.append(f"{dropped:,} dropped: {', '.join(w for w in why if w)}")
        return "chat data: " + "; ".join(parts)


class ChatCorpus:
    """An endless, seeded stream of packed conversation samples, read as they are needed."""

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
        keep: Callable[[Source, int], bool] | None = None,
        shuffle: bool = True,
        window_rows: int = WINDOW_ROWS,
        window_chars: int = WINDOW_CHARS,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
        self.sources = find_sources(paths, text_suffixes=())  # folders: .jsonl, .parquet, saved datasets
        self.template = ChatTemplate(tokenizer, template)
        self.seq_len, self.loss_on, self.overlong = seq_len, loss_on, overlong
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad = pad if pad is not None else 0  # its label is -100 and it is a document of its own
        self.counts = self._check_rows(keep)
        if self.counts.kept == 0:
            raise DataError(f"no sample can train: {self.counts.summary(seq_len)}")
        self.rows = RowStream(self.sources, open_chat_rows, seed=seed, shuffle=shuffle, keep=keep,
                              window_rows=window_rows, window_chars=window_chars)
        self._tokens: tuple | None = None  # (position) -> ids, labels of the sample there (None: skipped)
        self._quiet_since: int | None = None  # the epoch of the first of the last rows skipped

    # --- checking ---------------------------------------------------------------------------------

    def _check_rows(self, keep) -> ChatCounts:
        """Every row parsed, rendered and classified once, nothing kept: a bad row is named now."""
        counts = dict.fromkeys(("rows", "kept", "truncated", "too_long", "no_loss", "empty_reply"), 0)
        for source in self.sources:
            for row in open_chat_rows(source):
                if keep is not None and not keep(source, row.number):
                    continue
                sample = self._encode(row)
                counts["rows"] += 1
                if isinstance(sample, str):  # why it cannot train
                    counts[sample] += 1
                else:
                    counts["truncated"] += len(sample[0]) < sample[2]
                    counts["kept"] += 1
        return ChatCounts(**counts)

    def _encode(self, row: Row) -> tuple[np.ndarray, np.ndarray, int] | str:
        """The row's ids and labels (cut to seq_len when truncating) and its full length; or why it cannot
        train: "empty_reply", "too_long" or "no_loss" (ChatCounts' fields)."""
        marked = self.loss_on == "assistant"
        if (pair := plain_pair(row.value, row.where)) is not None:  # plain text, as TRL reads it
            if not pair[1].strip():
                return "empty_reply"
            ids, assistant = self.template.encode_plain(*pair, assistant=marked)
        else:
            messages = conversation(row.value, row.where)
            if empty_reply(messages):  # checked before rendering: nothing to learn from, whatever data.loss_on says
                return "empty_reply"
            ids, assistant = self.template.encode(messages, row.where, marked)
        length = len(ids)
        if length > self.seq_len:
            if self.overlong == "drop":
                return "too_long"
            ids, assistant = ids[: self.seq_len], assistant[: self.seq_len]
        labels = ids.copy() if self.loss_on == "all" else np.where(assistant, ids, IGNORE_INDEX)
        labels[:1] = IGNORE_INDEX  # a sample's first token: predicted by nothing of its own
        if not bool((labels != IGNORE_INDEX).any()):
            return "no_loss"
        return ids, labels, length

    # --- position ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The position of the next sample: what a checkpoint stores."""
        return self.rows.state_dict()

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in POSITION_KEYS if k not in state]
        if missing:
            raise DataError(f"the checkpoint's chat-data position lacks {missing} (it has {sorted(state)}): it was "
                            "written by an older oomb, which read data differently; resume it with that version")
        self.rows.load_state_dict(state)
        self._tokens = None

    # --- reading ----------------------------------------------------------------------------------

    def _current(self) -> tuple[np.ndarray, np.ndarray]:
        """Ids and labels of the next sample that trains (rows counted out at startup are passed over)."""
        while True:
            row = self.rows.current()
            key = (self.rows.epoch, self.rows.source, self.rows.window, self.rows.index)
            if self._tokens is None or self._tokens[0] != key:
                sample = self._encode(row)
                self._tokens = (key, None if isinstance(sample, str) else sample[:2])
            if self._tokens[1] is not None:
                self._quiet_since = None
                return self._tokens[1]
            if self._quiet_since is None:
                self._quiet_since = self.rows.epoch
            elif self.rows.epoch >= self._quiet_since + 2:  # a whole epoch without a sample that trains
                raise DataError("no sample can train any more: the data files changed since the run started; keep "
                                "the data files of a run as they are until it ends")
            self.rows.advance()

    def next_sequence(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next ``seq_len`` tokens: ids, labels and document numbers (0, 1, ...; padding the last)."""
        ids: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        docs: list[np.ndarray] = []
        filled = 0
        while filled < self.seq_len:
            sample = self._current()
            if filled + len(sample[0]) > self.seq_len:
                break  # the sample starts the next sequence, whole
            ids.append(sample[0])
            labels.append(sample[1])
            docs.append(np.full(len(sample[0]), len(docs), dtype=np.int64))
            filled += len(sample[0])
            self.rows.advance()
        pad = self.seq_len - filled
        ids.append(np.full(pad, self.pad, dtype=np.int64))
        labels.append(np.full(pad, IGNORE_INDEX, dtype=np.int64))
        docs.append(np.full(pad, len(docs), dtype=np.int64))
        return tuple(torch.from_numpy(np.concatenate(x)) for x in (ids, labels, docs))

    def batch(self, batch_size: int) -> TextBatch:
        """The next ``batch_size`` sequences as a batch (moves the position)."""
        rows = [self.next_sequence() for _ in range(batch_size)]
        return TextBatch(*(torch.stack([r[k] for r in rows]) for k in range(3)))
