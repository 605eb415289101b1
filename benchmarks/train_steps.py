"""`oomb train` as a user runs it: the settings it picks by itself and the step time it reports.

    python -m benchmarks.train_steps --lengths 65536,131072 --steps 3,2 --out out/train-7b-auto.json

For each length, ``oomb train model.preset=P data.seq_len=N`` (every other key at its default: the
chunk size, the attention cache, fused ops and master weights as its memory plan settles them, AdamW
and its optimizer step included) runs in a process of its own until ``--steps`` steps are logged,
then is killed: a 7B run would otherwise write a ~45 GB checkpoint at its end. The record keeps each
step's seconds and peak GPU memory as `oomb train` reports them in metrics.jsonl (its first step
compiles kernels and grows the allocator's pools), the settings from its config.json and its
startup lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import int_list, machine_description


def record_of(run: Path, log: Path, seq_len: int) -> dict:
    """One length's entry from a run folder (metrics.jsonl, config.json) and its console log."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = json.loads((run / "config.json").read_text())
    warm = [m["seconds"] for m in metrics[1:]]
    return {
        "seq_len": seq_len,
        "chunk_size": cfg["train"]["chunk_size"],
        "cache_attention": cfg["train"]["cache_attention"],
        "master_weights": cfg["train"]["master_weights"],
        "attention": cfg["train"].get("attention"),  # the key's value; the startup line names the kernels it chose
        "steps": [{k: m.get(k) for k in ("step", "seconds", "loss", "peak_gpu_gib")} for m in metrics],
        "warm_step_s": sum(warm) / len(warm) if warm else None,  # the steps after the first
        "startup": [line for line in log.read_text().splitlines() if line.startswith(("oomb train", "note:", "fused"))
                    or "chosen by the memory plan" in line],
    }


def run_length(preset: str, seq_len: int, steps: int, folder: Path, timeout: float) -> dict:
    run, log = folder / f"run{seq_len}", folder / f"run{seq_len}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "oomb.cli", "train", f"model.preset={preset}",
                                 f"data.seq_len={seq_len}", "train.steps=1000", "train.export=false",
                                 f"out_dir={run}"], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        metrics = run / "metrics.jsonl"
        while proc.poll() is None and time.time() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
                break
            time.sleep(1)
        proc.send_signal(signal.SIGKILL)  # no final checkpoint: what is measured is the steps
        proc.wait()
    return record_of(run, log, seq_len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_steps", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--lengths", type=int_list, default=[65536, 131072])
    p.add_argument("--steps", type=int_list, default=[3, 2], help="steps to log at each length (the first warms up)")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per length")
    p.add_argument("--out", required=True, help="write the record here")
    p.add_argument("--from-runs", nargs="+", metavar="RUN=LOG", default=None,
                   help="build the record from run folders and their logs made earlier (no training)")
    args = p.parse_args(argv)
    if len(args.steps) != len(args.lengths):
        p.error("--steps needs one count per length")
    if args.from_runs is None:
        import torch

        if not torch.cuda.is_available():
            print("the train_steps benchmark needs a CUDA GPU", file=sys.stderr)
            return 2
        folder = Path(tempfile.mkdtemp(prefix="train_steps-"))
        rows = [run_length(args.preset, n, k, folder, args.timeout) for n, k in zip(args.lengths, args.steps,
                                                                                      strict=True)]
        machine = machine_description()
    else:
        pairs = [item.split("=", 1) for item in args.from_runs]
        rows = [record_of(Path(run), Path(log), n) for (run, log), n in zip(pairs, args.lengths, strict=True)]
        machine = None
    report = {"bench": "train_steps", "command": "python -m benchmarks.train_steps " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:])), "date": datetime.date.today().isoformat(),
              "machine": machine, "preset": args.preset, "results": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for r in rows:
        print(f"{r['seq_len']:>9} tokens: chunk {r['chunk_size']}, cache {r['cache_attention']}, "
              f"step after the first {r['warm_step_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
