"""`oomb train` as a user runs it: the settings it picks by itself and the step time it reports.

    python -m benchmarks.train_steps --lengths 65536,131072 --steps 3,2 --out out/train-7b-auto.json

For each length, ``oomb train model.preset=P data.seq_len=N`` (every other key at its default: the
chunk size, the attention cache, fused ops and master weights as its memory plan settles them, AdamW
and its optimizer step included) runs in a process of its own until ``--steps`` steps are logged,
then is killed: a 7B run would otherwise write a ~45 GB checkpoint at its end. The record keeps each
step's seconds and peak GPU memory as `oomb train` reports them in metrics.jsonl (its first step
compiles kernels and grows the allocator's pools), the settings from its config.json and its
startup lines.

``--variant NAME "KEY=VALUE ..."`` (repeatable) runs each length once per variant, its keys added to
the command, in the same invocation and one process each, e.g. bf16 LoRA against QLoRA:

    python -m benchmarks.train_steps --lengths 131072 --steps 3 --out out/train-7b-qlora-vs-lora-128k.json \
        --variant lora "lora.r=16 lora.targets=all-linear" \
        --variant qlora "lora.r=16 lora.targets=all-linear model.quantize=nf4"

Each row then names its variant and the keys it added.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from benchmarks.common import command_line, int_list, machine_description

_PLAN_LINE = re.compile(r"^memory plan: GPU ([\d.,]+) (KiB|MiB|GiB|TiB)", re.MULTILINE)
_UNIT_GIB = {"KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "TiB": 2**10}


def planned_against_measured(log_text: str, metrics: list[dict]) -> dict:
    """The GPU peak `oomb train`'s memory plan predicted (its startup line "memory plan: GPU X of Y") and that over
    the largest peak its steps reported (meant to be within 5%); the same without the plan's CUDA-context allowance
    (``planned_allocated_...``): the steps report ``torch.cuda.max_memory_allocated``, which does not count the
    context, so this is the like-for-like ratio. Empty where the log has no plan."""
    from oomb.planning.plan import CUDA_CONTEXT_BYTES

    found = _PLAN_LINE.search(log_text)
    if found is None:
        return {}
    planned = float(found.group(1).replace(",", "")) * _UNIT_GIB[found.group(2)]
    allocated = planned - CUDA_CONTEXT_BYTES / 2**30
    peaks = [m["peak_gpu_gib"] for m in metrics if m.get("peak_gpu_gib")]
    # What the card held: the allocator's reserved peak and what lies outside it (the context). An upper bound of the
    # need, not the plan's quantity: the allocator keeps freed blocks until memory runs short.
    held = [m["peak_gpu_reserved_gib"] + m["gpu_outside_allocator_gib"] for m in metrics
            if m.get("peak_gpu_reserved_gib") and m.get("gpu_outside_allocator_gib") is not None]
    return {"planned_gpu_gib": round(planned, 2),
            "planned_over_measured_peak": round(planned / max(peaks), 4) if peaks else None,
            "planned_allocated_gib": round(allocated, 2),
            "planned_allocated_over_measured_peak": round(allocated / max(peaks), 4) if peaks else None,
            "measured_card_gib": round(max(held), 2) if held else None,
            "planned_over_measured_card": round(planned / max(held), 4) if held else None}


def longest_planned(preset: str, keys: str) -> int | None:
    """The longest data.seq_len `oomb plan` says fits this machine with these keys (its JSON), None where the plan
    cannot say."""
    proc = subprocess.run([sys.executable, "-m", "oomb.cli", "plan", f"model.preset={preset}", *shlex.split(keys),
                           "--json"], capture_output=True, text=True)
    try:
        return int(json.loads(proc.stdout)["largest_seq_len"]) or None
    except (ValueError, KeyError, TypeError):
        return None


def record_of(run: Path, log: Path, seq_len: int) -> dict:
    """One length's entry from a run folder (metrics.jsonl, config.json) and its console log (the LoRA rank and
    model.quantize of the run too: what a variant changed)."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = json.loads((run / "config.json").read_text())
    warm = [m["seconds"] for m in metrics[1:]]
    return {
        "seq_len": seq_len,
        "chunk_size": cfg["train"]["chunk_size"],
        "batch_size": cfg["train"].get("batch_size", 1),  # sequences of seq_len tokens a step (times grad_accum)
        "grad_accum": cfg["train"].get("grad_accum", 1),
        "cache_attention": cfg["train"]["cache_attention"],
        "master_weights": cfg["train"]["master_weights"],
        "recompute": cfg["train"].get("recompute"),
        "attention": cfg["train"].get("attention"),  # the key's value; the startup line names the kernels it chose
        "lora_r": cfg.get("lora", {}).get("r"),
        "quantize": cfg.get("model", {}).get("quantize", "none"),
        "steps": [{k: m.get(k) for k in ("step", "seconds", "loss", "peak_gpu_gib", "peak_gpu_reserved_gib",
                                          "gpu_outside_allocator_gib")} for m in metrics],
        "warm_step_s": sum(warm) / len(warm) if warm else None,  # the steps after the first
        "startup": [line for line in log.read_text().splitlines()
                    if line.startswith(("oomb train", "note:", "fused", "weight gradients", "memory plan:"))
                    or "chosen by the memory plan" in line],
        **planned_against_measured(log.read_text(), metrics),
    }


def partial_step(lines: list[dict]) -> dict:
    """How far the first step of a run's chunks.jsonl got (`train.log_chunks`: each chunk's start, after a sync) and
    its time predicted from its measured chunks.

    Stage 1's chunks are timed by the starts that follow them; a stage-2 chunk by the next start. Stage 2 runs the
    newest chunk first, and a chunk's stage-2 time (recompute, backward) scales with its stage-1 time (both grow
    with the past it attends): their ratio over the stage-2 chunks that finished, times every chunk's stage-1 time
    (the last chunk's, which stage 1 skips with whole-chunk recompute, extrapolated from the two before it), is the
    stage-2 estimate; the step's is stage 1 measured plus that. The peak is the process's GPU peak at the last
    start: a step that finished a stage-2 chunk held its first chunk's backward, where the step peaks."""
    first = [line for line in lines if line["step"] == lines[0]["step"] and line["batch"] == 1]
    fill = [line for line in first if line["stage"] == "fill"]
    back = [line for line in first if line["stage"] == "backward"]
    n_fill = fill[0]["of"] if fill else 0
    n_back = back[0]["of"] if back else None
    out = {"fill_chunks_started": len(fill), "fill_chunks": n_fill, "backward_chunks_started": len(back),
           "backward_chunks": n_back, "seconds_reached": first[-1]["seconds"] if first else None,
           "peak_gpu_gib": max((line.get("peak_gpu_gib") or 0.0 for line in first), default=None) or None}
    if not back or len(fill) < n_fill:
        return {**out, "stage1_s": None, "predicted_step_s": None}
    stage1 = back[0]["seconds"]
    fill_starts, back_starts = [line["seconds"] for line in fill] + [stage1], [line["seconds"] for line in back]
    fill_t = [b - a for a, b in pairwise(fill_starts)]  # each chunk: until the next one starts
    back_t = [b - a for a, b in pairwise(back_starts)]
    if fill_t and n_fill < n_back:  # whole-chunk recompute: stage 1 skipped the newest chunk
        fill_t.append(max(fill_t[-1], 2 * fill_t[-1] - fill_t[-2]) if len(fill_t) > 1 else fill_t[-1])
    if not back_t or len(fill_t) != n_back:
        return {**out, "stage1_s": stage1, "predicted_step_s": None}
    ratio = sum(back_t) / sum(fill_t[n_back - 1 - i] for i in range(len(back_t)))  # newest first
    return {**out, "stage1_s": stage1, "backward_chunk_s": back_t, "stage2_over_stage1": ratio,
            "predicted_step_s": stage1 + ratio * sum(fill_t)}


def run_length(preset: str, seq_len: int, steps: int, folder: Path, timeout: float,
               variant: tuple[str, str] | None = None, keys_of_all: str = "", log_chunks: bool = False) -> dict:
    """One `oomb train` process at ``seq_len``; ``variant``: (name, "KEY=VALUE ...") added to its command, after
    ``keys_of_all`` (--keys: every run's). ``log_chunks``: with train.log_chunks, so a step the timeout cuts short
    still says how far it got (``partial_step``)."""
    name, keys = variant if variant is not None else ("", "")
    run, log = folder / f"run{name}{seq_len}", folder / f"run{name}{seq_len}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "oomb.cli", "train", f"model.preset={preset}",
                                 f"data.seq_len={seq_len}", "train.steps=1000", "train.export=false",
                                 f"out_dir={run}", *shlex.split(keys_of_all), *shlex.split(keys),
                                 *(["train.log_chunks=true"] if log_chunks else [])],
                                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        metrics = run / "metrics.jsonl"
        # train.memory_snapshot=N: its files are written after step N's metrics line
        recorded = run / "memory_peak.json" if "train.memory_snapshot=" in f"{keys_of_all} {keys}" else None
        while proc.poll() is None and time.time() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps and (
                    recorded is None or recorded.is_file()):
                break
            time.sleep(1)
        proc.send_signal(signal.SIGKILL)  # no final checkpoint: what is measured is the steps
        proc.wait()
    row = row_of_run(run, log, seq_len)
    return row if variant is None else {"variant": name, "keys": keys, **row}


def row_of_run(run: Path, log: Path, seq_len: int) -> dict:
    """A length's row from its run folder and log: ``record_of`` where a step was logged; else the log's last lines
    (refused, failed, or cut short before its first step ended) and, where its chunks.jsonl has lines, how far that
    step got (``partial``) with the plan's prediction beside the peak it had reached. A run with train.log_chunks
    keeps its chunk lines (``chunks``: the GPU peak at each chunk's start says which stage reached the step's), and
    one with train.memory_snapshot its memory_peak.json (``memory_peak``: what was alive at the peak, by site)."""
    chunks, peak_file = run / "chunks.jsonl", run / "memory_peak.json"
    lines = [json.loads(line) for line in chunks.read_text().splitlines() if line.strip()] if chunks.is_file() else []
    extra = {**({"chunks": lines} if lines else {}),
             **({"memory_peak": json.loads(peak_file.read_text())} if peak_file.is_file() else {})}
    if (run / "metrics.jsonl").is_file():
        return {**record_of(run, log, seq_len), **extra}
    row = {"seq_len": seq_len, "warm_step_s": None, "error": log.read_text().strip().splitlines()[-3:], **extra}
    if lines:
        row["partial"] = partial_step(lines)
        peak = row["partial"]["peak_gpu_gib"]
        row.update(planned_against_measured(log.read_text(), [{"peak_gpu_gib": peak}] if peak else []))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_steps", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--lengths", type=int_list, default=[65536, 131072])
    p.add_argument("--steps", type=int_list, default=[3, 2], help="steps to log at each length (the first warms up)")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per length")
    p.add_argument("--out", required=True, help="write the record here")
    p.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "KEYS"), default=None,
                   help='run each length once more per variant with these oomb train keys, e.g. --variant qlora '
                        '"lora.r=16 model.quantize=nf4" (repeatable; default: the keys at their defaults)')
    p.add_argument("--keys", default="", metavar="KEYS",
                   help='oomb train keys of every run, e.g. "train.fused_grad_accumulation=false" (a job reproducing '
                        'a record made before a default changed)')
    p.add_argument("--longest", action="store_true",
                   help="one more row per variant at the longest data.seq_len `oomb plan` says fits this machine with "
                        "its keys, one step logged (its peak: the plan's prediction checked where it is tightest)")
    p.add_argument("--from-runs", nargs="+", metavar="RUN=LOG", default=None,
                   help="build the record from run folders and their logs made earlier (no training)")
    args = p.parse_args(argv)
    if len(args.steps) != len(args.lengths):
        p.error("--steps needs one count per length")
    if args.variant is not None and args.from_runs is not None:
        p.error("--from-runs builds a record of runs without variants")
    if args.from_runs is None:
        import torch

        if not torch.cuda.is_available():
            print("the train_steps benchmark needs a CUDA GPU", file=sys.stderr)
            return 2
        folder = Path(tempfile.mkdtemp(prefix="train_steps-"))
        variants = [tuple(v) for v in args.variant] if args.variant is not None else [None]
        rows = [run_length(args.preset, n, k, folder, args.timeout, variant, args.keys)
                for n, k in zip(args.lengths, args.steps, strict=True) for variant in variants]
        for variant in variants if args.longest else []:
            keys = f"{args.keys} {variant[1] if variant else ''}"
            n = longest_planned(args.preset, keys)
            rows.append({**run_length(args.preset, n, 1, folder, args.timeout, variant, args.keys, log_chunks=True),
                         "longest": True}
                        if n else {"seq_len": None, "longest": True, "warm_step_s": None,
                                   "error": ["oomb plan gave no longest length"]})
        machine = machine_description()
    else:
        pairs = [item.split("=", 1) for item in args.from_runs]
        rows = [record_of(Path(run), Path(log), n) for (run, log), n in zip(pairs, args.lengths, strict=True)]
        machine = None
    report = {"bench": "train_steps", "command": command_line("benchmarks.train_steps", argv),
              "date": datetime.date.today().isoformat(), "machine": machine, "preset": args.preset,
              **({"keys": args.keys} if args.keys else {}), "results": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for r in rows:
        warm = f"{r['warm_step_s']:.2f} s" if r["warm_step_s"] is not None else "not reached"
        part = r.get("partial")
        what = (f"chunk {r['chunk_size']}, cache {r['cache_attention']}, step after the first {warm}"
                if "error" not in r else
                f"cut short after {part['seconds_reached']:.0f} s of its first step: stage 1 "
                f"{part['fill_chunks_started']}/{part['fill_chunks']} chunks, stage 2 {part['backward_chunks_started']}"
                f"/{part['backward_chunks']}, GPU peak {part['peak_gpu_gib']} GiB, predicted step "
                f"{part['predicted_step_s'] and round(part['predicted_step_s'])} s" if part else
                f"failed: {' / '.join(r['error'])}")
        print(f"{r.get('variant', ''):>8}{r['seq_len'] or '-':>9} tokens: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
