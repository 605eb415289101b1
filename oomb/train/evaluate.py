"""`oomb eval`: perplexity by position and retrieval accuracy of a model, saved as JSON and plots.

    load model (HF folder | oomb run/checkpoint | preset)  ->  check every setting
        -> perplexity by position bucket (held-out documents, chunked_eval)
        -> retrieval accuracy over lengths x depths (synthetic task, chunked_eval)
        -> <out>/results.json, perplexity.png, retrieval.png, a table on the terminal

Both evaluations run through ``oomb.engine.chunked_eval``: the forward of the training
step's stage 1 over every chunk, so a model evaluates at the lengths it trains at.
"""

from __future__ import annotations

import datetime
import json
import math
import shlex
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import oomb
from oomb.engine import chunked_eval
from oomb.engine.loss import IGNORE_INDEX
from oomb.sparse import DEFAULT_SCORE, SCORES
from oomb.train.checkpoint import CheckpointError, find_checkpoint, load_weights, write_text_atomic
from oomb.train.checks import check_remote_code
from oomb.train.config import Config, ConfigError, load_config
from oomb.train.data import NeedleTask, PasskeyTask
from oomb.train.presets import build_model, preset_names

# Retrieval samples are sequences number HELD_OUT_STEP * samples + i of the task: a training
# run of fewer than a million steps (or sequences, at batch size 1) never saw them.
HELD_OUT_STEP = 1_000_000


class EvalError(ValueError):
    """A problem with the evaluation's input the user must fix; the message says what."""


# ----------------------------------------------------------------------------- the model
@dataclass
class LoadedModel:
    model: torch.nn.Module
    source: str  # "huggingface", "checkpoint" or "preset"
    name: str  # what the user gave
    tokenizer_dir: Path | None  # where a tokenizer may live (None: none)
    run_config: Config | None  # the training run's config, for a checkpoint


def resolve_device(name: str) -> torch.device:
    from oomb.train.checks import resolve_device as resolve

    try:
        return resolve(name, option="--device")
    except ConfigError as e:
        raise EvalError(str(e)) from e


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def load_eval_model(spec: str, device: torch.device, dtype_name: str = "auto", *,
                    trust_remote_code: bool = False) -> LoadedModel:
    """A model from a Hugging Face folder, an oomb run or checkpoint folder, or a preset name (random init).

    ``dtype_name`` "auto" keeps a checkpoint's training dtype, else bfloat16 on CUDA and float32 on CPU.
    ``trust_remote_code`` (the command line's --trust-remote-code, never a run folder's config.json):
    run Python code shipped in the model folder.
    """
    path = Path(spec)
    if path.exists():
        if not path.is_dir():
            raise EvalError(f"model {spec!r} is a file; give a Hugging Face model folder, an oomb run or "
                            "checkpoint folder, or a preset name")
        try:
            ckpt = find_checkpoint(path)
        except CheckpointError:
            ckpt = None
        if ckpt is not None:
            return _from_checkpoint(spec, ckpt, device, dtype_name, trust_remote_code)
        if (path / "config.json").is_file():
            return _from_huggingface(spec, path, device, _dtype(dtype_name, device), trust_remote_code)
        raise EvalError(f"{path} is neither a Hugging Face model folder (config.json and weights) nor an oomb "
                        "run folder (checkpoints/latest) or checkpoint folder (manifest.json)")
    if spec in preset_names():
        torch.manual_seed(0)
        model = build_model(spec, dtype=_dtype(dtype_name, device), device=device)
        return LoadedModel(model, "preset", spec, None, None)
    raise EvalError(f"model {spec!r}: no such folder, and not a built-in preset ({', '.join(preset_names())})")


def _from_huggingface(spec: str, path: Path, device: torch.device, dtype: torch.dtype,
                      trust_remote_code: bool) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    try:
        check_remote_code(path, trust_remote_code, how="--trust-remote-code")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                     trust_remote_code=trust_remote_code)
    except ConfigError as e:
        raise EvalError(str(e)) from None
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot load a causal LM from {path}: {e}") from e
    return LoadedModel(model.to(device), "huggingface", spec, path, None)


def _from_checkpoint(spec: str, ckpt: Path, device: torch.device, dtype_name: str,
                     trust_remote_code: bool) -> LoadedModel:
    from oomb.train.checks import resolve_dtype
    from oomb.train.model import build
    from oomb.train.rundir import run_dir_of

    config_file = run_dir_of(ckpt) / "config.json"
    if not config_file.is_file():
        raise EvalError(f"checkpoint {ckpt} has no run config at {config_file}: it is needed to build the model")
    try:
        cfg = load_config(config_file)
        cfg.model.trust_remote_code = trust_remote_code  # the command line's, never the run folder's
        if cfg.model.path is not None and not Path(cfg.model.path).is_dir():
            raise EvalError(f"checkpoint {ckpt} was trained from model.path={cfg.model.path!r}, which is not a "
                            "folder any more; its weights are needed to build the model")
        if cfg.model.path is not None:
            check_remote_code(Path(cfg.model.path), trust_remote_code, how="--trust-remote-code")
        dtype = resolve_dtype(cfg.model.dtype, device) if dtype_name == "auto" else _DTYPES[dtype_name]
        model = build(cfg, device, dtype)
        load_weights(ckpt, model)
    except (ConfigError, CheckpointError) as e:
        raise EvalError(f"cannot load checkpoint {ckpt}: {e}") from e
    tokenizer = cfg.data.tokenizer or cfg.model.path  # what the run tokenized with
    tokenizer_dir = Path(tokenizer) if tokenizer is not None else None
    return LoadedModel(model, "checkpoint", spec, tokenizer_dir, cfg)


def _base_config(model: torch.nn.Module):
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return base.config


def rope_is_scaled(config) -> bool:
    """Whether the config sets a RoPE scaling (yarn, linear, dynamic, llama3, ...) for longer contexts."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return False
    # Some models keep one parameter set per layer type: {"full_attention": {...}, ...}.
    sets = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return any(s.get("rope_type", s.get("type", "default")) not in (None, "default") for s in sets)


def check_positions(config, length: int, what: str) -> None:
    """Refuse ``length`` beyond the model's trained positions unless its RoPE is scaled."""
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and length > max_pos and not rope_is_scaled(config):
        raise EvalError(
            f"{what} {length} is longer than the model's max_position_embeddings={max_pos} and its config sets "
            "no RoPE scaling: positions past the trained range are meaningless. Use lengths <= "
            f"{max_pos}, or a model whose config has rope_parameters with a scaling type (e.g. yarn)"
        )


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


def _passkey(seq_len: int, depth: float, seed: int, digits: int) -> PasskeyTask:
    return PasskeyTask(seq_len, digits=digits, depth=depth, seed=seed)


def _needle(seq_len: int, depth: float, seed: int, digits: int) -> NeedleTask:
    return NeedleTask(seq_len, digits=digits, depth=depth, seed=seed)


RETRIEVAL_TASKS: dict[str, RetrievalTaskFactory] = {"passkey": _passkey, "needle": _needle}


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
    ax.set_xticks(range(len(lengths)), [_short(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("depth of the answer")
    for i, row in enumerate(result["accuracy"]):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(f"{title}\n{result['samples']} samples per cell", fontsize=10)
    fig.savefig(path, dpi=120)


def _short(n: int) -> str:
    for unit, size in (("M", 1024**2), ("K", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# ----------------------------------------------------------------------------- `oomb eval`
def add_arguments(parser) -> None:
    """The options of `oomb eval` (every one shows in `oomb eval --help`)."""
    parser.add_argument("model", metavar="MODEL_OR_CHECKPOINT",
                        help="a Hugging Face model folder (local), an oomb run folder (its latest checkpoint) or "
                             "checkpoint folder, or a built-in preset name (random weights, for smoke tests)")
    g = parser.add_argument_group("perplexity by position")
    g.add_argument("--perplexity", nargs="+", metavar="PATH",
                   help="held-out documents (.txt/.md, .jsonl, .parquet files, folders, globs, or a datasets "
                        "save_to_disk folder): run the perplexity-by-position evaluation on them")
    g.add_argument("--ppl-length", type=int, default=4096, metavar="N",
                   help="tokens scored per document: its first N; shorter documents are skipped (default 4096)")
    g.add_argument("--ppl-docs", type=int, default=16, metavar="N",
                   help="at most this many documents (default 16)")
    g.add_argument("--buckets", default="pow2", metavar="pow2|N",
                   help="position buckets: pow2 ([1,2), [2,4), [4,8), ...) or N buckets of equal width "
                        "(default pow2)")
    g.add_argument("--text-field", default="text", metavar="NAME",
                   help="the text field of .jsonl/.parquet/dataset documents (default text)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer folder (default: the model folder's, or a checkpoint's run data.tokenizer or "
                        "model.path; the byte-level tokenizer when there is none)")
    g = parser.add_argument_group("retrieval accuracy")
    g.add_argument("--retrieval", action="store_true",
                   help="run the retrieval evaluation over the grid of --lengths x --depths")
    g.add_argument("--task", default=None, choices=sorted(RETRIEVAL_TASKS),
                   help="the built-in synthetic retrieval task (default: a checkpoint's run task when it is one "
                        "of these, else passkey)")
    g.add_argument("--lengths", default="1k,2k,4k", metavar="L1,L2,...",
                   help="sequence lengths in tokens, k = 1024, M = 1024^2 (default 1k,2k,4k)")
    g.add_argument("--depths", default="0,0.25,0.5,0.75,1", metavar="D1,D2,...",
                   help="where the answer is hidden, as fractions of the sequence (default 0,0.25,0.5,0.75,1)")
    g.add_argument("--samples", type=int, default=4, metavar="N",
                   help="sequences per (length, depth) cell (default 4)")
    g.add_argument("--digits", type=int, default=None, metavar="N",
                   help="answer digits (default: the checkpoint run's data.passkey_digits, else 5)")
    g.add_argument("--seed", type=int, default=None, metavar="N",
                   help="task seed; it also fixes the task's filler vocabulary, so evaluate a checkpoint with "
                        "its run's seed (the default for a checkpoint; 0 otherwise)")
    g = parser.add_argument_group("running")
    g.add_argument("--out", default=None, metavar="DIR",
                   help="output folder for results.json and the plots (default evals/<date-time>); "
                        "a folder that holds files is refused, never overwritten")
    g.add_argument("--chunk-size", type=int, default=4096, metavar="N",
                   help="tokens per chunk (a multiple of --page-size; default 4096)")
    g.add_argument("--page-size", type=int, default=128, metavar="N", help="tokens per K/V page (default 128)")
    g.add_argument("--batch-size", type=int, default=1, metavar="N", help="sequences per forward (default 1)")
    g.add_argument("--page-budget", type=int, default=None, metavar="N",
                   help="page-sparse attention: past pages each query block attends (default: dense, exact)")
    g.add_argument("--select-block", type=int, default=128, metavar="N",
                   help="with --page-budget: queries per selection block (default 128)")
    g.add_argument("--select-score", default=DEFAULT_SCORE, choices=SCORES,
                   help=f"with --page-budget: rank pages by the upper bound over their keys (bound) or by their mean "
                        f"key (mean, the paper's); default {DEFAULT_SCORE}")
    g.add_argument("--offload", action="store_true", help="keep the K/V pages in host memory (docs/offload.md)")
    g.add_argument("--offload-gpu-memory", default="0", metavar="SIZE",
                   help="with --offload: GPU memory for keeping whole layers' pages on the GPU, e.g. 40GiB "
                        "(default 0: two working layers)")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="run Python code shipped in the model folder (auto_map); read that code first. Never "
                        "taken from a run folder's config.json")
    g.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                   help="parameter dtype: auto = a checkpoint's training dtype, else bfloat16 on CUDA, "
                        "float32 on CPU")


def _engine_options(args) -> dict:
    """chunked_eval's keywords for --page-budget/--select-block and --offload/--offload-gpu-memory."""
    from oomb.sparse import PageSelection
    from oomb.train.config import ConfigError
    from oomb.train.memory import parse_bytes

    engine: dict = {}
    if args.page_budget is not None:
        if args.page_budget < 1 or args.select_block < 1:
            raise EvalError("--page-budget and --select-block must be positive")
        engine["selection"] = PageSelection(page_budget=args.page_budget, block=args.select_block,
                                            score=args.select_score)
    try:
        gpu_bytes = parse_bytes(args.offload_gpu_memory)
    except ConfigError as e:
        raise EvalError(f"--offload-gpu-memory: {e}") from e
    if gpu_bytes and not args.offload:
        raise EvalError("--offload-gpu-memory sets what an offloaded store keeps on the GPU: add --offload")
    if args.offload:
        engine.update(offload=True, offload_gpu_bytes=gpu_bytes)
    return engine


def run_eval(args, argv: Sequence[str], console: Console | None = None) -> Path:
    """Check everything, evaluate, write results.json and the plots; returns the output folder."""
    console = console or Console()
    ppl_on, retrieval_on = args.perplexity is not None, args.retrieval
    if not (ppl_on or retrieval_on):
        raise EvalError("nothing to evaluate: give --perplexity PATH... and/or --retrieval")
    for name in ("chunk_size", "page_size", "batch_size", "samples", "ppl_length", "ppl_docs"):
        if getattr(args, name) <= 0:
            raise EvalError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.chunk_size % args.page_size:
        raise EvalError(f"--chunk-size {args.chunk_size} must be a multiple of --page-size {args.page_size}")
    engine = _engine_options(args)
    lengths = parse_lengths(args.lengths) if retrieval_on else []
    depths = parse_depths(args.depths) if retrieval_on else []
    edges = bucket_edges(args.ppl_length, args.buckets) if ppl_on else []
    out = Path(args.out) if args.out else Path("evals") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EvalError(f"--out {out} already holds files; oomb never overwrites results. Choose another --out")
    if ppl_on:
        from oomb.train.corpus import DataError, check_sources, find_sources

        try:
            check_sources(find_sources(args.perplexity), args.text_field)  # every file read once, before the model
        except DataError as e:
            raise EvalError(str(e)) from e

    device = resolve_device(args.device)
    loaded = load_eval_model(args.model, device, args.dtype, trust_remote_code=args.trust_remote_code)
    model = loaded.model
    model_config = _base_config(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    run = loaded.run_config
    seed = args.seed if args.seed is not None else (run.train.seed if run is not None else 0)
    digits = args.digits if args.digits is not None else (run.data.passkey_digits if run is not None else 5)
    for n in lengths:
        check_positions(model_config, n, "retrieval length")
    if ppl_on:
        check_positions(model_config, args.ppl_length, "--ppl-length")
    task_name = args.task or (run.data.task if run is not None and run.data.task in RETRIEVAL_TASKS else "passkey")
    make_task = RETRIEVAL_TASKS[task_name]
    if retrieval_on:
        try:
            task_vocab = max(make_task(n, d, seed, digits).vocab_size for n in lengths for d in depths)
        except ValueError as e:
            raise EvalError(f"--task {task_name}: {e}") from e
        if task_vocab > vocab:
            raise EvalError(f"the {task_name} task needs {task_vocab} token ids but the model's vocabulary has "
                            f"{vocab}")
    tokenizer = None
    if ppl_on:
        from oomb.train.corpus import DataError, check_tokenizer_fits, load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer if args.tokenizer is not None else loaded.tokenizer_dir)
            check_tokenizer_fits(tokenizer, vocab)
        except DataError as e:
            raise EvalError(str(e)) from e

    n_params = sum(p.numel() for p in model.parameters())
    dtype = model.get_input_embeddings().weight.dtype
    console.print(f"[bold]oomb eval[/]: {args.model} ({loaded.source}, {n_params / 1e6:.2f}M params, {dtype}) on "
                  f"{device}; chunk {args.chunk_size}, page {args.page_size}; writing {out}", highlight=False)
    results: dict = {
        "command": "oomb " + shlex.join(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "oomb_version": oomb.__version__,
        "model": {"spec": args.model, "source": loaded.source, "class": type(model).__name__,
                  "parameters": n_params, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
                  "vocab_size": vocab,
                  "max_position_embeddings": getattr(model_config, "max_position_embeddings", None),
                  "rope_scaled": rope_is_scaled(model_config)},
        "settings": {"chunk_size": args.chunk_size, "page_size": args.page_size, "batch_size": args.batch_size,
                     "page_budget": args.page_budget, "select_block": args.select_block if args.page_budget else None,
                     "select_score": args.select_score if args.page_budget else None,
                     "offload": args.offload, "offload_gpu_bytes": engine.get("offload_gpu_bytes", 0)},
    }
    common = dict(batch_size=args.batch_size, chunk_size=args.chunk_size, page_size=args.page_size, engine=engine)
    # The model's last two path parts: a full path makes a title wider than the figure.
    title = f"{'/'.join(Path(args.model).parts[-2:]) or args.model} ({loaded.source})"
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        if ppl_on:
            bar = progress.add_task("perplexity", total=args.ppl_docs)
            t0 = time.perf_counter()
            documents = (tokenizer(text, verbose=False)["input_ids"] for text in
                         _documents(args.perplexity, args.text_field))
            ppl = perplexity_by_position(model, documents, length=args.ppl_length, edges=edges,
                                         max_documents=args.ppl_docs, on_document=lambda: progress.advance(bar),
                                         **common)
            ppl.update(paths=list(args.perplexity), text_field=args.text_field, bucket_spec=args.buckets,
                       tokenizer=type(tokenizer).__name__, seconds=time.perf_counter() - t0)
            results["perplexity"] = ppl
        if retrieval_on:
            bar = progress.add_task(f"retrieval ({task_name})", total=len(lengths) * len(depths))
            t0 = time.perf_counter()
            grid = retrieval_grid(model, make_task, lengths=lengths, depths=depths, samples=args.samples,
                                  seed=seed, digits=digits, on_cell=lambda: progress.advance(bar), **common)
            results["retrieval"] = {"task": task_name, **grid, "seconds": time.perf_counter() - t0}

    out.mkdir(parents=True, exist_ok=True)
    files = ["results.json"]
    if ppl_on:
        plot_perplexity(results["perplexity"], out / "perplexity.png", title)
        files.append("perplexity.png")
    if retrieval_on:
        plot_retrieval(results["retrieval"], out / "retrieval.png", f"{title}: {task_name} accuracy")
        files.append("retrieval.png")
    write_text_atomic(out / "results.json", json.dumps(finite_json(results), indent=2, allow_nan=False) + "\n")
    _print_tables(results, console)
    console.print(f"wrote {', '.join(files)} to {out}", highlight=False)
    return out


def finite_json(value):
    """NaN and infinities as null, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value


def _documents(paths: Sequence[str], text_field: str) -> Iterable[str]:
    from oomb.train.corpus import DataError, iter_documents

    try:
        yield from iter_documents(paths, text_field)
    except DataError as e:
        raise EvalError(str(e)) from e


def _print_tables(results: dict, console: Console) -> None:
    if "perplexity" in results:
        p = results["perplexity"]
        table = Table(title=f"perplexity by position: {p['documents']} documents x {p['length']} tokens")
        for name in ("positions", "tokens", "mean NLL", "perplexity"):
            table.add_column(name, justify="right")
        for r in p["buckets"]:
            table.add_row(f"{r['start']}-{r['end'] - 1}", f"{r['tokens']:,}", f"{r['mean_nll']:.4f}",
                          f"{r['perplexity']:.4g}")
        table.add_row("all", f"{p['tokens']:,}", f"{p['mean_nll']:.4f}", f"{p['perplexity']:.4g}", style="bold")
        console.print(table)
    if "retrieval" in results:
        r = results["retrieval"]
        table = Table(title=f"{r['task']} retrieval accuracy ({r['samples']} samples per cell)")
        table.add_column("depth \\ length", justify="right")
        for n in r["lengths"]:
            table.add_column(_short(n), justify="right")
        for depth, row in zip(r["depths"], r["accuracy"], strict=True):
            table.add_row(f"{depth:g}", *(f"{a:.2f}" for a in row))
        console.print(table)
