"""Packing tokenised documents into fixed-length training sequences, resumable exactly.

Documents are tokenised, each followed by the tokenizer's end-of-text token, and the
resulting stream is cut into sequences of ``seq_len`` tokens; a document longer than
the rest of a sequence continues in the next one::

    stream    [ d0 d0 d0 EOS d1 d1 d1 d1 d1 EOS d2 d2 EOS d3 ... ]
    seq 0     [ d0 d0 d0 EOS d1 d1 ]          doc_ids [0 0 0 0 1 1]
    seq 1     [ d1 d1 d1 EOS d2 d2 ]          doc_ids [0 0 0 0 1 1]

Documents come from oomb.train.data.windows.RowStream: sources in a seeded order each epoch,
rows shuffled within windows, nothing read ahead of what is packed. A document is
tokenised a piece (oomb.train.data.rows.PIECE_CHARS characters) at a time, so neither a 50 GB
text file nor a long JSON string is ever held as token ids whole. The position — the
stream's, the piece's start in the document and the tokens of the piece already packed —
is what a checkpoint stores; ``load_state_dict`` continues with exactly the sequences an
uninterrupted run would have read next.

With ``document_mask=True`` each batch carries ``doc_ids`` (int64, non-decreasing along
each row) for attention that stays inside a document, and the label of the first
token of every document after the first is -100: no token is asked to predict the
start of an unrelated document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from oomb.train.data.corpus import TEXT_SUFFIXES, DataError, Source, find_sources
from oomb.train.data.rows import TextFile, open_text_rows, text_of, text_piece
from oomb.train.data.windows import POSITION_KEYS, WINDOW_CHARS, WINDOW_ROWS, RowStream

IGNORE_INDEX = -100


@dataclass
class TextBatch:
    input_ids: torch.Tensor  # [B, N] int64
    labels: torch.Tensor  # [B, N] int64, aligned with input_ids (shifted inside the loss); -100 = no loss
    doc_ids: torch.Tensor | None  # [B, N] int64 document number per token (document_mask only)


class PackedCorpus:
    """An endless, seeded stream of packed sequences from documents read as they are needed."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer,
        seq_len: int,
        *,
        text_field: str = "text",
        seed: int = 0,
        document_mask: bool = False,
        text_suffixes: Sequence[str] = TEXT_SUFFIXES,
        keep: Callable[[Source, int], bool] | None = None,
        shuffle: bool = True,
        window_rows: int = WINDOW_ROWS,
        window_chars: int = WINDOW_CHARS,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.sources = find_sources(paths, text_suffixes)  # raises for missing paths before anything is read
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise DataError("the tokenizer has no end-of-text (eos) token, which packing puts between documents; "
                            "use a tokenizer that defines eos_token")
        self.tokenizer, self.seq_len, self.text_field = tokenizer, seq_len, text_field
        self.document_mask = document_mask
        self.rows = RowStream(self.sources, lambda source, at: open_text_rows(source, text_field, at), seed=seed,
                              shuffle=shuffle, keep=keep, window_rows=window_rows, window_chars=window_chars)
        self.piece = self.offset = 0  # where the current piece starts in the document; its tokens packed
        self._tokens: tuple | None = None  # (position) -> the piece's token ids (+ EOS after the last piece)
        self._quiet_since: int | None = None  # the epoch of the first of the last documents without a token

    # --- position -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The position of the next token: what a checkpoint stores."""
        return {**self.rows.state_dict(), "piece": self.piece, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in (*POSITION_KEYS, "piece", "offset") if k not in state]
        if missing:
            raise DataError(f"the checkpoint's text-data position lacks {missing} (it has {sorted(state)}): it was "
                            "written by an older oomb, which read data differently; resume it with that version")
        self.rows.load_state_dict(state)
        self.piece, self.offset = int(state["piece"]), int(state["offset"])
        self._tokens = None

    # --- reading --------------------------------------------------------------------------------

    def _piece_tokens(self) -> tuple[np.ndarray, bool]:
        """Token ids of the current piece (+ EOS after a document's last), and whether it ends the document."""
        row = self.rows.current()
        key = (self.rows.epoch, self.rows.source, self.rows.window, self.rows.index, self.piece)
        if self._tokens is None or self._tokens[0] != key:
            document = text_of(row, self.text_field)
            text, self._piece_end, last = (document.piece(self.piece) if isinstance(document, TextFile)
                                           else text_piece(document, self.piece))
            if self.piece == 0 and last and (not text or text.isspace()):
                ids = np.empty(0, dtype=np.int64)  # an empty document: no tokens, no EOS
            else:
                # verbose=False: documents longer than the tokenizer's model_max_length are expected here.
                ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False, verbose=False), dtype=np.int64)
                if last:
                    ids = np.append(ids, self.eos)
            self._tokens = (key, ids, last)
        return self._tokens[1], self._tokens[2]

    def next_sequence(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``seq_len`` tokens and their per-row document numbers (0, 1, ...)."""
        ids: list[np.ndarray] = []
        doc_ids: list[np.ndarray] = []
        filled, doc = 0, 0
        while filled < self.seq_len:
            tokens, last = self._piece_tokens()
            if len(tokens):
                self._quiet_since = None
            elif self._quiet_since is None:
                self._quiet_since = self.rows.epoch
            elif self.rows.epoch >= self._quiet_since + 2:  # all of an epoch between: no document has a token
                raise DataError("the data holds no text: every document is empty")
            take = tokens[self.offset : self.offset + self.seq_len - filled]
            if len(take):
                if filled and self.piece == 0 and self.offset == 0:
                    doc += 1
                ids.append(take)
                doc_ids.append(np.full(len(take), doc, dtype=np.int64))
                filled += len(take)
                self.offset += len(take)
            if self.offset < len(tokens):
                continue
            if last:  # the document is done
                self.rows.advance()
                self.piece = 0
            else:
                self.piece = self._piece_end
            self.offset = 0
        return torch.from_numpy(np.concatenate(ids)), torch.from_numpy(np.concatenate(doc_ids))

    def batch(self, batch_size: int) -> TextBatch:
        """The next ``batch_size`` sequences as a batch (moves the position)."""
        rows = [self.next_sequence() for _ in range(batch_size)]
        input_ids = torch.stack([r[0] for r in rows])
        doc_ids = torch.stack([r[1] for r in rows])
        labels = input_ids.clone()
        if not self.document_mask:
            return TextBatch(input_ids, labels, None)
        starts = torch.zeros_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        labels[starts] = IGNORE_INDEX  # the first token of a document is never a target
        return TextBatch(input_ids, labels, doc_ids)
