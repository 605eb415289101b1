"""Page-sparse against dense training at 256K and 1M tokens on real text, resumable across device calls.

    python -m benchmarks.studies.sparse_long --out /tmp/sl --budget-seconds 520 --copy-to $OUT  # a device call
    python -m benchmarks.studies.sparse_long --out /tmp/sl --dry-run         # every command, with its estimate
    python -m benchmarks.studies.sparse_long --out /tmp/sl-smoke --smoke     # the whole pipeline on the CPU, minutes

Each step is one command: the corpus (benchmarks/studies/code_corpus.py, from the machine's installed packages), a
random-init model (init_model.py: a preset's architecture, the corpus tokenizer's vocabulary), then plain
`python -m oomb.cli train` and `oomb eval` (keys of docs/config.md, options of docs/eval.md):

  group 1  corpus; init; A: 16K x 4 a step, cosine lr, held-out loss every 100 steps; B-dense-s1 and B-sparse-s1:
           A's export at 256K, YaRN factor 16 over A's 16K (docs/config.md's recommendation), constant lr after
           warmup, train.seed=1 for both (the same sequences in the same order), the sparse run with
           train.page_budget=64 and every other selection key at oomb train's default; each in two runs (the second
           resumes the first) with `oomb eval` of held-out loss per position after each, retrieval of a passkey in
           held-out code at 128K and 256K after the last, the sparse model also read with dense attention
  group 2  the same pair with train.seed=2
  group 3  C: B-sparse-s1 extended to 1M (YaRN factor 64), sparse; held-out loss per position at 1M of C and of
           B-sparse-s1 on the same documents

A step runs once every step before it is done; where a done step's output is gone (a fresh machine: a device
lease holds one machine for 30 minutes at most, and a 0.4 GB export cannot travel in a call's 64 MiB), it is run
again before the step that reads it, and the record counts the attempts. With --budget-seconds, a build or eval
starts only when its estimate fits, a training run when its start and one step do; a run still going
``save_reserve`` seconds before the end gets SIGTERM (oomb train saves its last finished step, exit 75) and the next
invocation resumes it (`resume=`). It exits 0 with DIR/state.json saying what is done; --copy-to copies state,
record and tables out after every step, --state-from carries a state into a fresh DIR. The record
DIR/sparse_long.json holds the settings, the corpus description, every command with its exit status, seconds and
machine, the training metrics and the evaluations; DIR/sparse_long.md the tables (sparse_long_report.py).

Device time, ESTIMATES (nothing has run on a GPU yet; the records of the first call replace them). From
benchmarks/results/longrun-0.5b-128k.json (H200; Qwen2.5-0.5B: 24 layers, 151,936-id vocabulary; chunks of 4096;
dense): 16K x 2 took 0.69 s a step (47K tokens/s), 128K 11.95 s. The model here is Qwen2.5-0.5B's architecture with
12 of its 24 layers and 16,384 ids (194M parameters): 0.39x the linear FLOPs per token, half the attention. So A's
16K x 4 step ~0.6 s; B's dense 256K step ~21 s (4x the 128K step's attention, which is 84% of it), sparse ~5 s (a
query attends 64 pages and its own 16K chunk, ~16K keys against 128K on average; sparse kernels at 0.8x the dense
TFLOP/s, sparse-steps-7b.json); C's 1M step ~20 s; an eval forward a third of a step; starting a run ~40 s, an eval
~25 s; the corpus ~1.5 min (here 43 MB took 55 s on two busy CPU cores, tokenizer training 11 s of it; the device
has 140 MB and 16 cores). `--dry-run` adds them up (a call of 520 s runs the steps that fit whole):

  group 1  ~24 min: corpus 1.5, init 0.3, A 5.7, B-dense-s1 8.4 + evals 2.6, B-sparse-s1 3.1 + evals 2.2
  group 2  ~16 min after group 1 on the same machine, ~24 min on a fresh one (corpus, init and A again)
  group 3  ~6.5 min after group 2, ~17 min on a fresh one (corpus, init, A, B-sparse-s1 again)
  in all   ~65 min on three fresh machines (~70 with their starts) of the 90 it may take; ~47 min on one. The preset's
           24 layers (373M parameters) double every step: group 1 alone ~40 min, more than a lease holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.studies.sparse_long_report import dry_run, markdown

K = 1024


@dataclass(frozen=True)
class Study:
    """Every setting: ``FULL`` is the device study, ``SMOKE`` the CPU check of the pipeline (numbers mean nothing)."""

    packages: tuple = ("transformers", "torch", "triton", "numpy", "sympy", "networkx")
    held_out: tuple = ("jax", "torch_geometric")
    vocab: int = 16384
    max_bytes: int | None = None
    doc_tokens: int = 1_100_000
    tokenizer_bytes: int = 32_000_000
    preset: str = "qwen2.5-0.5b"
    layers: int | None = 12  # None: the preset's
    init_dtype: str = "bfloat16"
    a_len: int = 16 * K
    a_batch: int = 4
    a_steps: int = 500
    a_lr: float = 6e-4
    a_warmup: int = 25
    a_val_every: int = 100
    long_len: int = 256 * K
    b_steps: int = 20
    b_segments: int = 2
    b_lr: float = 1e-4
    c_len: int = 1024 * K
    c_steps: int = 12
    c_lr: float = 1e-4
    seeds: tuple = (1, 2)
    budget: int = 64  # train.page_budget of the sparse runs; every other selection key at its default
    chunk: int = 16 * K
    page_size: int = 128
    select_block: int = 128  # oomb's default; the smoke's chunks are shorter
    ppl_docs: int = 4
    bucket: int = 4 * K  # eval buckets of this width; the tables group them as 0-4K, 4K-16K, ..., the last quarter
    needle_lengths: tuple = (128 * K, 256 * K)
    needle_depths: tuple = (0.1, 0.5, 0.9)
    needle_samples: int = 2
    device: str = "auto"
    save_reserve: int = 45  # seconds a stopped run has to end its step and write its checkpoint (194M: ~2.7 GB)
    # estimates in seconds (the docstring's): a start, a build, an optimizer step of each run; fwd: one sequence
    # of long_len forward only (dense scales with the length squared, sparse with the length)
    est: tuple = (("start", 40), ("resume", 45), ("eval_start", 25), ("corpus", 90), ("init", 20), ("A", 0.6),
                  ("B-dense", 21), ("B-sparse", 5), ("C-sparse", 20), ("fwd-dense", 7), ("fwd-sparse", 1.7))


FULL = Study()
SMOKE = Study(packages=("email",), held_out=("json",), vocab=384, max_bytes=120_000, doc_tokens=600,
              tokenizer_bytes=1_000_000, preset="tiny", layers=None, init_dtype="float32", a_len=64, a_batch=4,
              a_steps=3, a_lr=3e-3, a_warmup=1, a_val_every=2, long_len=256, b_steps=2, b_lr=1e-3, c_len=512,
              c_steps=1, c_lr=1e-3, budget=4, chunk=32, page_size=16, select_block=16, ppl_docs=2, bucket=8,
              needle_lengths=(192, 256), needle_depths=(0.5,), needle_samples=1, device="cpu", save_reserve=5,
              est=(("start", 15), ("resume", 15), ("eval_start", 10), ("corpus", 10), ("init", 8), ("A", 0.1),
                   ("B-dense", 0.2), ("B-sparse", 0.2), ("C-sparse", 0.3), ("fwd-dense", 0.1), ("fwd-sparse", 0.1)))


@dataclass
class Step:
    name: str
    group: int
    module: str  # run as `python -m MODULE *args`
    args: list
    output: str  # below DIR: what exists once it is done (a training run: its folder)
    needs: list  # the steps whose output it reads
    est_s: float
    run: bool = False  # a training segment: trains output's run to `until` steps; `final`: its last segment
    until: int = 0
    final: bool = True
    step_s: float = 0.0  # a training segment: the estimate of one step

    def __post_init__(self):
        self.args = [str(a) for a in self.args]

    def command(self) -> str:
        return shlex.join(["python", "-m", self.module, *self.args])


def plan(s: Study, out: Path) -> list[Step]:
    """Every step of the study in the order it runs."""
    est, o = dict(s.est), out.resolve()
    dev, edev = ([], []) if s.device == "auto" else ([f"train.device={s.device}"], ["--device", s.device])
    data = ["data.task=text", f"data.paths=[{o}/corpus/train]", f"data.tokenizer={o}/corpus/tokenizer",
            f"data.val_paths=[{o}/corpus/heldout]"]
    steps = [Step("corpus", 1, "benchmarks.studies.code_corpus",
                  ["--out", f"{o}/corpus", "--packages", ",".join(s.packages), "--held-out", ",".join(s.held_out),
                   "--vocab", s.vocab, "--doc-tokens", s.doc_tokens, "--tokenizer-bytes", s.tokenizer_bytes,
                   *(["--max-bytes", s.max_bytes] if s.max_bytes else [])], "corpus/corpus.json", [], est["corpus"]),
             Step("init", 1, "benchmarks.studies.init_model",
                  ["--out", f"{o}/init", "--preset", s.preset, "--tokenizer", f"{o}/corpus/tokenizer",
                   "--positions", s.a_len, "--dtype", s.init_dtype, *(["--layers", s.layers] if s.layers else [])],
                  "init/model.safetensors", ["corpus"], est["init"])]

    def fwd(length, sparse):
        return est["fwd-sparse"] * length / s.long_len if sparse else est["fwd-dense"] * (length / s.long_len) ** 2

    def evaluate(name, group, model, need, length, sparse, retrieval=True):
        sel = ["--page-budget", s.budget, "--select-block", s.select_block] if sparse else []
        args = ["eval", f"{o}/{model}", "--perplexity", f"{o}/corpus/heldout", "--ppl-length", length, "--ppl-docs",
                s.ppl_docs, "--buckets", length // s.bucket, "--tokenizer", f"{o}/corpus/tokenizer", "--chunk-size",
                s.chunk, "--page-size", s.page_size, *sel, *edev]
        t = est["eval_start"] + s.ppl_docs * fwd(length, sparse)
        if retrieval:  # a passkey sentence in held-out code, no chat template (the tokenizer has none)
            args += ["--retrieval", "--task", "text", "--haystack", f"{o}/corpus/heldout", "--prompt", "plain",
                     "--lengths", ",".join(map(str, s.needle_lengths)), "--depths", ",".join(map(str, s.needle_depths)),
                     "--samples", s.needle_samples, "--seed", 0]
            t += len(s.needle_depths) * s.needle_samples * sum(fwd(n, sparse) for n in s.needle_lengths)
        steps.append(Step(name, group, "oomb.cli", [*args, "--out", f"{o}/evals/{name}"],
                          f"evals/{name}/results.json", [need], t))

    def train(name, group, model, need, length, batch, n, lr, keys, segments=1):
        bounds = [n * (k + 1) // segments for k in range(segments)]
        run = f"{o}/runs/{name}"
        fresh = ["train", f"model.path={o}/{model}", *data, f"data.seq_len={length}", f"train.batch_size={batch}",
                 f"train.lr={lr}", *keys, *dev, "train.keep_last=1", f"out_dir={run}"]
        prev = need
        for k, until in enumerate(bounds):
            final = k == segments - 1
            tail = [f"train.steps={until}", f"train.export={str(final).lower()}"]
            seg = name if segments == 1 else f"{name}.{k + 1}"
            per = est[name.rsplit("-s", 1)[0]]
            t = est["resume" if k else "start"] + per * (until - (bounds[k - 1] if k else 0))
            steps.append(Step(seg, group, "oomb.cli", [*fresh, *tail] if k == 0 else ["train", f"resume={run}", *tail],
                              f"runs/{name}", [prev], t, True, until, final, per))
            prev = seg
            if not final:  # the checkpoint just written: held-out loss per bucket over training
                evaluate(f"{name}_step{until}", group, f"runs/{name}", seg, length, "sparse" in name, retrieval=False)
        return prev

    yarn = ["model.rope.type=yarn", f"model.rope.original_max_position_embeddings={s.a_len}"]
    long = [f"train.chunk_size={s.chunk}", f"train.page_size={s.page_size}", "train.lr_scheduler=constant_with_warmup",
            "train.val_batches=1", *yarn]
    sparse = [f"train.page_budget={s.budget}", *([f"train.select_block={s.select_block}"] if s.select_block != 128
                                                 else [])]
    a = train("A", 1, "init", "init", s.a_len, s.a_batch, s.a_steps, s.a_lr,
              ["train.lr_scheduler=cosine_with_min_lr", "train.min_lr_ratio=0.1", f"train.warmup_steps={s.a_warmup}",
               "train.weight_decay=0.1", "train.seed=0", f"train.val_every={s.a_val_every}", "train.val_batches=2",
               f"train.save_every={s.a_val_every}"])
    last = {}
    for g, seed in enumerate(s.seeds, start=1):
        for arm in ("dense", "sparse"):
            name = f"B-{arm}-s{seed}"
            last[name] = train(name, g, "runs/A/export", a, s.long_len, 1, s.b_steps, s.b_lr,
                               [*long, "train.warmup_steps=2", f"model.rope.factor={s.long_len // s.a_len}",
                                *(sparse if arm == "sparse" else []), f"train.seed={seed}",
                                f"train.val_every={s.b_steps // s.b_segments}"], s.b_segments)
            evaluate(f"{name}_final", g, f"runs/{name}/export", last[name], s.long_len, arm == "sparse")
        evaluate(f"B-sparse-s{seed}_final-dense", g, f"runs/B-sparse-s{seed}/export", last[f"B-sparse-s{seed}"],
                 s.long_len, False, retrieval=False)
    seed, g, b, c = s.seeds[0], len(s.seeds) + 1, f"B-sparse-s{s.seeds[0]}", f"C-sparse-s{s.seeds[0]}"
    train(c, g, f"runs/{b}/export", last[b], s.c_len, 1, s.c_steps, s.c_lr,
          [*long, "train.warmup_steps=1", f"model.rope.factor={s.c_len // s.a_len}", *sparse, f"train.seed={seed}",
           f"train.val_every={s.c_steps}"])
    evaluate(f"{c}_final-1m", g, f"runs/{c}/export", c, s.c_len, True, retrieval=False)
    evaluate(f"{b}_final-1m", g, f"runs/{b}/export", last[b], s.c_len, True, retrieval=False)
    return steps


# ----------------------------------------------------------------------------- running the plan
class Stop(Exception):
    """This invocation ends here (time or command budget): the state says what is next."""


class Failed(Exception):
    pass


def latest_step(run: Path) -> int | None:
    steps = [int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*") if p.name.split("-")[1].isdigit()]
    return max(steps) if steps else None


def machine() -> str:
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                       text=True) if shutil.which("nvidia-smi") else None
    return f"{platform.node()}: {q.stdout.splitlines()[0] if q and q.stdout.strip() else 'no GPU'}"


class Driver:
    def __init__(self, s: Study, out: Path, steps: list[Step], budget_s: float | None, in_process: bool,
                 copy_to: Path | None, max_commands: int | None, command: str):
        self.s, self.out, self.steps, self.in_process, self.copy_to = s, out, steps, in_process, copy_to
        self.by_name = {st.name: st for st in steps}
        self.budget_s, self.t_end = budget_s, None if budget_s is None else time.monotonic() + budget_s
        self.max_commands, self.commands, self.command, self.machine = max_commands, 0, command, machine()
        path = out / "state.json"
        self.state = json.loads(path.read_text()) if path.is_file() else {
            "revision": 0, "settings": settings_of(s), "steps": {}, "runs": {}, "evals": {}, "warnings": []}

    def left(self) -> float:
        return float("inf") if self.t_end is None else self.t_end - time.monotonic()

    def exists(self, st: Step) -> bool:
        run = self.out / st.output
        if not st.run:
            return run.exists()
        if (run / "export" / "config.json").is_file():
            return True
        return not st.final and (latest_step(run) or -1) >= st.until

    def next_step(self) -> Step | None:
        return next((st for st in self.steps if self.state["steps"].get(st.name, {}).get("status") != "done"), None)

    def go(self) -> None:
        while (st := self.next_step()) is not None:
            self.make_inputs(st, st.group)
            if self.next_step() is st:
                self.execute(st)

    def make_inputs(self, st: Step, group: int) -> None:
        """Inputs gone (a fresh machine) are made again; then the done steps of ``group`` that read them, directly or
        not, are done again too, so a pair of runs always starts from the same model (the record counts attempts)."""
        for name in st.needs:
            need = self.by_name[name]
            if not self.exists(need):
                self.make_inputs(need, group)
                self.execute(need)
                stale = {name}
                for later in self.steps:
                    if stale & set(later.needs):
                        stale.add(later.name)
                        rec = self.state["steps"].get(later.name, {})
                        if later.group == group and rec.get("status") == "done":
                            rec["status"] = "redo"

    def execute(self, st: Step) -> None:
        args, target = list(st.args), self.out / (st.output if st.run else Path(st.output).parent)
        if st.run:
            done, est = latest_step(target), dict(self.s.est)
            redo = self.state["steps"].get(st.name, {}).get("status") == "redo" and "resume=" not in st.args[1]
            if done is None or redo:  # (a first segment done again starts from the new model)
                shutil.rmtree(target, ignore_errors=True)
                done = None
            else:  # a run stopped earlier (or an earlier segment's): continue from its checkpoint
                args = ["train", f"resume={target.resolve()}", f"train.steps={st.until}",
                        f"train.export={str(st.final).lower()}"]
            whole = est["start" if done is None else "resume"] + st.step_s * (st.until - (done or 0))
            # the whole segment where it can fit in one call (a run cut and resumed costs a save and a start);
            # a start and one step where it cannot
            need = whole if self.budget_s is None or whole <= self.budget_s else est["resume"] + st.step_s
            need += self.s.save_reserve
        else:
            shutil.rmtree(target, ignore_errors=True)
            need = st.est_s
        if self.max_commands is not None and self.commands >= self.max_commands:
            raise Stop(f"command limit reached; next: {st.name}")
        if self.left() < need:
            raise Stop(f"{self.left():.0f} s left; next: {st.name}, which needs about {need:.0f} s to start")
        rec = self.state["steps"].setdefault(st.name, {"attempts": 0, "runs": []})
        rec["attempts"] += 1
        print(f"=== {st.name} (attempt {rec['attempts']}, ~{st.est_s:.0f} s; {self.left():.0f} s left)", flush=True)
        t0, started = time.monotonic(), datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        rc, stopped = self.launch(st, args, rec["attempts"])
        self.commands += 1
        rec["runs"].append({"command": shlex.join(["python", "-m", st.module, *map(str, args)]), "rc": rc,
                            "stopped_by_budget": stopped, "seconds": round(time.monotonic() - t0, 1),
                            "started": started, "machine": self.machine, "order": self.state["revision"]})
        rec["status"] = "done" if rc == 0 else "partial" if st.run and rc == 75 else "stopped" if stopped else "failed"
        self.collect(st)
        self.save()
        if rec["status"] == "failed":
            raise Failed(f"{st.name} failed (exit {rc}); log: {self.out}/logs/{st.name}.{rec['attempts']}.log")
        if rec["status"] != "done":
            raise Stop(f"{st.name} stopped at the time budget ({rec['status']}); the next invocation continues it")
        if st.run and st.final:  # the export is what later steps read
            shutil.rmtree(target / "checkpoints", ignore_errors=True)

    def launch(self, st: Step, args: list, attempt: int) -> tuple[int, bool]:
        args = [str(a) for a in args]
        if self.in_process:  # the smoke: the same commands, without a process start each (no time limit then)
            try:
                return int(importlib.import_module(st.module).main(args) or 0), False
            except SystemExit as e:
                return (e.code if isinstance(e.code, int) else 1), False
        log = self.out / "logs" / f"{st.name}.{attempt}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
            [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
        with log.open("w") as f:
            p = subprocess.Popen([sys.executable, "-m", st.module, *args], stdout=f, stderr=subprocess.STDOUT,
                                 env=env, cwd=root)
            stop_at = self.left() - (self.s.save_reserve if st.run else 5)
            try:
                return p.wait(timeout=None if stop_at == float("inf") else max(1.0, stop_at)), False
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)  # oomb train: checkpoint of the last finished step, exit 75
            try:
                return p.wait(timeout=self.s.save_reserve + 60), True
            except subprocess.TimeoutExpired:
                p.kill()
                return p.wait(), True

    def collect(self, st: Step) -> None:
        """What later machines cannot read from the folders: metrics, evaluation results, the corpus description."""
        path = self.out / st.output
        if st.run and (path / "metrics.jsonl").is_file():
            keep = ("step", "loss", "val_loss", "seconds", "lr", "grad_norm", "peak_gpu_gib")
            metrics = [{k: r[k] for k in keep if r.get(k) is not None}
                       for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if "step" in r]
            cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
            settled = {k: cfg.get("train", {}).get(k) for k in ("chunk_size", "cache_attention", "recompute",
                                                                 "attention", "master_weights", "page_budget")}
            self.state["runs"][st.output.split("/")[1]] = {"metrics": metrics, "settled": settled}
        elif st.name == "corpus" and path.is_file():
            corpus = json.loads(path.read_text())
            first = self.state.setdefault("corpus", corpus)
            if first["sha256"] != corpus["sha256"]:
                self.state["warnings"].append(f"corpus rebuilt on {self.machine} differs from the first build: "
                                              f"{corpus['sha256']} against {first['sha256']}")
        elif st.name == "init" and (path.parent / "init.json").is_file():
            self.state["model"] = json.loads((path.parent / "init.json").read_text())
        elif path.name == "results.json" and path.is_file():
            r = json.loads(path.read_text())
            ev = {"settings": r.get("settings"), "model_source": self.state["steps"].get(st.needs[0], {}).get(
                "attempts")}
            if "perplexity" in r:
                p = r["perplexity"]
                buckets = [[b["start"], b["end"], b["tokens"], b["mean_nll"]] for b in p["buckets"]]
                keep = ("length", "documents", "tokens", "mean_nll", "seconds")
                ev["perplexity"] = {**{k: p.get(k) for k in keep}, "buckets": buckets}
            if "retrieval" in r:
                keep = ("length", "depth", "samples", "accuracy", "token_accuracy", "answer_logprob", "answer_mean_nll")
                ev["retrieval"] = {"cells": [{k: c.get(k) for k in keep} for c in r["retrieval"]["cells"]],
                                   "seconds": r["retrieval"].get("seconds")}
            self.state["evals"][st.name] = ev

    def save(self) -> None:
        self.state["revision"] += 1
        record = {"study": "benchmarks.studies.sparse_long", "issue": 40, "command": self.command,
                  "machine": self.machine, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  "settings": settings_of(self.s), "estimates_s": dict(self.s.est),
                  "plan": [{"name": st.name, "group": st.group, "command": st.command(), "est_s": round(st.est_s)}
                           for st in self.steps], **self.state}
        files = {"state.json": self.state, "sparse_long.json": record}
        for name, obj in files.items():
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(json.dumps(obj, indent=1) + "\n")
            tmp.replace(self.out / name)
        (self.out / "sparse_long.md").write_text(markdown(self.s, self.state, self.steps))
        if self.copy_to is not None:
            self.copy_to.mkdir(parents=True, exist_ok=True)
            for name in (*files, "sparse_long.md"):
                shutil.copyfile(self.out / name, self.copy_to / name)


def settings_of(s: Study) -> dict:
    """The settings a resumed study must share (its time estimates and reserve may change)."""
    return {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(s))).items() if k not in ("est", "save_reserve")}


def override(s: Study, items: list[str]) -> Study:
    """--set field=value (tuples comma-separated, `none` for an optional number)."""
    changes = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in Study.__dataclass_fields__ or key == "est":
            raise ValueError(f"--set {item}: no setting {key!r}; settings: {', '.join(Study.__dataclass_fields__)}")
        old = getattr(s, key)
        if isinstance(old, tuple):
            kind = type(old[0]) if old else str
            changes[key] = tuple(kind(v) for v in value.split(",") if v)
        elif value.lower() == "none" and key in ("layers", "max_bytes"):
            changes[key] = None
        else:
            changes[key] = type(old)(value) if old is not None else int(value)
    return dataclasses.replace(s, **changes)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.sparse_long", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the study's folder (runs, evals, state, record)")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="run steps while they fit in this many seconds, then exit 0 (leave a minute of the device "
                        "call's limit beyond it); default: no limit")
    p.add_argument("--dry-run", action="store_true", help="print every step's command with its estimate; run nothing")
    p.add_argument("--smoke", action="store_true", help="tiny model, corpus and lengths on the CPU: the pipeline")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the commands in this process (default: with --smoke only; no time budget inside one)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change a Study setting")
    p.add_argument("--copy-to", type=Path, help="copy state.json, sparse_long.json and .md here after every step")
    p.add_argument("--state-from", type=Path, help="a carried state.json, used where DIR has none or an older one")
    p.add_argument("--max-commands", type=int, default=None, help="run at most this many commands (tests)")
    args = p.parse_args(argv)
    try:
        s = override(SMOKE if args.smoke else FULL, args.set)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps = plan(s, args.out)
    if args.dry_run:
        dry_run(steps)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    state_path = args.out / "state.json"
    if args.state_from is not None and args.state_from.is_file():
        carried = json.loads(args.state_from.read_text())
        if not state_path.is_file() or json.loads(state_path.read_text())["revision"] < carried["revision"]:
            shutil.copyfile(args.state_from, state_path)
    if state_path.is_file() and json.loads(state_path.read_text())["settings"] != settings_of(s):
        old = json.loads(state_path.read_text())["settings"]
        diff = {k: (old.get(k), v) for k, v in settings_of(s).items() if old.get(k) != v}
        print(f"error: {args.out} holds a study with other settings (then, now): {diff}", file=sys.stderr)
        return 2
    command = "python -m benchmarks.studies.sparse_long " + shlex.join(argv)
    in_process = args.smoke if args.in_process is None else args.in_process
    driver = Driver(s, args.out, steps, args.budget_seconds, in_process, args.copy_to, args.max_commands, command)
    rc = 0
    try:
        driver.go()
        print(f"=== the study is complete: {args.out}/sparse_long.md")
    except Stop as e:
        print(f"=== stopping: {e}")
    except Failed as e:
        print(f"error: {e}", file=sys.stderr)
        rc = 1
    driver.save()
    status = driver.state["steps"]
    left = [st for st in steps if status.get(st.name, {}).get("status") != "done"]
    print(f"=== {len(steps) - len(left)} of {len(steps)} steps done"
          + (f"; next: {left[0].name} (group {left[0].group}), about {sum(st.est_s for st in left) / 60:.0f} min of "
             "steps left" if left else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
