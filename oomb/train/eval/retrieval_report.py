"""The last line of `oomb train` on the passkey and needle tasks: how well the trained model retrieves.

After the last step, the model answers held-out sequences of its own task at data.seq_len, with the
depth setting it trained with: the task's sequences number 1,000,000 x n + i, which no step trains on
(the ones `oomb eval --retrieval` scores). They run through oomb eval's ``retrieval_grid``
(``chunked_eval`` with the run's chunks, pages, page selection and offload), and the result is
printed and written to <out_dir>/retrieval.json::

    passkey retrieval at 256 tokens: 97/100 held-out sequences right (chance 10%)

A sequence counts when the argmax of every answer digit is right (all of them, for several needles).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console

from oomb.train.config.settings import Config
from oomb.train.config.step import step_options
from oomb.train.data.sources import NeedleTask, PasskeyTask, padding_id
from oomb.train.eval.metrics import retrieval_grid
from oomb.train.runfolder.checkpoint import write_text_atomic

REPORT = "retrieval.json"
# train.final_eval_samples=auto: this many, or a tenth of the sequences the run trained on where that is fewer,
# so a short run (a smoke test, a benchmark of a few steps at 128K) does not evaluate for longer than it trained.
AUTO_SAMPLES = 100


def final_eval_samples(cfg: Config, steps_trained: int) -> int:
    """Held-out sequences the end-of-run report scores (0: none, also for data.task text and chat)."""
    if cfg.data.task not in ("passkey", "needle"):
        return 0
    value = cfg.train.final_eval_samples
    if value != "auto":
        return value
    trained = steps_trained * cfg.train.batch_size * cfg.train.grad_accum
    return min(AUTO_SAMPLES, trained // 10)


def _task_factory(cfg: Config, model_config):
    d = cfg.data
    kind, extra = (NeedleTask, {"needles": d.needles}) if d.task == "needle" else (PasskeyTask, {})
    pad = padding_id(model_config)  # the ids kept clear of it, as in training

    def make(seq_len: int, depth, seed: int, digits: int):  # the run's depth setting, random or fixed
        return kind(seq_len, digits=digits, depth=d.depth, seed=seed, avoid_id=pad, **extra)

    return make


def report_retrieval(cfg: Config, model: torch.nn.Module, out: Path, samples: int) -> str:
    """Score ``samples`` held-out sequences, write <out>/retrieval.json, and return the line to print."""
    options = step_options(cfg)
    engine = {"selection": options.selection, "offload": options.offload,
              "offload_gpu_bytes": options.offload_gpu_bytes, "backend": options.backend}
    grid = retrieval_grid(model, _task_factory(cfg, model.config), lengths=[cfg.data.seq_len], depths=[cfg.data.depth],
                          samples=samples, seed=cfg.train.seed, digits=cfg.data.passkey_digits,
                          batch_size=cfg.train.batch_size, chunk_size=options.chunk_size,
                          page_size=options.page_size, engine=engine)
    cell = grid["cells"][0]
    right = round(cell["accuracy"] * samples)
    answers = cfg.data.needles if cfg.data.task == "needle" else 1
    chance = 100 * 10.0 ** -(cfg.data.passkey_digits * answers)
    every = f" (all {answers} answers)" if answers > 1 else ""
    digits = f"; answer digits right: {cell['token_accuracy']:.0%}" if cfg.data.passkey_digits * answers > 1 else ""
    line = (f"{cfg.data.task} retrieval at {cfg.data.seq_len} tokens: {right}/{samples} held-out sequences "
            f"right{every} (chance {chance:.3g}%{digits})")
    write_text_atomic(out / REPORT, json.dumps({"task": cfg.data.task, "line": line, "sequences_right": right,
                                                **cell}, indent=2) + "\n")
    return line


def final_retrieval(cfg: Config, model: torch.nn.Module, out: Path, console: Console) -> str | None:
    """The end of a passkey or needle run: score the held-out sequences, return the line to print last (None for
    other tasks and train.final_eval_samples=0)."""
    samples = final_eval_samples(cfg, cfg.train.steps)
    if not samples:
        return None
    console.print(f"retrieval: scoring {samples} held-out sequences of {cfg.data.seq_len} tokens", highlight=False)
    try:
        return report_retrieval(cfg, model, out, samples)
    except OSError as e:  # retrieval.json could not be written (a full disk): the trained run stands
        console.print(f"warning: could not write {out / REPORT}: {type(e).__name__}: {e}", highlight=False)
        return None
