"""Page-sparse attention against dense: learning and gradient quality (two studies).

    python -m benchmarks.studies.sparse_quality --out out/sparse_quality   # the H200 study
    python -m benchmarks.studies.sparse_quality --out /tmp/sq --smoke      # tiny sizes, CPU, seconds

One process, in this order:

1. Learning, dense: a small Llama-architecture model (random init, fixed seed) trained from
   scratch on the passkey task at ``train_len`` tokens with dense attention; saved to
   DIR/dense_model; retrieval accuracy on held-out sequences over a grid of depths.
2. Gradient quality, on that trained model: for each of ``grad_lengths``, the full gradient of
   the same held-out sequences with dense attention and with every page budget x selection
   option; cosine similarity and relative error against dense, all parameters flattened and
   per layer over the attention projections; for the loss on every token and on the answer only.
3. Learning, sparse: the same model, data, steps and schedule with ``page_budget=learn_budget``;
   the same retrieval grid. Both models are evaluated with dense attention and with the
   training budget.

Writes DIR/sparse_quality.json (every number, the command, date, device, settings; rewritten
after each phase, so an interrupted run keeps what it measured) and DIR/sparse_quality.md
(tables ready for docs/sparse.md). A DIR that holds files is refused.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import multiprocessing
import platform
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import oomb
from benchmarks.common import int_list, library_versions
from oomb.engine import chunked_eval
from oomb.sparse import PageSelection
from oomb.train.data.sources import PasskeyTask
from oomb.train.eval.metrics import HELD_OUT_STEP, answer_labels, answers_correct, finite_json
from oomb.train.runfolder.checkpoint import write_text_atomic

# The gradient study's sequences: task sequences number GRAD_STEP * grad_samples + i, apart from
# the training sequences (small numbers) and the retrieval evaluation's (HELD_OUT_STEP * samples + i).
GRAD_STEP = 3 * HELD_OUT_STEP + 7

# Selection options compared at every budget: PageSelection fields beyond the budget.
OPTIONS: dict[str, dict] = {
    # The paper's top-k by mean key: the study's baseline. (The library's default page score is "bound",
    # chosen on this study's results; the tables keep calling this one `default`.)
    "default": {"score": "mean"},
    "sink1": {"sink_pages": 1},
    "local4": {"local_pages": 4},
    "per_head": {"per_head": True},
    "sink1+local4+per_head": {"sink_pages": 1, "local_pages": 4, "per_head": True},
    "bound": {"score": "bound"},  # pages ranked by the upper bound over their keys (per-channel min / max)
    # The same with one page list per chunk instead of per 128 queries: what offload moves least for (docs/offload.md:
    # the default block's quality against this one's decides the default with offload).
    "bound+chunk_block": {"score": "bound", "block": "chunk"},
    # Blocks of 128 that choose among at most 1 or 2 budgets of pages a chunk (PageSelection.chunk_pages: the pages
    # with the best score for any block), so offload moves as little as one list per chunk, or twice that. The first
    # is train.chunk_pages=auto with offload.
    "bound+chunk_pages": {"score": "bound", "chunk_pages_per_budget": 1},
    "bound+chunk_pages2x": {"score": "bound", "chunk_pages_per_budget": 2},
}


@dataclass
class Study:
    """Every setting of the study; ``FULL`` is the H200 run, ``SMOKE`` a CPU run of seconds."""

    # The model: Llama architecture, vocabulary of the passkey task (64 ids), tied embeddings.
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    # Training (both arms): AdamW, linear warmup then cosine to lr * min_lr_ratio, clipping at 1.
    train_len: int
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    loss_on: str  # "all" or "answer" (PasskeyTask)
    learn_budget: int  # the sparse arms' page budget
    # A short-context start shared by both arms (dense; sparse would equal dense at this length):
    # ``pretrain_steps`` steps of ``pretrain_batch`` x ``pretrain_len`` tokens; 0 = both arms from random init.
    pretrain_len: int = 1024
    pretrain_steps: int = 0
    pretrain_batch: int = 1
    pretrain_lr: float = 1e-3
    # Task, pages, chunks.
    digits: int = 5
    chunk_size: int = 4096
    page_size: int = 128
    block: int = 128  # queries per selection block
    seed: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    # Retrieval evaluation: held-out sequences, ``eval_samples`` per depth, at each length.
    eval_lengths: list[int] = field(default_factory=list)  # default: [train_len]
    eval_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    eval_samples: int = 16
    grad_eval_samples: int = 8  # per depth, for the dense-trained model at the gradient lengths
    # Sparse arms: one per selection option (OPTIONS), each from the same start with the same batches.
    learn_options: list[str] = field(default_factory=lambda: ["default"])
    # Gradient study.
    gradient_study: bool = True
    # Before it, the dense-trained model trains on (dense) at ``grad_model_len`` for ``grad_model_steps`` steps of
    # ``grad_model_batch`` sequences, so that it has long-range attention to lose at the longest gradient length
    # (a model trained at 32K only does not retrieve at 128K). 0 steps = the dense arm's model as it is.
    grad_model_len: int = 131072
    grad_model_steps: int = 0
    grad_model_batch: int = 1
    grad_model_lr: float = 2e-4
    grad_lengths: list[int] = field(default_factory=list)
    grad_samples: int = 2  # sequences per gradient (one [B, N] batch)
    budgets: list[int] = field(default_factory=list)
    max_positions: int = 131072
    # Processes that build task batches ahead of the GPU (the task is built token by token in Python:
    # about a millisecond per 1K tokens, which would otherwise stall small steps). 0 = in the main process.
    data_workers: int = 0

    def n_params(self) -> int:
        d = self.hidden // self.heads
        attn = self.hidden * d * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.intermediate + 2 * self.hidden) + self.hidden * (64 + 1)


# Sized for minutes on one H200 (an estimate from FLOP counts, not measured; the report records the
# measured seconds of every phase). Why a shared short-context start: from random init, the answer's
# gradient through attention to the passkey scales with its attention weight, ~1/N, against noise from
# the other N keys of ~1/sqrt(N), so learning to find it needs on the order of N sequences; at 1K
# tokens that is affordable, at 32K it is not. The 32K phase then has to sharpen retrieval 32x
# further out, and that is where the dense and sparse arms differ.
FULL = Study(
    hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768,
    train_len=32768, steps=150, batch_size=2, lr=5e-4, warmup_steps=10, loss_on="answer", learn_budget=64,
    digits=1, pretrain_len=1024, pretrain_steps=2000, pretrain_batch=32, pretrain_lr=1e-3,
    eval_lengths=[32768], eval_samples=32, grad_eval_samples=8,
    grad_lengths=[32768, 131072], grad_samples=2, budgets=[8, 16, 32, 64, 128, 256], data_workers=12,
    grad_model_len=131072, grad_model_steps=60, grad_model_lr=3e-4,
)

# Pages of 16 tokens and chunks of 64 keep every code path (sparse chunks, always-kept pages,
# a budget that covers the whole history) at lengths the CPU runs in seconds.
SMOKE = Study(
    hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
    train_len=512, steps=3, batch_size=1, lr=2e-3, warmup_steps=1, loss_on="all", learn_budget=8,
    pretrain_len=128, pretrain_steps=2, pretrain_batch=2, chunk_size=64, page_size=16, block=16,
    eval_lengths=[512], eval_depths=[0.0, 1.0], eval_samples=2, grad_eval_samples=1,
    grad_lengths=[256, 512], grad_samples=1, budgets=[6, 64], max_positions=4096,
    grad_model_len=512, grad_model_steps=2,
)


# ----------------------------------------------------------------------------- checks
def check_study(s: Study) -> None:
    """Every setting checked before any work; messages say what to change."""
    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "train_len", "steps", "batch_size",
                 "chunk_size", "page_size", "block", "eval_samples", "grad_samples", "learn_budget",
                 "pretrain_len", "pretrain_batch", "grad_eval_samples"):
        if getattr(s, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(s, name)}")
    if s.hidden % s.heads or s.heads % s.kv_heads:
        raise ValueError(f"hidden ({s.hidden}) must be a multiple of heads ({s.heads}), heads of kv_heads "
                         f"({s.kv_heads})")
    d = s.hidden // s.heads
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim = hidden / heads = {d} must be a power of two >= 16 (the Triton kernels')")
    if s.chunk_size % s.page_size:
        raise ValueError(f"chunk_size {s.chunk_size} must be a multiple of page_size {s.page_size}")
    if s.loss_on not in ("all", "answer"):
        raise ValueError(f"loss_on must be 'all' or 'answer', got {s.loss_on!r}")
    if s.grad_model_steps < 0 or s.grad_model_batch <= 0:
        raise ValueError(f"grad_model_steps must be >= 0 and grad_model_batch positive, got {s.grad_model_steps}, "
                         f"{s.grad_model_batch}")
    if s.pretrain_steps < 0:
        raise ValueError(f"pretrain_steps must be >= 0, got {s.pretrain_steps}")
    lengths = [s.train_len, *s.eval_lengths, *s.grad_lengths, s.pretrain_len, s.grad_model_len]
    if max(lengths) > s.max_positions:
        raise ValueError(f"length {max(lengths)} exceeds the model's max_positions {s.max_positions}")
    for n in lengths:
        PasskeyTask(n, digits=s.digits)  # raises on a length too short for the passkey
    if not s.budgets or not s.grad_lengths:
        raise ValueError("give at least one page budget and one gradient length")
    for budget in s.budgets:
        for name in OPTIONS:
            selection(s, budget, name)  # raises when the always-kept pages exceed the budget
    unknown = [o for o in s.learn_options if o not in OPTIONS]
    if unknown or not s.learn_options or len(set(s.learn_options)) < len(s.learn_options):
        raise ValueError(f"learn_options {s.learn_options}: give distinct options among {', '.join(OPTIONS)}")
    for name in s.learn_options:
        selection(s, s.learn_budget, name)  # raises when the always-kept pages exceed the budget
    if s.learn_budget >= past_pages(s.train_len, s):
        raise ValueError(
            f"learn_budget {s.learn_budget} pages covers the {past_pages(s.train_len, s)} past pages of the last "
            f"chunk at train_len {s.train_len}: sparse training would be dense. Use a longer train_len or a "
            "smaller budget"
        )
    if not all(0.0 <= x <= 1.0 for x in s.eval_depths):
        raise ValueError(f"eval_depths must lie in [0, 1], got {s.eval_depths}")


def past_pages(length: int, s: Study) -> int:
    """Pages stored before the last chunk of a ``length``-token sequence: the most any chunk selects from."""
    last_start = (length - 1) // s.chunk_size * s.chunk_size
    return last_start // s.page_size


def selection(s: Study, budget: int, option: str) -> PageSelection:
    fields = {"page_budget": budget, "block": s.block, **OPTIONS[option]}
    if fields["block"] == "chunk":  # one list per chunk
        fields["block"] = s.chunk_size
    if "chunk_pages_per_budget" in fields:
        fields["chunk_pages"] = fields.pop("chunk_pages_per_budget") * budget
    return PageSelection(**fields)


# ----------------------------------------------------------------------------- model and training
def build_model(s: Study, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=64, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=s.max_positions,
        rope_theta=500000.0, rms_norm_eps=1e-5, attention_dropout=0.0, tie_word_embeddings=True,
    )
    torch.manual_seed(s.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model


def pretrain_study(s: Study) -> Study:
    """The shared short-context phase as a study of its own (its own warmup and cosine schedule)."""
    return dataclasses.replace(s, train_len=s.pretrain_len, steps=s.pretrain_steps, batch_size=s.pretrain_batch,
                               lr=s.pretrain_lr, eval_lengths=sorted({s.pretrain_len, s.train_len}))


def grad_model_study(s: Study) -> Study:
    """The dense phase at the gradient study's length before it, as a study of its own (its own schedule)."""
    return dataclasses.replace(s, train_len=s.grad_model_len, steps=s.grad_model_steps, batch_size=s.grad_model_batch,
                               lr=s.grad_model_lr, warmup_steps=min(s.warmup_steps, s.grad_model_steps // 4))


def train_task(s: Study) -> PasskeyTask:
    return PasskeyTask(s.train_len, digits=s.digits, loss_on=s.loss_on, seed=s.seed)


def lr_factor(s: Study, step: int) -> float:
    if step < s.warmup_steps:
        return (step + 1) / (s.warmup_steps + 1)
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps))
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _make_batch(length: int, digits: int, loss_on: str, seed: int, step: int, batch_size: int):
    return PasskeyTask(length, digits=digits, loss_on=loss_on, seed=seed).batch(step, batch_size)


def task_batches(s: Study):
    """The ``s.steps`` training batches in order (batch ``i`` is a pure function of the seed and ``i``), built in
    ``s.data_workers`` processes a window ahead of their use."""
    args = (s.train_len, s.digits, s.loss_on, s.seed)
    if s.data_workers <= 0:
        task = train_task(s)
        yield from (task.batch(step, s.batch_size) for step in range(s.steps))
        return
    window = 4 * s.data_workers
    with ProcessPoolExecutor(s.data_workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = collections.deque()
        for step in range(s.steps):
            pending.append(pool.submit(_make_batch, *args, step, s.batch_size))
            if len(pending) > window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def train(model, s: Study, device: torch.device, policy: PageSelection | None, log=print, batches=None) -> dict:
    """``s.steps`` AdamW steps of chunked_backward on the passkey task; the batches depend only on the step
    (``batches``: the same, built before)."""
    batches = iter(batches if batches is not None else task_batches(s))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(s, step))
    losses, grad_norms = [], []
    _sync(device)
    started = time.perf_counter()
    for step in range(s.steps):
        batch = next(batches)
        loss = oomb.chunked_backward(model, batch.input_ids.to(device), batch.labels.to(device),
                                     chunk_size=s.chunk_size, page_size=s.page_size, selection=policy)
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))  # host sync: the step is done
        if (step + 1) % max(1, s.steps // 10) == 0 or step + 1 == s.steps:
            log(f"  step {step + 1}/{s.steps}: loss {losses[-1]:.4f} ({time.perf_counter() - started:.1f} s)")
    seconds = time.perf_counter() - started
    oomb.release_memory(model)
    return {"losses": losses, "grad_norms": grad_norms, "seconds": seconds, "seconds_per_step": seconds / s.steps,
            "page_budget": None if policy is None else policy.page_budget}


def retrieval(model, s: Study, device: torch.device, policy: PageSelection | None,
              lengths: list[int] | None = None, samples: int | None = None) -> dict:
    """Accuracy (every answer digit right, teacher-forced argmax) per length and depth on held-out sequences."""
    lengths = lengths or s.eval_lengths or [s.train_len]
    samples = samples or s.eval_samples
    cells = []
    _sync(device)
    started = time.perf_counter()
    for length in lengths:
        for depth in s.eval_depths:
            task = PasskeyTask(length, digits=s.digits, depth=depth, seed=s.seed)
            batch = task.batch(HELD_OUT_STEP, samples)
            hits, digit_hits = [], []
            for i in range(samples):  # one sequence per forward: memory of one sequence
                ids, where = batch.input_ids[i : i + 1], batch.answer_positions[i : i + 1]
                out = chunked_eval(model, ids.to(device), answer_labels(ids, where).to(device),
                                   chunk_size=s.chunk_size, page_size=s.page_size, selection=policy)
                hits.append(bool(answers_correct(out.correct, where)[0]))
                digit_hits.append(out.correct.cpu()[0, where[0]].double().mean().item())
            cells.append({"length": length, "depth": depth, "samples": samples,
                          "accuracy": sum(hits) / len(hits), "digit_accuracy": sum(digit_hits) / len(digit_hits)})
    oomb.release_memory(model)
    by_length = {}
    for length in lengths:
        row = [c["accuracy"] for c in cells if c["length"] == length]
        by_length[str(length)] = sum(row) / len(row)
    return {"page_budget": None if policy is None else policy.page_budget, "cells": cells,
            "mean_accuracy_by_length": by_length, "seconds": time.perf_counter() - started}


# ----------------------------------------------------------------------------- gradient quality
_ATTN = re.compile(r"layers\.(\d+)\.self_attn\.")


def gradient(model, ids: torch.Tensor, labels: torch.Tensor, s: Study, policy: PageSelection | None) -> dict:
    model.zero_grad(set_to_none=True)
    oomb.chunked_backward(model, ids, labels, chunk_size=s.chunk_size, page_size=s.page_size, selection=policy)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def compare(got: dict, ref: dict) -> dict:
    """Cosine similarity and relative error ||got - ref|| / ||ref||, in float64: all parameters, and per layer
    over the attention projections (q, k, v, o)."""
    def stats(names):
        a = torch.cat([got[n].double().flatten() for n in names])
        b = torch.cat([ref[n].double().flatten() for n in names])
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        return {"cosine": cos, "rel_err": float((a - b).norm() / b.norm())}

    layers: dict[int, list[str]] = {}
    for n in ref:
        m = _ATTN.search(n)
        if m:
            layers.setdefault(int(m.group(1)), []).append(n)
    return {**stats(list(ref)), "attention_by_layer": [stats(layers[i]) for i in sorted(layers)]}


def gradient_study(model, s: Study, device: torch.device, log=print) -> list[dict]:
    rows = []
    model.train()
    for length in s.grad_lengths:
        task = PasskeyTask(length, digits=s.digits, seed=s.seed)
        batch = task.batch(GRAD_STEP, s.grad_samples)
        ids = batch.input_ids.to(device)
        for loss_on in ("all", "answer"):
            labels = ids if loss_on == "all" else answer_labels(batch.input_ids, batch.answer_positions).to(device)
            _sync(device)
            t0 = time.perf_counter()
            dense = gradient(model, ids, labels, s, None)
            _sync(device)
            dense_s = time.perf_counter() - t0
            for budget in s.budgets:
                for option in OPTIONS:
                    t0 = time.perf_counter()
                    sparse = gradient(model, ids, labels, s, selection(s, budget, option))
                    _sync(device)
                    row = {"length": length, "loss_on": loss_on, "budget": budget, "option": option,
                           "covers_history": budget >= past_pages(length, s), **compare(sparse, dense),
                           "seconds": time.perf_counter() - t0, "dense_seconds": dense_s}
                    rows.append(row)
                    del sparse
            log(f"  {length} tokens, loss on {loss_on}: dense {dense_s:.2f} s; budget {s.budgets[0]} default: "
                f"cosine {next(r for r in rows if r['length'] == length and r['loss_on'] == loss_on)['cosine']:.4f}")
            del dense
            oomb.release_memory(model)
    return rows


# ----------------------------------------------------------------------------- the run
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: timing


def run(s: Study, out: Path, device: torch.device, command: str, log=print) -> dict:
    check_study(s)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report: dict = {
        "bench": "sparse_quality",
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "host": platform.node(),
        "versions": library_versions(),
        "dtype": str(dtype).removeprefix("torch."),
        "settings": dataclasses.asdict(s),
        "options": OPTIONS,
        "model": {"architecture": "llama", "parameters": None},
        "past_pages": {str(n): past_pages(n, s) for n in sorted({s.train_len, *s.grad_lengths})},
    }
    started = time.perf_counter()

    def save() -> None:
        report["seconds"] = time.perf_counter() - started
        write_text_atomic(out / "sparse_quality.json", json.dumps(finite_json(report), indent=2) + "\n")
        write_text_atomic(out / "sparse_quality.md", markdown(report))

    model = build_model(s, device, dtype)
    report["model"]["parameters"] = sum(p.numel() for p in model.parameters())
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}  # both arms start here
    if s.pretrain_steps:
        pre = pretrain_study(s)
        log(f"shared short-context start: {pre.steps} steps x {pre.batch_size} x {pre.train_len} tokens, dense")
        report["pretraining"] = {"training": train(model, pre, device, None, log),
                                 "retrieval_dense_eval": retrieval(model, pre, device, None)}
        log(f"after it: {report['pretraining']['retrieval_dense_eval']['mean_accuracy_by_length']}")
        start = {n: t.detach().clone() for n, t in model.state_dict().items()}
        save()
    batches = list(task_batches(s))  # both arms train on these
    log(f"dense training: {s.steps} steps x {s.batch_size} x {s.train_len} tokens, "
        f"{report['model']['parameters'] / 1e6:.2f}M parameters, {dtype} on {device}")
    report["learning"] = {"dense": {"training": train(model, s, device, None, log, batches)}}
    model.save_pretrained(out / "dense_model")
    learned = report["learning"]["dense"]
    learned["retrieval_dense_eval"] = retrieval(model, s, device, None)
    for option in s.learn_options:  # the dense-trained model read with each sparse arm's selection
        learned[sparse_eval_key(option)] = retrieval(model, s, device, selection(s, s.learn_budget, option))
    log(f"dense model retrieval: {learned['retrieval_dense_eval']['mean_accuracy_by_length']}")
    save()

    if s.gradient_study:
        if s.grad_model_steps:
            gm = grad_model_study(s)
            log(f"before the gradient study, dense at {gm.train_len}: {gm.steps} steps x {gm.batch_size} sequences")
            report["gradient_model"] = {"training": train(model, gm, device, None, log)}
        learned["retrieval_at_grad_lengths"] = retrieval(model, s, device, None, s.grad_lengths, s.grad_eval_samples)
        log(f"at the gradient lengths: {learned['retrieval_at_grad_lengths']['mean_accuracy_by_length']}")
        save()
        log("gradient quality on the dense-trained model")
        report["gradient_quality"] = gradient_study(model, s, device, log)
        save()
    del model

    report["learning"]["points_minus_dense"] = {}
    for option in s.learn_options:
        arm = sparse_arm(option)
        log(f"sparse training (budget {s.learn_budget} pages, selection {option})")
        model = build_model(s, device, dtype)
        model.load_state_dict(start)  # the same weights the dense arm started from
        policy = selection(s, s.learn_budget, option)
        sparse = report["learning"][arm] = {"option": option,
                                            "training": train(model, s, device, policy, log, batches)}
        sparse["retrieval_dense_eval"] = retrieval(model, s, device, None)
        sparse[sparse_eval_key(option)] = retrieval(model, s, device, policy)
        log(f"{arm} model retrieval: {sparse['retrieval_dense_eval']['mean_accuracy_by_length']}")
        report["learning"]["points_minus_dense"][arm] = {
            length: 100 * (sparse["retrieval_dense_eval"]["mean_accuracy_by_length"][length]
                           - learned["retrieval_dense_eval"]["mean_accuracy_by_length"][length])
            for length in learned["retrieval_dense_eval"]["mean_accuracy_by_length"]
        }
        del model
        save()
    return report


def sparse_arm(option: str) -> str:
    """The report's key of the sparse arm trained with selection ``option``."""
    return "sparse" if option == "default" else f"sparse:{option}"


def sparse_eval_key(option: str) -> str:
    """The key of an arm's retrieval evaluated with the learning budget and selection ``option``."""
    return "retrieval_sparse_eval" if option == "default" else f"retrieval_sparse_eval:{option}"



# ----------------------------------------------------------------------------- report
def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown(report: dict) -> str:
    """The tables of docs/sparse.md's "Measured results", from the report (what has been measured so far)."""
    s = report["settings"]
    lines = [
        "# Page-sparse attention: learning and gradient quality",
        "",
        f"`{report['command']}` on {report['device']}, {report['date']}; {report['dtype']}, "
        f"torch {report['versions']['torch']}.",
        f"Model: Llama architecture, {s['layers']} layers, hidden {s['hidden']}, {s['heads']} query / "
        f"{s['kv_heads']} KV heads, {report['model']['parameters'] / 1e6:.2f}M parameters, random init (seed "
        f"{s['seed']}). Passkey task ({s['digits']} digits), pages of {s['page_size']} tokens, chunks of "
        f"{s['chunk_size']}, selection blocks of {s['block']} queries.",
        "",
    ]
    pre = report.get("pretraining")
    if pre:
        acc = ", ".join(f"{_k(int(n))}: {100 * a:.1f}%" for n, a in pre["retrieval_dense_eval"]
                        ["mean_accuracy_by_length"].items())
        lines += [f"Shared start of both arms: {s['pretrain_steps']} dense steps x {s['pretrain_batch']} x "
                  f"{_k(s['pretrain_len'])} tokens from random init (at this length a budget of "
                  f"{s['learn_budget']} pages is dense); retrieval after it, dense evaluation: {acc}.", ""]
    learning = report.get("learning", {})
    if "dense" in learning:
        options = s.get("learn_options", ["default"])
        arms = [("dense", "dense training")] + [
            (sparse_arm(o), f"sparse training (budget {s['learn_budget']}" + ("" if o == "default" else f", `{o}`")
             + ")") for o in options if sparse_arm(o) in learning]
        lines += [
            f"## Learning: {s['steps']} steps x {s['batch_size']} x {_k(s['train_len'])} tokens "
            + ("from the shared start" if pre else "from scratch"),
            "",
            f"AdamW, lr {s['lr']:g} (warmup {s['warmup_steps']}, cosine to {s['min_lr_ratio']:g}x), loss on "
            f"{s['loss_on']} tokens; the same initial weights and batches in both arms. Retrieval: "
            f"{s['eval_samples']} held-out sequences per depth, accuracy = every digit right (teacher-forced argmax).",
            "",
            "| | " + " | ".join(title for _, title in arms) + " |",
            "| --- | " + " | ".join("---:" for _ in arms) + " |",
        ]
        def row(label, values):
            lines.append(f"| {label} | " + " | ".join(values) + " |")

        row("final loss (mean of last 10 steps)",
            [f"{sum(learning[a]['training']['losses'][-10:]) / len(learning[a]['training']['losses'][-10:]):.4f}"
             for a, _ in arms])
        row("seconds per step", [f"{learning[a]['training']['seconds_per_step']:.3f}" for a, _ in arms])
        lengths = list(learning["dense"]["retrieval_dense_eval"]["mean_accuracy_by_length"])

        def accuracy(arm: str, key: str, length: str) -> str:
            cell = learning[arm].get(key)
            return "—" if cell is None else f"{100 * cell['mean_accuracy_by_length'][length]:.1f}%"

        for length in lengths:
            row(f"retrieval at {_k(int(length))}, dense attention",
                [accuracy(a, "retrieval_dense_eval", length) for a, _ in arms])
        for option in options:  # each arm read with the budget, by the selection it was trained with
            for length in lengths:
                row(f"retrieval at {_k(int(length))}, budget {s['learn_budget']}"
                    + ("" if option == "default" else f" `{option}`") + " attention",
                    [accuracy(a, sparse_eval_key(option), length) for a, _ in arms])
        dense_acc = learning["dense"]["retrieval_dense_eval"]["mean_accuracy_by_length"].get(str(s["train_len"]))
        if dense_acc is not None and dense_acc < 0.5:
            lines += ["", f"**Dense training reached {100 * dense_acc:.1f}% at its own length (chance: "
                      f"{100 * 10.0 ** -s['digits']:.3g}%): the model has not learned to retrieve, so the sparse/dense "
                      "comparison says little. Train longer (`--steps`) before reading it.**"]
        for arm, points in learning.get("points_minus_dense", {}).items():
            diffs = ", ".join(f"{_k(int(n))}: {d:+.1f}" for n, d in points.items())
            lines += ["", f"`{arm}` minus dense training, dense evaluation, in points: {diffs}."]
        lines += ["", "Accuracy by depth (dense evaluation):", "",
                  "| length | depth | " + " | ".join(title for _, title in arms) + " |",
                  "| ---: | ---: | " + " | ".join("---:" for _ in arms) + " |"]
        for i, cell in enumerate(learning["dense"]["retrieval_dense_eval"]["cells"]):
            row(f"{_k(cell['length'])} | {cell['depth']:g}",
                [f"{100 * learning[a]['retrieval_dense_eval']['cells'][i]['accuracy']:.1f}%" for a, _ in arms])
        lines.append("")
    rows = report.get("gradient_quality")
    if rows:
        options = list(report["options"])
        at = learning.get("dense", {}).get("retrieval_at_grad_lengths")
        acc = "" if at is None else (
            f" Its retrieval accuracy (dense attention, {s['grad_eval_samples']} held-out sequences per depth): "
            + ", ".join(f"{_k(int(n))} {100 * a:.1f}%" for n, a in at["mean_accuracy_by_length"].items()) + ".")
        lines += [
            "## Gradient quality on the dense-trained model",
            "",
            ("The model of the dense learning arm" + (
                f", then {s['grad_model_steps']} dense steps x {s['grad_model_batch']} x {_k(s['grad_model_len'])} "
                f"tokens (lr {s['grad_model_lr']:g}) so that it has long-range attention at that length"
                if report.get("gradient_model") else "") + f".{acc}"),
            "",
            f"Full gradient of {s['grad_samples']} held-out sequence(s) per length, sparse against dense: cosine "
            "similarity / relative error ||g_sparse - g_dense|| / ||g_dense||, all parameters flattened. Options: "
            + "; ".join(f"`{name}` = {', '.join(f'{k}={v}' for k, v in kw.items()) or 'top-k only'}"
                        for name, kw in report["options"].items())
            + ". `= dense`: the budget covers every past page, so attention is dense.",
            "",
        ]
        for length in s["grad_lengths"]:
            for loss_on in ("all", "answer"):
                block = [r for r in rows if r["length"] == length and r["loss_on"] == loss_on]
                if not block:
                    continue
                lines += [f"### {_k(length)} tokens ({report['past_pages'][str(length)]} past pages in the last "
                          f"chunk), loss on {'every token' if loss_on == 'all' else 'the answer digits only'}",
                          "", "| budget (pages) | " + " | ".join(f"`{o}`" for o in options) + " |",
                          "| ---: | " + " | ".join("---:" for _ in options) + " |"]
                for budget in s["budgets"]:
                    cells = {r["option"]: r for r in block if r["budget"] == budget}
                    mark = " (= dense)" if cells and next(iter(cells.values()))["covers_history"] else ""
                    lines.append(f"| {budget}{mark} | " + " | ".join(
                        f"{cells[o]['cosine']:.4f} / {cells[o]['rel_err']:.3f}" if o in cells else "" for o in options)
                        + " |")
                lines.append("")
        lines += ["Per layer, attention projections (q, k, v, o) only, option `default`: cosine similarity.", "",
                  "| length | loss on | budget | " + " | ".join(f"layer {i}" for i in range(s["layers"])) + " |",
                  "| ---: | --- | ---: | " + " | ".join("---:" for _ in range(s["layers"])) + " |"]
        for r in rows:
            if r["option"] == "default":
                lines.append(f"| {_k(r['length'])} | {r['loss_on']} | {r['budget']} | "
                             + " | ".join(f"{x['cosine']:.4f}" for x in r["attention_by_layer"]) + " |")
        lines.append("")
    return "\n".join(lines)


def _print(report: dict) -> None:
    print(markdown(report))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.sparse_quality", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (refused if it holds files)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds on a CPU): checks the pipeline only")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    p.add_argument("--steps", type=int, default=None, help="training steps of each arm")
    p.add_argument("--train-len", type=int, default=None, help="training sequence length in tokens")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--loss-on", choices=["all", "answer"], default=None, help="training loss on all tokens or "
                   "the answer digits only")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per training step")
    p.add_argument("--digits", type=int, default=None, help="passkey digits")
    p.add_argument("--pretrain-steps", type=int, default=None,
                   help="steps of the shared short-context start (0 = both arms from random init)")
    p.add_argument("--pretrain-len", type=int, default=None, help="sequence length of the shared start")
    p.add_argument("--data-workers", type=int, default=None, help="processes that build task batches ahead")
    p.add_argument("--grad-lengths", type=int_list, default=None, help="gradient study lengths, e.g. 32768,131072")
    p.add_argument("--eval-lengths", type=int_list, default=None, help="retrieval evaluation lengths")
    p.add_argument("--eval-samples", type=int, default=None, help="held-out sequences per depth and length")
    p.add_argument("--learn-options", type=lambda t: [o for o in t.split(",") if o], default=None,
                   help=f"sparse arms, one per selection option ({', '.join(OPTIONS)}); default: default")
    p.add_argument("--grad-model-steps", type=int, default=None,
                   help="dense steps at --grad-model-len before the gradient study (0 = none)")
    p.add_argument("--grad-model-len", type=int, default=None, help="sequence length of those steps")
    p.add_argument("--no-gradient-study", dest="gradient_study", action="store_false", default=None,
                   help="skip the gradient study (the learning arms only)")
    args = p.parse_args(argv)
    study = SMOKE if args.smoke else FULL
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "digits": args.digits,
                 "pretrain_steps": args.pretrain_steps, "pretrain_len": args.pretrain_len,
                 "data_workers": args.data_workers,
                 "train_len": args.train_len, "lr": args.lr, "loss_on": args.loss_on,
                 "grad_lengths": args.grad_lengths, "eval_lengths": args.eval_lengths,
                 "eval_samples": args.eval_samples, "learn_options": args.learn_options,
                 "gradient_study": args.gradient_study, "grad_model_steps": args.grad_model_steps,
                 "grad_model_len": args.grad_model_len}
    study = dataclasses.replace(study, **{k: v for k, v in overrides.items() if v is not None})
    out = Path(args.out)
    try:
        check_study(study)
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              "cpu" if args.device == "auto" else args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device asks for CUDA but no CUDA device is visible; use --device cpu")
    except (ValueError, RuntimeError) as e:
        print(f"python -m benchmarks.studies.sparse_quality: {e}", file=sys.stderr)
        return 2
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"python -m benchmarks.studies.sparse_quality: --out {out} already holds files; choose another folder",
              file=sys.stderr)
        return 2
    if not args.smoke and device.type != "cuda":
        print("note: the full study on a CPU takes many hours; --smoke checks the pipeline in seconds",
              file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    report = run(study, out, device, "python -m benchmarks.studies.sparse_quality " + " ".join(
        sys.argv[1:] if argv is None else argv))
    _print(report)
    print(f"wrote {out / 'sparse_quality.json'} and {out / 'sparse_quality.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
