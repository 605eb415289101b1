"""Built-in synthetic long-context tasks: a passkey, or a key/value needle, hidden in filler text.

A sequence (token ids, no tokenizer needed)::

    BOS  filler ... KEY d d d d d END  filler ...  QUERY d d d d d
         |<-- depth * seq_len -->|                       ^ answer: copy the digits

Filler is made of "words": fixed multi-token sequences drawn from a small lexicon,
so a model learns it quickly (the loss falls visibly) while the answer can only be
predicted by attending back to the passkey, thousands of tokens earlier.

The needle task hides a key/value sentence instead and asks for the value of its key::

    BOS  filler ... KEY k k k END v v v v v END  filler ...  QUERY k k k END v v v v v
                    |<- the needle at depth ->|                             ^ answer: the value

With ``needles=M`` (M > 1) the needle task hides M key/value sentences (distinct keys, one
in each of M equal stretches of the filler, at a random place inside it) and ends with M
questions, one per key in a random order; every question's value carries loss, so one
sequence trains M retrievals instead of one::

    BOS  filler KEY k1 END v1 END filler ... KEY kM END vM END filler  QUERY k3 END v3  QUERY k1 END v1 ...

Token ids: 0 BOS, 1 KEY, 2 END, 3 QUERY, 4..13 the digits 0-9, 14.. filler, shifted past the model's
padding id where it falls among them (``avoid_id``): an embedding keeps its padding row at zero, and a
row of zeros at the first position stays zero through every layer, where each RMSNorm's backward
multiplies its gradient by 1 / sqrt(eps) (Gemma-3's pad id is 0: its gradients overflowed to NaN
within eight of its 48 layers, in transformers as in oomb). Any model with a vocabulary of at least
``PasskeyTask.vocab_size`` ids can train on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BOS, KEY, END, QUERY = 0, 1, 2, 3
DIGIT0 = 4
FILLER0 = 14


def padding_id(model_config) -> int | None:
    """The id a model's embedding keeps as padding (its row zero and untrained): what a task's ids keep clear of."""
    return getattr(model_config, "pad_token_id", None)


def first_task_id(task_ids: int, avoid_id: int | None) -> int:
    """The first model id of a task whose own ids are 0 .. ``task_ids`` - 1: 0, or just past ``avoid_id`` (the
    model's padding id) where that falls among them."""
    return avoid_id + 1 if avoid_id is not None and 0 <= avoid_id < task_ids else 0


@dataclass
class PasskeyBatch:
    input_ids: torch.Tensor  # [B, N] int64
    labels: torch.Tensor  # [B, N] int64 (aligned with input_ids; -100 = no loss)
    answer_positions: torch.Tensor  # [B, questions * digits]: positions whose NEXT token is an answer digit
    doc_ids: None = None  # one document per sequence (the field every batch kind has)


class PasskeyTask:
    """Deterministic given (seed, step): a resumed run sees the same batches."""

    def __init__(
        self,
        seq_len: int,
        *,
        digits: int = 5,
        depth: float | None = None,
        filler_tokens: int = 50,
        lexicon_words: int = 24,
        loss_on: str = "all",
        seed: int = 0,
        avoid_id: int | None = None,
    ) -> None:
        if digits < 1:
            raise ValueError(f"passkey digits must be >= 1, got {digits}")
        min_len = 2 * digits + 8
        if seq_len < min_len:
            raise ValueError(f"seq_len={seq_len} is too short for a {digits}-digit passkey (need >= {min_len})")
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must lie in [0, 1] (a fraction of the sequence), got {depth}")
        if loss_on not in ("all", "answer"):
            raise ValueError(f"loss_on must be 'all' or 'answer', got {loss_on!r}")
        self.seq_len, self.digits, self.depth, self.loss_on, self.seed = seq_len, digits, depth, loss_on, seed
        self.task_ids = FILLER0 + filler_tokens  # the task's own ids: 0 .. task_ids - 1
        self.first_id = first_task_id(self.task_ids, avoid_id)  # what they are shifted by in a batch
        self.vocab_size = self.first_id + self.task_ids  # the ids a model needs
        gen = torch.Generator().manual_seed(seed)
        self.lexicon = [
            torch.randint(FILLER0, self.task_ids, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen)
            for _ in range(lexicon_words)
        ]

    def _filler(self, n: int, gen: torch.Generator) -> torch.Tensor:
        out, total = [torch.empty(0, dtype=torch.int64)], 0  # depth 0 or 1: no filler on one side
        while total < n:
            word = self.lexicon[int(torch.randint(len(self.lexicon), (1,), generator=gen))]
            out.append(word)
            total += len(word)
        return torch.cat(out)[:n]

    def sequence(self, index: int) -> tuple[torch.Tensor, int]:
        """Sequence number ``index`` and the position just before its answer (the QUERY token)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        d = self.digits
        passkey = torch.randint(0, 10, (d,), generator=gen) + DIGIT0
        return self._build(gen, torch.cat([torch.tensor([KEY]), passkey, torch.tensor([END])]),
                           torch.tensor([QUERY]), passkey)

    def example(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence number ``index`` and its answer positions [k] (each one's NEXT token is an answer digit)."""
        ids, query = self.sequence(index)
        return ids, query + torch.arange(self.digits)  # predicting digit j from position q+j

    def _build(self, gen: torch.Generator, needle: torch.Tensor, question: torch.Tensor,
               answer: torch.Tensor) -> tuple[torch.Tensor, int]:
        """BOS, filler, the needle at the chosen depth, filler, question, answer (``seq_len`` tokens)."""
        body = self.seq_len - 1 - needle.numel() - question.numel() - answer.numel()
        depth = self.depth if self.depth is not None else float(torch.rand((), generator=gen))
        before = int(round(depth * body))
        ids = torch.cat([
            torch.tensor([BOS]), self._filler(before, gen), needle, self._filler(body - before, gen), question, answer,
        ])
        assert ids.numel() == self.seq_len
        return ids, self.seq_len - answer.numel() - 1

    def batch(self, step: int, batch_size: int) -> PasskeyBatch:
        seqs, positions = zip(*(self.example(step * batch_size + i) for i in range(batch_size)), strict=True)
        input_ids = torch.stack(seqs) + self.first_id
        answer_positions = torch.stack(positions)
        labels = input_ids.clone()
        if self.loss_on == "answer":
            labels.fill_(-100)
            rows = torch.arange(batch_size)[:, None]
            labels[rows, answer_positions + 1] = input_ids[rows, answer_positions + 1]
        return PasskeyBatch(input_ids, labels, answer_positions)


class NeedleTask(PasskeyTask):
    """Needle in a haystack: ``KEY key END value END`` hidden at ``depth``, then ``QUERY key END`` -> value.

    The key is ``key_tokens`` filler-vocabulary tokens and the value ``digits`` digits, both
    random per sequence; answering needs finding the sentence whose key matches the question.

    ``needles=M`` > 1: M such sentences with distinct keys, needle i at a random place in the
    i-th of M equal stretches of the filler (``depth`` must be None), then M questions
    ``QUERY key END value``, each key asked once in a random order. ``answer_positions`` is
    [B, M * digits], the questions' digits in the order they are asked.
    """

    def __init__(self, seq_len: int, *, key_tokens: int = 3, needles: int = 1, **kwargs) -> None:
        digits = kwargs.get("digits", 5)
        if not isinstance(needles, int) or isinstance(needles, bool) or needles < 1:
            raise ValueError(f"needles must be an integer >= 1, got {needles!r}")
        if needles > 1 and kwargs.get("depth") is not None:
            raise ValueError(f"needles={needles} places its needles spread over the sequence: depth must be None "
                             f"(random), got depth={kwargs['depth']}")
        min_len = needles * (2 * digits + 2 * key_tokens + 5) + 3  # one needle: 2*digits + 2*key_tokens + 8
        if seq_len < min_len:
            what = "a needle" if needles == 1 else f"{needles} needles, each"
            raise ValueError(f"seq_len={seq_len} is too short for {what} with a {key_tokens}-token key and a "
                             f"{digits}-digit value (need >= {min_len})")
        super().__init__(seq_len, **kwargs)
        if needles > (self.task_ids - FILLER0) ** key_tokens:
            raise ValueError(f"needles={needles} distinct keys do not exist with {key_tokens}-token keys over "
                             f"{self.task_ids - FILLER0} filler ids")
        self.key_tokens, self.needles = key_tokens, needles

    def sequence(self, index: int) -> tuple[torch.Tensor, int]:
        """Sequence number ``index`` and the position just before its (first) answer (the END after the question)."""
        if self.needles > 1:
            ids, positions = self.example(index)
            return ids, int(positions[0])
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        key = torch.randint(FILLER0, self.task_ids, (self.key_tokens,), generator=gen)
        value = torch.randint(0, 10, (self.digits,), generator=gen) + DIGIT0
        needle = torch.cat([torch.tensor([KEY]), key, torch.tensor([END]), value, torch.tensor([END])])
        question = torch.cat([torch.tensor([QUERY]), key, torch.tensor([END])])
        return self._build(gen, needle, question, value)

    def example(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.needles == 1:
            return super().example(index)  # the single-needle sequence, unchanged
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        m, k, d = self.needles, self.key_tokens, self.digits
        keys, seen = [], set()
        while len(keys) < m:  # distinct keys: each question has exactly one answer
            key = torch.randint(FILLER0, self.task_ids, (k,), generator=gen)
            if tuple(key.tolist()) not in seen:
                seen.add(tuple(key.tolist()))
                keys.append(key)
        values = torch.randint(0, 10, (m, d), generator=gen) + DIGIT0
        order = torch.randperm(m, generator=gen)  # the order of the questions
        body = self.seq_len - 1 - m * (k + d + 3) - m * (k + 2 + d)
        # Needle i at a random point of the i-th of m equal stretches of the filler (non-decreasing cuts).
        cuts = ((torch.arange(m, dtype=torch.float64) + torch.rand(m, generator=gen, dtype=torch.float64))
                * body / m).floor().long().tolist()
        pieces, at = [torch.tensor([BOS])], 0
        for i, cut in enumerate(cuts):
            pieces += [self._filler(cut - at, gen), torch.tensor([KEY]), keys[i], torch.tensor([END]), values[i],
                       torch.tensor([END])]
            at = cut
        pieces.append(self._filler(body - at, gen))
        tail = self.seq_len - m * (k + 2 + d)
        for i in order.tolist():
            pieces += [torch.tensor([QUERY]), keys[i], torch.tensor([END]), values[i]]
        ids = torch.cat(pieces)
        assert ids.numel() == self.seq_len
        # Question j's END sits at tail + j*(k+2+d) + k + 1; it and the next d-1 positions predict the digits.
        starts = tail + torch.arange(m) * (k + 2 + d) + k + 1
        return ids, (starts[:, None] + torch.arange(d)[None, :]).reshape(-1)
