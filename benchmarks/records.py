"""Records that no benchmark writes itself, built from what a GPU run printed or left on disk.

    python -m benchmarks.records gradient-accuracy out/gpu-tests.log --command "..." --out out/X.json
    python -m benchmarks.records longrun out/longrun --command "..." --out out/Y.json
    python -m benchmarks.records versus-unsloth out/unsloth.json --oomb out/train.json --command "..." --out out/Z.json

- gradient-accuracy: the errors tests/engine/test_gpu_bf16.py prints under `pytest -s -m gpu`
  (bf16 gradients against fp32 full-sequence training; bf16 against fp32 gradient pages; sparse
  with packed documents);
- longrun: a run folder of benchmarks/longrun.sh: each phase's settings, metrics and answer loss
  (first and last tenth of its steps), and the retrieval eval;
- versus-unsloth: Unsloth's steps (benchmarks.unsloth_step) beside `oomb train`'s (benchmarks.train_steps) at each
  length both ran, on one machine: step times and peak allocated GPU memory, and oomb's over Unsloth's.

Every record carries the command that made it, the date, the machine and what it was built from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

_FLOAT = r"([0-9.]+(?:e-?\d+)?)"
# test_bf16_gradients_close_to_fp32_full_sequence prints one line per backend, parametrized in this order.
_DENSE_BACKENDS = ("torch", "triton")
_DENSE = re.compile(rf"global relative gradient error vs fp32: oomb {_FLOAT}, transformers bf16 {_FLOAT}; "
                    rf"oomb vs transformers bf16: {_FLOAT}")
_PAGES = re.compile(rf"gradient pages bf16: error vs fp32 full sequence {_FLOAT}; fp32 pages: {_FLOAT}")
_SPARSE_DOCS = re.compile(rf"sparse\+documents bf16 vs fp32: triton {_FLOAT}, torch path {_FLOAT}")


class RecordError(ValueError):
    """The input does not hold what the record needs; the message says what is missing."""


def gradient_accuracy(log_text: str) -> dict:
    """The figures test_gpu_bf16.py printed, by test; RecordError when a test's line is missing."""
    dense = _DENSE.findall(log_text)
    if len(dense) != len(_DENSE_BACKENDS):
        raise RecordError(f"expected {len(_DENSE_BACKENDS)} lines 'global relative gradient error vs fp32: ...' "
                          f"(one per backend), found {len(dense)}: run pytest with -s on tests/engine/test_gpu_bf16.py")
    record = {"dense_8269_tokens_chunk_2048": {
        backend: {"oomb_vs_fp32": float(a), "transformers_bf16_vs_fp32": float(b),
                  "oomb_vs_transformers_bf16": float(c)}
        for backend, (a, b, c) in zip(_DENSE_BACKENDS, dense, strict=True)}}
    pages, sparse = _PAGES.search(log_text), _SPARSE_DOCS.search(log_text)
    if pages:
        record["gradient_pages_16384_tokens"] = {"bf16_pages_vs_fp32": float(pages[1]),
                                                 "fp32_pages_vs_fp32": float(pages[2])}
    if sparse:
        record["sparse_documents_bf16_vs_fp32"] = {"triton": float(sparse[1]), "torch": float(sparse[2])}
    return record


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tenths(losses: list[float]) -> tuple[float, float]:
    """Mean loss of the first and of the last tenth of the steps (at least one step each)."""
    n = max(1, len(losses) // 10)
    return sum(losses[:n]) / n, sum(losses[-n:]) / n


def longrun(run_dir: Path) -> dict:
    """A benchmarks/longrun.sh folder as one record: settings, phases in order, the (latest) eval."""
    settings_file = run_dir / "settings.txt"
    if not settings_file.is_file():
        raise RecordError(f"{run_dir} has no settings.txt: not a folder benchmarks/longrun.sh wrote")
    text = settings_file.read_text()
    # KEY=value pairs; CURRICULUM's value holds spaces, so a value runs to the next KEY=.
    settings = dict(re.findall(r"([A-Z_]+)=(.*?)(?= [A-Z_]+=|$)", text))
    phases = []
    for name in [f"len{spec.split(':')[0]}" for spec in settings.get("CURRICULUM", "").split()] + \
            [f"long{settings.get('LONG_LEN', '')}"]:
        folder = run_dir / name
        if not (folder / "metrics.jsonl").is_file():
            raise RecordError(f"phase {name} has no {folder / 'metrics.jsonl'}: the run did not reach it")
        config = json.loads((folder / "config.json").read_text())
        rows = _metrics(folder / "metrics.jsonl")
        losses = [r["loss"] for r in rows if r.get("loss") is not None]
        first, last = _tenths(losses)
        done = run_dir / f"{name}.done"
        seconds = re.search(r", (\d+) s: ", done.read_text()) if done.is_file() else None
        phases.append({"name": name, "seq_len": config["data"]["seq_len"], "batch_size": config["train"]["batch_size"],
                       "steps_planned": config["train"]["steps"], "steps": len(rows), "lr": config["train"]["lr"],
                       "chunk_size": config["train"]["chunk_size"], "finished": done.is_file(),
                       "seconds": int(seconds[1]) if seconds else None,
                       "answer_loss_first_tenth": first, "answer_loss_last_tenth": last,
                       "config": config, "metrics": rows})
    evals = sorted(run_dir.glob("eval*/results.json"), key=lambda p: p.stat().st_mtime)
    if not evals:
        raise RecordError(f"{run_dir} holds no eval*/results.json: the run's eval did not finish")
    return {"settings": settings, "phases": phases, "eval": json.loads(evals[-1].read_text())}


def versus_unsloth(unsloth: dict, *oombs: dict) -> dict:
    """Rows of the lengths Unsloth's record and each of oomb's (one per setting, their rows one after the other)
    ran, a step that completed in both: oomb's time and memory over Unsloth's. Every record must come from one
    machine (the same GPU and day: ratios are taken on one machine)."""
    theirs = {r["seq_len"]: r for r in unsloth["results"] if r.get("step_s")}
    rows = []
    for oomb in oombs:
        if unsloth.get("machine") != oomb.get("machine") or str(unsloth.get("date", ""))[:10] != oomb.get("date"):
            raise RecordError(f"the records come from different machines or days: {unsloth.get('machine')} "
                              f"{unsloth.get('date')} against {oomb.get('machine')} {oomb.get('date')}")
        for ours in oomb["results"]:
            n, step = ours["seq_len"], ours.get("warm_step_s")
            peaks = [s["peak_gpu_gib"] for s in ours.get("steps", []) if s.get("peak_gpu_gib")]
            if n not in theirs or step is None or not peaks:
                continue
            them = theirs[n]
            keys = " ".join(k for k in (oomb.get("keys"), ours.get("keys")) if k)  # every run's, then its variant's
            rows.append({"seq_len": n, "oomb_keys": keys or None, "oomb_variant": ours.get("variant"),
                         "unsloth_step_s": them["step_s"], "unsloth_peak_gpu_gib": them["peak_gpu_gib"],
                         "oomb_step_s": step, "oomb_peak_gpu_gib": max(peaks),
                         "oomb_settings": {k: ours.get(k) for k in ("chunk_size", "cache_attention", "recompute",
                                                                    "lora_r", "quantize")},
                         "time_ratio": step / them["step_s"], "peak_ratio": max(peaks) / them["peak_gpu_gib"]})
    if not rows:
        raise RecordError("no length has a completed step in both records")
    return {"unsloth_command": unsloth["command"], "oomb_command": [o["command"] for o in oombs],
            "unsloth_settings": unsloth.get("settings"), "oomb_keys": [o.get("keys") for o in oombs],
            "versions": unsloth.get("versions"), "rows": rows}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.records", description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["gradient-accuracy", "longrun", "versus-unsloth"])
    p.add_argument("source", help="gradient-accuracy: the pytest log; longrun: the run folder; versus-unsloth: "
                   "benchmarks.unsloth_step's record")
    p.add_argument("--oomb", action="append", help="versus-unsloth: benchmarks.train_steps's record of the same "
                   "lengths (repeat it for each of oomb's settings: their rows follow each other)")
    p.add_argument("--command", required=True, help="the command that produced the source")
    p.add_argument("--machine", default=None, help="the machine, in words (default: this one)")
    p.add_argument("--date", default=None, help="ISO date of the run (default: now)")
    p.add_argument("--out", required=True, help="the JSON record to write")
    args = p.parse_args(argv)
    source = Path(args.source)
    try:
        if args.kind == "gradient-accuracy":
            body = gradient_accuracy(source.read_text())
        elif args.kind == "longrun":
            body = longrun(source)
        else:
            if args.oomb is None:
                raise RecordError("versus-unsloth needs --oomb (benchmarks.train_steps's record)")
            unsloth = json.loads(source.read_text())
            body = versus_unsloth(unsloth, *(json.loads(Path(f).read_text()) for f in args.oomb))
            args.machine, args.date = args.machine or unsloth["machine"], args.date or str(unsloth["date"])[:10]
    except (OSError, ValueError, KeyError, RecordError) as e:
        print(f"python -m benchmarks.records {args.kind}: {e}", file=sys.stderr)
        return 2
    if args.machine is None:
        from benchmarks.common import machine_description

        args.machine = machine_description()
    record = {"bench": args.kind.replace("-", "_"), "command": args.command, "date": args.date or _now(),
              "machine": args.machine, "built_from": str(source), **body}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
