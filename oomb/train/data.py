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

Token ids: 0 BOS, 1 KEY, 2 END, 3 QUERY, 4..13 the digits 0-9, 14.. filler. Any model
with a vocabulary of at least ``PasskeyTask.vocab_size`` ids can train on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BOS, KEY, END, QUERY = 0, 1, 2, 3
DIGIT0 = 4
FILLER0 = 14


@dataclass
class PasskeyBatch:
    input_ids: torch.Tensor  # [B, N] int64
    labels: torch.Tensor  # [B, N] int64 (aligned with input_ids; -100 = no loss)
    answer_positions: torch.Tensor  # [B, digits]: positions whose NEXT token is an answer digit


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
        self.vocab_size = FILLER0 + filler_tokens
        gen = torch.Generator().manual_seed(seed)
        self.lexicon = [
            torch.randint(FILLER0, self.vocab_size, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen)
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
        seqs, queries = zip(*(self.sequence(step * batch_size + i) for i in range(batch_size)), strict=True)
        input_ids = torch.stack(seqs)
        d = self.digits
        query = torch.tensor(queries)
        answer_positions = query[:, None] + torch.arange(d)[None, :]  # predicting digit j from position q+j
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
    """

    def __init__(self, seq_len: int, *, key_tokens: int = 3, **kwargs) -> None:
        digits = kwargs.get("digits", 5)
        min_len = 2 * digits + 2 * key_tokens + 8
        if seq_len < min_len:
            raise ValueError(f"seq_len={seq_len} is too short for a needle with a {key_tokens}-token key and a "
                             f"{digits}-digit value (need >= {min_len})")
        super().__init__(seq_len, **kwargs)
        self.key_tokens = key_tokens

    def sequence(self, index: int) -> tuple[torch.Tensor, int]:
        """Sequence number ``index`` and the position just before its answer (the END after the question)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        key = torch.randint(FILLER0, self.vocab_size, (self.key_tokens,), generator=gen)
        value = torch.randint(0, 10, (self.digits,), generator=gen) + DIGIT0
        needle = torch.cat([torch.tensor([KEY]), key, torch.tensor([END]), value, torch.tensor([END])])
        question = torch.cat([torch.tensor([QUERY]), key, torch.tensor([END])])
        return self._build(gen, needle, question, value)
