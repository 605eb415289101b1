"""Packing tokenised documents into fixed-length training sequences, resumable exactly.

Documents are tokenised, each followed by the tokenizer's end-of-text token, and the
resulting stream is cut into sequences of ``seq_len`` tokens; a document longer than
the rest of a sequence continues in the next one::

    stream    [ d0 d0 d0 EOS d1 d1 d1 d1 d1 EOS d2 d2 EOS d3 ... ]
    seq 0     [ d0 d0 d0 EOS d1 d1 ]          doc_ids [0 0 0 0 1 1]
    seq 1     [ d1 d1 d1 EOS d2 d2 ]          doc_ids [0 0 0 0 1 1]

Order: each epoch visits the sources (files, saved datasets) in a permutation drawn
from (seed, epoch), and the documents of each source in a permutation drawn from
(seed, epoch, source number). The position in that order — epoch, source, document,
token offset — is four integers; a checkpoint stores them and ``load_state_dict``
continues with exactly the sequences an uninterrupted run would have read next.

With ``document_mask=True`` each batch carries ``doc_ids`` (int64, non-decreasing along
each row) for attention that stays inside a document, and the label of the first
token of every document after the first is -100: no token is asked to predict the
start of an unrelated document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from oomb.train.corpus import TEXT_SUFFIXES, DataError, find_sources, read_documents

IGNORE_INDEX = -100


@dataclass
class TextBatch:
    input_ids: torch.Tensor  # [B, N] int64
    labels: torch.Tensor  # [B, N] int64, aligned with input_ids (shifted inside the loss); -100 = no loss
    doc_ids: torch.Tensor | None  # [B, N] int64 document number per token (document_mask only)


def _permutation(n: int, *seed: int) -> np.ndarray:
    return np.random.default_rng(list(seed)).permutation(n)


class PackedCorpus:
    """An endless, seeded stream of packed sequences from local documents."""

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
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.sources = find_sources(paths, text_suffixes)  # raises for missing paths before anything is read
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise DataError("the tokenizer has no end-of-text (eos) token, which packing puts between documents; "
                            "use a tokenizer that defines eos_token")
        self.tokenizer, self.seq_len, self.text_field = tokenizer, seq_len, text_field
        self.seed, self.document_mask = seed, document_mask
        self.epoch = self.source = self.document = self.offset = 0
        self._loaded: tuple | None = None  # (epoch, source) -> (docs, order) of the source being read
        self._tokens: tuple | None = None  # (epoch, source, document) -> token ids + EOS

    # --- position -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The position of the next token: what a checkpoint stores."""
        return {"epoch": self.epoch, "source": self.source, "document": self.document, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.source = int(state["epoch"]), int(state["source"])
        self.document, self.offset = int(state["document"]), int(state["offset"])

    # --- reading --------------------------------------------------------------------------------

    def _source_docs(self) -> tuple[Sequence[str], np.ndarray]:
        key = (self.epoch, self.source)
        if self._loaded is None or self._loaded[0] != key:
            order = _permutation(len(self.sources), self.seed, self.epoch)
            docs = read_documents(self.sources[int(order[self.source])], self.text_field)
            self._loaded = (key, docs, _permutation(len(docs), self.seed, self.epoch, self.source))
        return self._loaded[1], self._loaded[2]

    def _document_tokens(self) -> list[int] | None:
        """Token ids (+ EOS) of the current document; None once the current source is exhausted."""
        docs, order = self._source_docs()
        if self.document >= len(docs):
            return None
        key = (self.epoch, self.source, self.document)
        if self._tokens is None or self._tokens[0] != key:
            text = docs[int(order[self.document])]
            # verbose=False: documents longer than the tokenizer's model_max_length are expected here.
            ids = self.tokenizer.encode(text, add_special_tokens=False, verbose=False) if text.strip() else []
            self._tokens = (key, [*ids, self.eos] if ids else [])
        return self._tokens[1]

    def _advance_document(self) -> None:
        self.document, self.offset = self.document + 1, 0

    def next_sequence(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``seq_len`` tokens and their per-row document numbers (0, 1, ...)."""
        ids: list[int] = []
        doc_ids: list[int] = []
        doc = 0
        sources_without_text = 0
        while len(ids) < self.seq_len:
            tokens = self._document_tokens()
            if tokens is None:  # next source; after the last one, the next epoch
                self.source, self.document, self.offset = self.source + 1, 0, 0
                if self.source == len(self.sources):
                    self.epoch, self.source = self.epoch + 1, 0
                sources_without_text += 1
                if sources_without_text > len(self.sources):  # a whole epoch gave no token
                    raise DataError("the data holds no text: every document is empty")
                continue
            take = tokens[self.offset : self.offset + self.seq_len - len(ids)]
            if take:
                sources_without_text = 0
                if ids and self.offset == 0:
                    doc += 1
                ids.extend(take)
                doc_ids.extend([doc] * len(take))
                self.offset += len(take)
            if self.offset >= len(tokens):
                self._advance_document()
        return torch.tensor(ids, dtype=torch.long), torch.tensor(doc_ids, dtype=torch.long)

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
