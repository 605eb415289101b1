"""A needle in a real-text haystack: passkey retrieval with the model's own tokenizer, for pretrained models.

A sample is built from token ids, each piece tokenized on its own, so every position is exact::

    head                     haystack (sentences) ...  needle  ... haystack (cut to fit)     tail
    [chat start] intro       " A quiet ..." " The ..."  " The pass key is 48213. Remember it."  ...  question [chat end]
                                                                               "The pass key is" " 48213"
    |<-- head -->|<-------------- haystack + needle: length - head - tail ------------->|<-- tail -->|
                                                                                             ^^^^^^ answer tokens

- The haystack is text split into sentences (at . ! ? and line breaks), each tokenized with the
  space before it; the needle starts at the sentence boundary nearest to ``depth`` x the haystack's
  tokens (0: right after the intro, 1: right before the question); the last sentence is cut so the
  sample has exactly ``length`` tokens.
- With a chat template (``prompt="chat"``) the intro, haystack and question are the user's message
  and the answer starts the assistant's; otherwise (``"plain"``) they are one text.
- The answer is forced to start with "The pass key is"; the scored tokens are those of the digits
  (as the tokenizer splits "The pass key is 48213", so a merge across the space counts as answer).

Scoring (one chunked forward per sample, ``oomb.engine.chunked_eval``): a sample is right when the
argmax of every answer token is right given the true tokens before it. That is exactly "greedy
decoding after the forced prefix emits the answer's tokens": if every teacher-forced argmax is right,
greedy decoding sees the same prefix at each step and emits the same tokens, and the first wrong
argmax is the first token greedy decoding gets wrong. Each cell also reports the log-probability of
the whole answer, which moves before the greedy accuracy does.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from oomb.engine import chunked_eval
from oomb.engine.loss import IGNORE_INDEX

INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the pass key.")
NEEDLE = " The pass key is {key}. Remember it."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
PROMPTS = ("auto", "chat", "plain")
# Stands for the haystack while the chat template renders the user's message; split out afterwards.
_MARK = "<<<oomb haystack>>>"
# Built-in haystack: sentences generated from these words (no digits, no pass key), written for oomb.
_SUBJECTS = ("The old fisherman", "A young painter", "The baker next door", "My grandmother", "The night train",
             "A small grey cat", "The river", "Our neighbour's dog", "The schoolteacher", "A travelling musician",
             "The lighthouse keeper", "A flock of geese", "The wind from the hills", "The postman", "A tired student",
             "The gardener", "An old sailor", "The little girl", "The mayor", "A stranger in a long coat")
_VERBS = ("walked slowly past", "painted a picture of", "forgot all about", "dreamed of", "sang a song about",
          "looked out over", "waited quietly beside", "told a long story about", "often visited",
          "carefully repaired", "wrote a letter about", "ran happily towards", "never understood",
          "quietly admired", "stopped to look at", "spoke warmly of")
_OBJECTS = ("the harbour wall", "the empty station", "a field of sunflowers", "the stone bridge",
            "the village bakery", "an old wooden boat", "the edge of the forest", "the quiet library",
            "the market square", "a garden full of roses", "the lake behind the church", "the winding road",
            "a house with blue shutters", "the snowy mountains", "the busy kitchen", "the lighthouse")
_TAILS = ("in the early morning", "before the rain came", "after a long winter", "while the bells were ringing",
          "on a cold afternoon", "as the sun went down", "without saying a word", "for no particular reason",
          "with a cup of tea", "under a cloudy sky", "once again", "at the end of the summer")


def builtin_sentences(count: int = 4000, seed: int = 0) -> list[str]:
    """``count`` sentences generated from a small fixed lexicon (deterministic; no digits)."""
    rng = random.Random(seed)
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
            for _ in range(count)]


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: cut after . ! ? followed by white space, and at line breaks; stripped, none empty."""
    return [s for s in (part.strip() for part in re.split(r"(?<=[.!?])\s+|\s*\n\s*", text)) if s]


@dataclass
class NeedleSample:
    input_ids: torch.Tensor  # [length] int64
    answer_positions: torch.Tensor  # [k]: positions whose NEXT token is an answer token
    passkey: str
    needle_start: int  # position of the needle's first token
    needle_depth: float  # haystack tokens before the needle / all haystack tokens


class TextNeedleTask:
    """Passkey samples over a tokenized haystack; sample ``index`` is a pure function of (seed, index).

    ``sentences``: the haystack, in order; samples start at a random sentence and wrap around. ``prompt``:
    chat (the tokenizer's chat template, required), plain, or auto (chat when the tokenizer has a template).
    """

    def __init__(self, tokenizer, sentences: Sequence[str], *, digits: int = 5, seed: int = 0,
                 prompt: str = "auto") -> None:
        if digits < 1:
            raise ValueError(f"passkey digits must be >= 1, got {digits}")
        if prompt not in PROMPTS:
            raise ValueError(f"prompt must be one of {', '.join(PROMPTS)}, got {prompt!r}")
        if not sentences:
            raise ValueError("the haystack holds no text")
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if prompt == "chat" and not has_template:
            raise ValueError("prompt chat needs a tokenizer with a chat template; this one has none (use plain)")
        self.tokenizer, self.digits, self.seed = tokenizer, digits, seed
        self.prompt = prompt if prompt != "auto" else ("chat" if has_template else "plain")
        self._ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        self.head, self.question = self._frame()
        pieces = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
        pieces = [p for p in pieces if p]
        if not pieces:
            raise ValueError("the haystack's sentences tokenize to nothing")
        self.haystack = torch.tensor([t for p in pieces for t in p], dtype=torch.int64)  # one period of the cycle
        self.starts = torch.tensor([0, *torch.tensor([len(p) for p in pieces]).cumsum(0)[:-1].tolist()])
        self.sentences = len(pieces)

    def _frame(self) -> tuple[list[int], list[int]]:
        """The tokens before the haystack (template start, intro) and between it and the answer (question)."""
        if self.prompt == "plain":
            head = self.tokenizer(INTRO)["input_ids"]  # with the tokenizer's BOS where it adds one
            eos = self.tokenizer.eos_token_id
            if eos is not None and head and head[-1] == eos and self._ids(INTRO)[-1:] != [eos]:
                head = head[:-1]  # a tokenizer that appends EOS: the text goes on
            return head, self._ids("\n\n" + QUESTION + "\n")
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": f"{INTRO}{_MARK}\n\n{QUESTION}"}],
                                                  tokenize=False, add_generation_prompt=True)
        if text.count(_MARK) != 1:
            raise ValueError("the tokenizer's chat template does not copy the user's message as it is; use the "
                             "plain prompt")
        before, after = text.split(_MARK)
        return self._ids(before), self._ids(after)  # the template writes its own BOS and special tokens

    def answer(self, passkey: str) -> tuple[list[int], int]:
        """The tail after the question: "The pass key is <passkey>" as ids, and how many of them are the answer.

        The answer's tokens are those the key adds to the prefix (where the tokenizer merges across the
        space, the merged token is part of the answer).
        """
        full = self._ids(f"{ANSWER_PREFIX} {passkey}")
        prefix = self._ids(ANSWER_PREFIX)
        common = 0
        while common < min(len(full), len(prefix)) and full[common] == prefix[common]:
            common += 1
        return full, len(full) - common

    def fixed_tokens(self, passkey: str) -> int:
        """Tokens of a sample that are not haystack: head, needle, question and answer."""
        full, _ = self.answer(passkey)
        return len(self.head) + len(self.needle_ids(passkey)) + len(self.question) + len(full)

    def needle_ids(self, passkey: str) -> list[int]:
        return self._ids(NEEDLE.format(key=passkey))

    def min_length(self, samples: int = 1) -> int:
        """The shortest length samples 0 .. ``samples`` - 1 fit in, with one haystack token (keys tokenize to
        more or fewer tokens)."""
        return max(self.fixed_tokens(self.passkey(i)[0]) for i in range(samples)) + 1

    def passkey(self, index: int) -> tuple[str, torch.Generator]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        first = int(torch.randint(1, 10, (1,), generator=gen))  # no leading zero: a number as people write it
        rest = torch.randint(0, 10, (self.digits - 1,), generator=gen).tolist()
        return "".join(map(str, [first, *rest])), gen

    def sample(self, length: int, depth: float, index: int) -> NeedleSample:
        """Sample ``index`` at ``length`` tokens with the needle at ``depth``."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must lie in [0, 1] (a fraction of the haystack), got {depth}")
        key, gen = self.passkey(index)
        needle = self.needle_ids(key)
        tail, answer_tokens = self.answer(key)
        body = length - self.fixed_tokens(key)
        if body < 1:
            raise ValueError(f"length {length} is too short for the needle prompt with this tokenizer (sample "
                             f"{index} needs >= {self.fixed_tokens(key) + 1} tokens)")
        first = int(torch.randint(self.sentences, (1,), generator=gen))  # where this sample's haystack starts
        period = self.haystack.numel()
        offset = int(self.starts[first])
        rolled = torch.cat([self.haystack[offset:], self.haystack[:offset]])
        text = rolled.repeat(body // period + 1)[:body]
        # The places the needle may go: the sentence starts in this sample's haystack (its end when a whole
        # sentence ends there; never after the cut sentence, which would run into the needle).
        starts = ((self.starts - offset) % period).sort().values
        cuts = torch.cat([starts + k * period for k in range(body // period + 2)])
        cuts = cuts[cuts <= body].double()
        at = int(cuts[torch.argmin((cuts - depth * body).abs())])  # the nearest; on a tie the earlier one
        ids = torch.cat([torch.tensor(self.head), text[:at], torch.tensor(needle), text[at:],
                         torch.tensor(self.question), torch.tensor(tail)]).long()
        assert ids.numel() == length, (ids.numel(), length)
        positions = torch.arange(length - answer_tokens - 1, length - 1)
        return NeedleSample(ids, positions, key, len(self.head) + at, at / body)


Scorer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunked_scorer(model: torch.nn.Module, *, chunk_size: int = 4096, page_size: int = 128,
                   engine: dict | None = None) -> Scorer:
    """(input_ids [B, N], answer_positions [B, k]) -> (argmax right [B, k] bool, log-probability [B, k]),
    through ``chunked_eval`` (the LM head runs on the answer positions only)."""
    device = next(model.parameters()).device

    def score(ids: torch.Tensor, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.full_like(ids, IGNORE_INDEX)
        rows = torch.arange(ids.shape[0])[:, None]
        labels[rows, where + 1] = ids[rows, where + 1]
        out = chunked_eval(model, ids.to(device), labels.to(device), chunk_size=chunk_size, page_size=page_size,
                           **(engine or {}))
        return out.correct.cpu()[rows, where], -out.nll.cpu()[rows, where].double()

    return score


def text_needle_grid(task: TextNeedleTask, score: Scorer, *, lengths: Sequence[int], depths: Sequence[float],
                     samples: int, batch_size: int = 1, on_cell: Callable[[], None] | None = None) -> dict:
    """Greedy accuracy per (length, depth) cell, ``samples`` samples each (the same indices in every cell).

    ``accuracy[i][j]`` is depth ``depths[i]`` at length ``lengths[j]``: the fraction of samples whose
    greedy answer is the passkey. Each cell also holds ``token_accuracy``, ``answer_logprob`` (the mean
    over samples of the answer's summed log-probability), ``answer_mean_nll`` (per answer token) and the
    needle's positions.
    """
    accuracy = [[float("nan")] * len(lengths) for _ in depths]
    cells = []
    for i, depth in enumerate(depths):
        for j, length in enumerate(lengths):
            batch = [task.sample(length, depth, s) for s in range(samples)]
            hits, token_hits, logprobs = [], [], []
            for b0 in range(0, samples, batch_size):
                group = batch[b0 : b0 + batch_size]
                for size in sorted({s.answer_positions.numel() for s in group}):  # keys of more or fewer tokens
                    same = [s for s in group if s.answer_positions.numel() == size]
                    right, logprob = score(torch.stack([s.input_ids for s in same]),
                                           torch.stack([s.answer_positions for s in same]))
                    hits += right.all(dim=1).tolist()
                    token_hits += right.flatten().tolist()
                    logprobs += logprob.sum(dim=1).tolist()
            acc = sum(hits) / samples
            accuracy[i][j] = acc
            tokens = len(token_hits)
            cells.append({"length": length, "depth": depth, "samples": samples, "accuracy": acc,
                          "token_accuracy": sum(token_hits) / tokens, "answer_logprob": sum(logprobs) / samples,
                          "answer_mean_nll": -sum(logprobs) / tokens,
                          "needle_positions": [s.needle_start for s in batch],
                          "needle_depth": sum(s.needle_depth for s in batch) / samples})
            if on_cell is not None:
                on_cell()
    return {"lengths": list(lengths), "depths": list(depths), "samples": samples, "seed": task.seed,
            "digits": task.digits, "prompt": task.prompt, "accuracy": accuracy, "cells": cells,
            "scored_by": "greedy: every answer token the argmax given the true tokens before it"}


def describe_text_task(task: TextNeedleTask, haystack_paths: Sequence[str] | None) -> dict:
    """What results.json says of a text task: the haystack, the tokenizer and the prompt around the haystack."""
    decode = task.tokenizer.decode
    key, _ = task.passkey(0)
    tail, answer_tokens = task.answer(key)
    return {"haystack": list(haystack_paths) if haystack_paths else "built-in generated sentences",
            "haystack_sentences": task.sentences, "tokenizer": type(task.tokenizer).__name__,
            "prompt_frame": {"before_haystack": decode(task.head), "needle": decode(task.needle_ids(key)),
                             "after_haystack": decode(task.question + tail[: len(tail) - answer_tokens]),
                             "answer": decode(tail[len(tail) - answer_tokens :])}}


def haystack_sentences(documents: Iterable[str], tokens_wanted: int, tokenizer) -> list[str]:
    """Sentences of ``documents`` in order until they hold about ``tokens_wanted`` tokens (a long corpus is
    not read whole; a short one is cycled by the task)."""
    out, tokens = [], 0
    for doc in documents:
        sentences = split_sentences(doc)
        for b0 in range(0, len(sentences), 512):  # tokenized in blocks: a book is not tokenized whole
            block = sentences[b0 : b0 + 512]
            for sentence, ids in zip(block, tokenizer([" " + s for s in block], add_special_tokens=False)["input_ids"],
                                     strict=True):
                out.append(sentence)
                tokens += len(ids)
                if tokens >= tokens_wanted:
                    return out
    return out
