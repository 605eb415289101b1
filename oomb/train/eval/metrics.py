"""What `oomb eval` measures: perplexity by position bucket and retrieval accuracy over lengths x depths,
through ``oomb.engine.chunked_eval``; and their plots."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from oomb.engine import chunked_eval
from oomb.engine.loss import IGNORE_INDEX
from oomb.train.data.sources import NeedleTask, PasskeyTask, padding_id
from oomb.train.eval.eval_model import EvalError

# Retrieval samples are sequences number HELD_OUT_STEP * samples + i of the task: a training
# run of fewer than a million steps (or sequences, at batch size 1) never saw them.
HELD_OUT_STEP = 1_000_000


# ----------------------------------------------------------------------------- grid specs
def parse_lengths(text: str) -> list[int]:
    """"512,4k,128K,1M" -> [512, 4096, 131072, 1048576] (k = 1024, M = 1024**2)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        scale = {"k": 1024, "m": 1024**2}.get(item[-1:].lower(), 1)
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) * scale < 2:
            raise EvalError(f"bad length {item!r} in {text!r}: use integers >= 2, optionally with k or M "
                            "(e.g. 4k,32k,128k)")
        out.append(int(digits) * scale)
    if len(set(out)) != len(out):
        raise EvalError(f"lengths {text!r} repeat a value")
    return sorted(out)


def parse_depths(text: str) -> list[float]:
    """"0,0.25,0.5,0.75,1" -> fractions of the sequence where the answer is hidden."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        try:
            value = float(item)
        except ValueError:
            raise EvalError(f"bad depth {item!r} in {text!r}: use fractions in [0, 1], e.g. 0,0.5,1") from None
        if not 0.0 <= value <= 1.0:
            raise EvalError(f"depth {value} in {text!r} is outside [0, 1] (a fraction of the sequence)")
        out.append(value)
    if len(set(out)) != len(out):
        raise EvalError(f"depths {text!r} repeat a value")
    return sorted(out)


def bucket_edges(length: int, spec: str) -> list[int]:
    """Edges e_0 < ... < e_k of position buckets [e_i, e_{i+1}) covering positions 1 .. length-1.

    A position is the index of the predicted token in its document (= the tokens of context
    it is predicted from). ``spec``: "pow2" (1, 2, 4, 8, ... then ``length``) or an integer n
    (n buckets of equal width, the last ones one position wider when n does not divide).
    """
    if length < 2:
        raise EvalError(f"a length of {length} has no position to predict (need >= 2)")
    if spec == "pow2":
        edges = [1]
        while edges[-1] * 2 < length:
            edges.append(edges[-1] * 2)
        return [*edges, length]
    if not spec.isdigit() or int(spec) < 1:
        raise EvalError(f"--buckets {spec!r}: use 'pow2' or a positive number of equal buckets")
    n = int(spec)
    if n > length - 1:
        raise EvalError(f"--buckets {n} is more than the {length - 1} predicted positions of length {length}")
    return [1 + i * (length - 1) // n for i in range(n + 1)]


class PositionBuckets:
    """Sums of NLL and token counts per position bucket, accumulated over documents in float64."""

    def __init__(self, edges: Sequence[int]) -> None:
        self.edges = list(edges)
        self.nll_sum = torch.zeros(len(edges) - 1, dtype=torch.float64)
        self.tokens = torch.zeros(len(edges) - 1, dtype=torch.int64)

    def add(self, nll: torch.Tensor) -> None:
        """``nll`` [B, N] as chunked_eval gives it: column t predicts the token at position t + 1; NaN = none."""
        nll = nll.detach().double().cpu()
        positions = torch.arange(1, nll.shape[1] + 1)
        for i, (lo, hi) in enumerate(zip(self.edges[:-1], self.edges[1:], strict=True)):
            block = nll[:, (positions >= lo) & (positions < hi)]
            valid = ~torch.isnan(block)
            self.nll_sum[i] += block[valid].sum()
            self.tokens[i] += int(valid.sum())

    def rows(self) -> list[dict]:
        out = []
        for i, (lo, hi) in enumerate(zip(self.edges[:-1], self.edges[1:], strict=True)):
            n = int(self.tokens[i])
            mean = float(self.nll_sum[i]) / n if n else float("nan")
            out.append({"start": lo, "end": hi, "tokens": n, "mean_nll": mean, "perplexity": _exp(mean)})
        return out

    def overall(self) -> dict:
        n = int(self.tokens.sum())
        mean = float(self.nll_sum.sum()) / n if n else float("nan")
        return {"tokens": n, "mean_nll": mean, "perplexity": _exp(mean)}


def _exp(x: float) -> float:
    return math.exp(x) if x == x and x < 700 else float("inf") if x == x else float("nan")


# ----------------------------------------------------------------------------- perplexity
def perplexity_by_position(
    model: torch.nn.Module,
    documents: Iterable[Sequence[int] | torch.Tensor],
    *,
    length: int,
    edges: Sequence[int],
    max_documents: int,
    batch_size: int = 1,
    chunk_size: int = 4096,
    page_size: int = 128,
    on_document: Callable[[], None] | None = None,
    engine: dict | None = None,
) -> dict:
    """Mean NLL and perplexity per position bucket over the first ``length`` tokens of each document.

    Documents shorter than ``length`` are skipped (counted), so every bucket averages the same
    documents; at most ``max_documents`` are used. ``engine``: more chunked_eval keywords (sparse
    attention, offload).
    """
    device = next(model.parameters()).device
    buckets = PositionBuckets(edges)
    used, skipped, pending = 0, 0, []

    def flush() -> None:
        if pending:
            ids = torch.stack(pending).to(device)
            buckets.add(chunked_eval(model, ids, chunk_size=chunk_size, page_size=page_size, **(engine or {})).nll)
            for _ in pending:
                if on_document is not None:
                    on_document()
            pending.clear()

    for doc in documents:
        if used >= max_documents:
            break
        ids = torch.as_tensor(doc, dtype=torch.int64)
        if ids.numel() < length:
            skipped += 1
            continue
        pending.append(ids[:length])
        used += 1
        if len(pending) == batch_size:
            flush()
    flush()
    if used == 0:
        raise EvalError(f"no document has {length} tokens or more ({skipped} shorter ones skipped): give longer "
                        "documents or a smaller --ppl-length")
    return {"length": length, "documents": used, "skipped_short_documents": skipped,
            **buckets.overall(), "buckets": buckets.rows()}


# ----------------------------------------------------------------------------- retrieval
# A retrieval task: (seq_len, depth, seed, digits) -> an object whose batch(step, batch_size) returns
# input_ids [B, N] and answer_positions [B, k] (positions whose NEXT token is an answer token).
RetrievalTaskFactory = Callable[[int, float, int, int], object]


def _passkey(seq_len: int, depth: float, seed: int, digits: int, avoid_id: int | None = None) -> PasskeyTask:
    return PasskeyTask(seq_len, digits=digits, depth=depth, seed=seed, avoid_id=avoid_id)


def _needle(seq_len: int, depth: float, seed: int, digits: int, avoid_id: int | None = None) -> NeedleTask:
    return NeedleTask(seq_len, digits=digits, depth=depth, seed=seed, avoid_id=avoid_id)


RETRIEVAL_TASKS: dict[str, RetrievalTaskFactory] = {"passkey": _passkey, "needle": _needle}


def retrieval_task(name: str, model_config) -> RetrievalTaskFactory | None:
    """The factory of built-in task ``name`` for a model: its ids kept clear of the model's padding id, as
    `oomb train` keeps them (data.sources.first_task_id); None for a task that is not built in."""
    factory = RETRIEVAL_TASKS.get(name)
    if factory is None:
        return None
    pad = padding_id(model_config)
    return lambda seq_len, depth, seed, digits: factory(seq_len, depth, seed, digits, avoid_id=pad)


def answer_labels(input_ids: torch.Tensor, answer_positions: torch.Tensor) -> torch.Tensor:
    """Labels with a target on the answer tokens only (so the LM head runs on those rows only)."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    rows = torch.arange(input_ids.shape[0])[:, None]
    labels[rows, answer_positions + 1] = input_ids[rows, answer_positions + 1]
    return labels


def answers_correct(correct: torch.Tensor, answer_positions: torch.Tensor) -> torch.Tensor:
    """[B] bool: every answer token predicted right (teacher-forced argmax), from chunked_eval's ``correct``."""
    rows = torch.arange(correct.shape[0], device=correct.device)[:, None]
    return correct[rows, answer_positions.to(correct.device)].all(dim=1)


def retrieval_grid(
    model: torch.nn.Module,
    make_task: RetrievalTaskFactory,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int = 0,
    digits: int = 5,
    batch_size: int = 1,
    chunk_size: int = 4096,
    page_size: int = 128,
    on_cell: Callable[[], None] | None = None,
    engine: dict | None = None,
) -> dict:
    """Accuracy (all answer tokens right) per (length, depth) cell, ``samples`` sequences each.

    ``accuracy[i][j]`` is depth ``depths[i]`` at length ``lengths[j]``. A cell's sequences are the
    task's held-out sequences number HELD_OUT_STEP * samples + s, the same numbers in every
    cell, so cells differ only in length and depth. ``engine``: more chunked_eval keywords (sparse
    attention, offload).
    """
    device = next(model.parameters()).device
    tasks = {(n, d): make_task(n, d, seed, digits) for n in lengths for d in depths}  # raises on bad settings
    cells, accuracy = [], [[float("nan")] * len(lengths) for _ in depths]
    for i, depth in enumerate(depths):
        for j, length in enumerate(lengths):
            batch = tasks[(length, depth)].batch(HELD_OUT_STEP, samples)
            hits, token_hits, answer_nll = [], [], []
            for b0 in range(0, samples, batch_size):
                ids = batch.input_ids[b0 : b0 + batch_size]
                where = batch.answer_positions[b0 : b0 + batch_size]
                out = chunked_eval(model, ids.to(device), answer_labels(ids, where).to(device),
                                   chunk_size=chunk_size, page_size=page_size, **(engine or {}))
                rows = torch.arange(ids.shape[0])[:, None]
                hits.append(answers_correct(out.correct, where).cpu())
                token_hits.append(out.correct.cpu()[rows, where])
                answer_nll.append(out.nll.cpu()[rows, where])
            acc = float(torch.cat(hits).double().mean())
            accuracy[i][j] = acc
            cells.append({"length": length, "depth": depth, "samples": samples, "accuracy": acc,
                          "token_accuracy": float(torch.cat(token_hits).double().mean()),
                          "answer_mean_nll": float(torch.cat(answer_nll).double().mean())})
            if on_cell is not None:
                on_cell()
    return {"lengths": list(lengths), "depths": list(depths), "samples": samples, "seed": seed,
            "digits": digits, "accuracy": accuracy, "cells": cells}


# ----------------------------------------------------------------------------- plots
def plot_perplexity(result: dict, path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    rows = [r for r in result["buckets"] if r["tokens"]]
    ends = [r["end"] - 1 for r in rows]  # the last position of each bucket
    ax.plot(ends, [r["perplexity"] for r in rows], marker="o")
    if ends and ends[-1] / max(1, ends[0]) > 16:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("position in document (last position of each bucket)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{title}\n{result['documents']} documents x {result['length']} tokens; "
                 f"overall perplexity {result['perplexity']:.3g}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)


def plot_retrieval(result: dict, path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    lengths, depths = result["lengths"], result["depths"]
    fig = Figure(figsize=(1.6 + 0.9 * len(lengths), 1.4 + 0.45 * len(depths)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(result["accuracy"], vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [short_length(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("depth of the answer")
    for i, row in enumerate(result["accuracy"]):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(f"{title}\n{result['samples']} samples per cell", fontsize=10)
    fig.savefig(path, dpi=120)


def short_length(n: int) -> str:
    for unit, size in (("M", 1024**2), ("K", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def finite_json(value):
    """NaN and infinities as null, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value


