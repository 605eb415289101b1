"""Interrupted, killed and out-of-memory runs of `oomb train` on a GPU machine (docs/failures.md), in one
process tree; logs and the report under --out.

    python -m benchmarks.faults --skip-oom --out out/faults      # parts 1-3: faults.json
    python -m benchmarks.faults --only-oom --out out/faults      # part 4 alone: faults-oom.json

1. A reference run of ``--steps`` steps at ``--seq-len`` tokens (sparse attention, so a step
   takes seconds), with a checkpoint every step.
2. The same run stopped by SIGINT during step 3, then resumed; and stopped by SIGKILL during
   step 4, then resumed. Both must end with the reference's losses, step for step.
3. A run that cannot fit (Qwen2.5-7B, 16 sequences of 128K tokens per step, pages on the GPU):
   refused by the memory planner before any work; the message is saved.
4. A forced out-of-memory error inside a step: one step of ``--oom-preset`` (Qwen2.5-1.5B) at 8K
   tokens (checkpoint 1), then the run resumed with the planner switched off and one 128K-token
   chunk (train.chunk_size=131072: the store fits, one chunk's activations do not): the error
   is reported in the middle of the step, checkpoint 1 stays intact and loads.

Checkpoints rotate (train.keep_last=2) so the runs stay within the machine's disk.

Writes faults.json (exit codes, losses, messages; with the command, date and machine) and the logs of every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import command_line, machine_description


def losses(run: Path) -> dict[int, float]:
    rows = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows}


def oomb_train(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "oomb.cli", "train", *args]


def run(cmd: list[str], log: Path, timeout: int = 1800) -> int:
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode


def run_until_step(cmd: list[str], log: Path, run_dir: Path, step: int, sig: int) -> int:
    """Start ``cmd``, send ``sig`` once metrics.jsonl shows ``step - 1`` steps done, return its exit code."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if len(lines) >= step - 1:
                last = json.loads(lines[-1]).get("seconds", 2.0) if lines else 2.0
                time.sleep(min(2.0, 0.4 * float(last)))  # into the step, well before its end
                proc.send_signal(sig)
                break
            time.sleep(0.2)
        return proc.wait(timeout=1800)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--oom-preset", default="qwen2.5-1.5b", help="the model of part 4")
    p.add_argument("--skip-oom", action="store_true", help="leave out part 4")
    p.add_argument("--only-oom", action="store_true", help="part 4 alone (it takes the whole GPU: run it alone)")
    p.add_argument("--reference", default=None,
                   help="metrics.jsonl of an earlier reference run with the same settings (skips part 1)")
    p.add_argument("--signals", default="sigint,sigkill", help="which interruptions of part 2 to run")
    p.add_argument("--out", default="out/faults", help="folder for the runs, their logs and the report")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [f"model.preset={args.preset}", f"data.seq_len={args.seq_len}", f"train.steps={args.steps}",
              "train.save_every=1", "train.keep_last=2", "train.page_budget=64", "train.chunk_size=4096",
              "train.export=false",
              "train.warmup_steps=1"]
    report: dict = {"bench": "faults",
                    "command": command_line("benchmarks.faults", argv),
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "machine": machine_description(), "settings": vars(args)}

    if not args.only_oom:
        if args.reference:
            reference = losses(Path(args.reference).parent)
        else:
            ref = out / "reference"
            report["reference_exit"] = run(oomb_train([f"out_dir={ref}", *common]), out / "reference.log")
            reference = losses(ref)
        report["reference_losses"] = reference

        wanted = args.signals.split(",")
        for name, sig, step in (("sigint", signal.SIGINT, 3), ("sigkill", signal.SIGKILL, 4)):
            if name not in wanted:
                continue
            run_dir = out / name
            code = run_until_step(oomb_train([f"out_dir={run_dir}", *common]), out / f"{name}.log", run_dir, step, sig)
            resumed = run(oomb_train([f"resume={run_dir}"]), out / f"{name}-resume.log")
            got = losses(run_dir)
            report[name] = {"exit": code, "resume_exit": resumed, "losses": got,
                            "same_as_reference": all(abs(got[s] - reference[s]) <= 1e-6 * abs(reference[s])
                                                     for s in reference if s in got) and got.keys() == reference.keys()}

        refused = subprocess.run(oomb_train([f"out_dir={out / 'refused'}", "model.preset=qwen2.5-7b",
                                             "data.seq_len=131072", "train.batch_size=16", "train.steps=1"]),
                                 capture_output=True, text=True, timeout=600)
        report["planner_refusal"] = {"exit": refused.returncode,
                                     "message": refused.stdout[-3000:] + refused.stderr[-2000:],
                                     "run_folder_created": (out / "refused").exists()}

    if not args.skip_oom:
        oom_dir = out / "oom"
        first = run(oomb_train([f"out_dir={oom_dir}", f"model.preset={args.oom_preset}", "data.seq_len=8192",
                                "train.steps=1", "train.save_every=1", "train.export=false"]), out / "oom-step1.log")
        # The run continues from its step-1 checkpoint with one 128K-token chunk per step.
        code = run(oomb_train([f"resume={oom_dir / 'checkpoints' / 'step-00000001'}", "data.seq_len=131072",
                               "train.chunk_size=131072", "train.steps=2", "train.memory_check=false"]),
                   out / "oom.log")
        verify = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                                 "from oomb.train.runfolder.checkpoint import verify_checkpoint; "
                                 "verify_checkpoint(Path(sys.argv[1])); print('checkpoint intact')",
                                 str(oom_dir / "checkpoints" / "step-00000001")], capture_output=True, text=True)
        report["forced_oom"] = {"first_exit": first, "exit": code, "log_tail": (out / "oom.log").read_text()[-3000:],
                                "checkpoint_check": (verify.stdout + verify.stderr)[-500:]}

    (out / ("faults-oom.json" if args.only_oom else "faults.json")).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("reference_losses",)}, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
