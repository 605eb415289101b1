"""Unsloth beside oomb: QLoRA training steps of a random-init Llama-3-8B under Unsloth's FastLanguageModel.

    python -m benchmarks.unsloth_step --lengths 16384,32768,65536 --out out/unsloth-llama-3-8b.json
    python -m benchmarks.unsloth_step --longest --start 131072 --budget-s 540 --out out/unsloth-llama-3-8b-longest.json
    python -m benchmarks.unsloth_step --preset qwen2.5-7b --base bf16 --rank 16 --alpha 32 --optimizer adamw \
        --packed-data DIR/chat.jsonl --lengths 4096 --repeats 3 --out out/unsloth-packed.json  # benchmarks.packed's

The model: the preset's architecture (``--preset``, default llama-3-8b) with random weights in bf16, saved once as
a model folder (safetensors shards and oomb's byte-level tokenizer, its embedding keeps the preset's 128256 rows)
in ``--model-dir`` (default: /tmp/oomb-unsloth/PRESET) by a process of its own. Unsloth loads it as its docs load a
model for QLoRA: ``FastLanguageModel.from_pretrained(max_seq_length=the longest length, dtype=bfloat16,
load_in_4bit=True)``, then ``FastLanguageModel.get_peft_model(r=32, lora_alpha=32, lora_dropout=0, bias="none",
target_modules=the seven linear layers of each block, use_gradient_checkpointing="unsloth")`` (Unsloth's own
checkpointing, which keeps each layer's input in host memory). ``--base bf16``: LoRA on a bf16 base
(``load_in_16bit=True``); ``--full``: every weight trained, ``full_finetuning=True`` in bf16 (no adapters; Unsloth's
checkpointing all the same). Llama-3-8B knows 8192 positions: for a longer
max_seq_length Unsloth scales its RoPE itself (linear), as it does for a user.

A step, as transformers' Trainer runs Unsloth's notebooks (bf16=True, max_grad_norm=1.0, optim="adamw_8bit"):
one sequence of random token ids (batch 1), labels = the ids, the forward under bf16 autocast, loss.backward(),
gradient clipping to norm 1, the optimizer's step and zero_grad. The optimizer: bitsandbytes' AdamW8bit (lr 2e-4,
weight decay 0.01), or torch's fused AdamW with ``--optimizer adamw`` (the Trainer's default, adamw_torch_fused).
``--packed-data chat.jsonl`` (chat.jinja beside it): each step reads the next sequence of oomb's packer over those
conversations instead (benchmarks.packed: the sequences the stack and `oomb train` read), labels on the replies
only, position_ids restarting at each conversation and no attention mask: Unsloth's padding-free packing, which
finds the conversations' bounds from position_ids and attends within each (as TRL's ``padding_free`` hands it
batches). Each length: one warm-up step (Triton kernels and
Unsloth's torch.compile'd loss built, the allocator grown), then ``--repeats`` timed steps (CUDA events), median;
peak = max_memory_allocated of the timed steps. An out-of-memory error is an error row and ends the run (longer
sequences need more).

``--longest``: the longest sequence whose step completes, each try in a process of its own (an out-of-memory
error can leave a process unusable; the host's out-of-memory killer ends one): from ``--start``, doubling until a
try fails, then bisection down to ``--resolution`` tokens, within ``--budget-s`` seconds of wall clock (a try is
not started when the last one says it would not end in time, and is killed when the budget runs out). A try runs
one step at its length, timed (its first: compilation included). ``--known-fits``/``--known-fails`` carry the
bounds of an earlier call on, so one search can span several device calls.

Unsloth must be imported before transformers, peft and trl (it patches them; imported after, it warns that it
may run slower or use more memory): nothing this module imports at its top imports them, and a step process
imports benchmarks.common (which imports transformers through oomb) only after ``import unsloth``. Set before
that import unless already set (UNSLOTH_ENV): no hub lookups or usage statistics (the device has no network),
Unsloth's generated modules in /tmp, not in the checkout. Unsloth sets PYTORCH_ALLOC_CONF=expandable_segments:True
itself where it is unset (the record says what the step ran with).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

MODULE = "benchmarks.unsloth_step"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LEARNING_RATE = 2e-4
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
OPTIMIZERS = ("adamw8bit", "adamw")
BASES = ("nf4", "bf16")
MARKER = "oomb-unsloth.json"  # written last into a model folder: the folder is whole
PAD_TOKEN = "<|pad|>"

UNSLOTH_ENV = {
    "HF_HUB_OFFLINE": "1",  # no hub lookups (the device has no network: each would wait for its timeout)
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",  # from_pretrained otherwise downloads a README from the hub for its counts
    "UNSLOTH_COMPILE_LOCATION": "/tmp/unsloth_compiled_cache",  # its generated modules (default: ./, the checkout)
    "TOKENIZERS_PARALLELISM": "false",
}
# What the record keeps of the step process's environment (Unsloth sets some of these itself).
RECORDED_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "UNSLOTH_COMPILE_LOCATION", "UNSLOTH_ENABLE_CCE",
                "UNSLOTH_DISABLE_STATISTICS", "HF_HUB_OFFLINE", "TORCHINDUCTOR_CACHE_DIR")
# Distributions beside benchmarks.common.RECORDED_DISTRIBUTIONS that decide what Unsloth's step runs.
UNSLOTH_DISTRIBUTIONS = ("unsloth", "unsloth_zoo", "bitsandbytes", "peft", "trl", "accelerate", "datasets",
                         "xformers", "flash-attn")

# --- the longest search (pure: a runner stands in for the processes) --------------------------------------------

# A try's outcome, from its row: ok; oom (CUDA out of memory) and killed (by a signal: the host's out-of-memory
# killer) bound the longest from above; timeout (killed when the budget ran out) and error end the search.
FAILED = ("oom", "killed")
ESTIMATE_EXPONENT = 2.0  # a try's step time grows as (length ratio) ** this (attention's quadratic cost: pessimistic)


def row_status(row: dict) -> str:
    """ok, oom, killed, timeout or error: what a row says of its step."""
    error = row.get("error")
    if error is None:
        return "ok"
    for status, prefix in (("oom", "out of memory"), ("killed", "killed"), ("timeout", "timeout")):
        if error.startswith(prefix):
            return status
    return "error"


def align_down(n: int, align: int) -> int:
    """n rounded down to a multiple of align (at least align)."""
    return max(align, n // align * align)


def estimate_try_s(tries: list[dict], n: int) -> float | None:
    """Seconds a try at n tokens would take: the process's cost outside its steps (the cheapest try's wall time less
    its steps) plus the longest completed step scaled by (n / its length) ** ESTIMATE_EXPONENT; None before any
    step completed."""
    done = [r for r in tries if row_status(r) == "ok" and r.get("step_s") is not None]
    if not done:
        return None
    ref = max(done, key=lambda r: r["seq_len"])
    overheads = []
    for _, rows in itertools.groupby(sorted(tries, key=lambda r: r.get("try", 0)), key=lambda r: r.get("try", 0)):
        rows = list(rows)
        if "try_wall_s" in rows[0]:
            steps = sum(r.get("step_s") or 0.0 for r in rows) + sum(r.get("warmup_s") or 0.0 for r in rows)
            overheads.append(max(0.0, rows[0]["try_wall_s"] - steps))
    overhead = min(overheads) if overheads else 0.0
    return overhead + ref["step_s"] * (n / ref["seq_len"]) ** ESTIMATE_EXPONENT


def longest_search(run: Callable[[list[int], float], list[dict]], *, start: int, max_length: int, resolution: int,
                   align: int, budget_s: float, min_try_s: float = 60.0, factor: int = 2,
                   grow_in_one_process: bool = False, known_fits: int | None = None,
                   known_fails: int | None = None, clock: Callable[[], float] = time.monotonic) -> dict:
    """The longest length whose step completes.

    ``run(lengths, timeout_s)`` runs the lengths in order in one process and returns a row for each it tried, up
    to the first that failed (a row with "error"); it adds a row for a length whose process died or ran out of
    time. Doubling from ``start`` (or past ``known_fits`` where start is not longer) until a try fails (each
    length a process of its own, or the whole doubling in one with ``grow_in_one_process``: it stops at its first
    failure), halving instead while nothing fits, then bisection between the longest that fit and the shortest that
    failed until they are at most ``resolution`` apart; lengths are multiples of ``align``. A try is not started
    with less than ``min_try_s`` seconds of ``budget_s`` left, nor when ``estimate_try_s`` says it would not end
    in time.

    Returns ``longest_ok``, ``shortest_failed`` (None where none), ``stopped`` (why the search ended: resolved,
    max_length, budget, timeout, error or nothing_fits), ``stop_detail``, every try's rows (``tries``, each with
    its ``status``) and the seconds spent.
    """
    t0 = clock()
    tries: list[dict] = []
    lo, hi = known_fits, known_fails
    if lo is not None and hi is not None and lo >= hi:
        raise ValueError(f"known_fits {lo} must be shorter than known_fails {hi}")
    detail = ""

    def attempt(lengths: list[int]) -> list[dict] | None:
        nonlocal detail
        left = budget_s - (clock() - t0)
        need = estimate_try_s(tries, lengths[0])
        if left < min_try_s or (need is not None and need > left):
            detail = (f"{left:.0f} s left, a try at {lengths[0]} tokens needs "
                      + (f"about {need:.0f} s" if need is not None else f"at least {min_try_s:.0f} s"))
            return None
        rows = run(lengths, left)
        if not rows:
            raise RuntimeError(f"the runner returned no row for {lengths}")
        for row in rows:
            tries.append({**row, "status": row_status(row)})
        return rows

    def outcome(rows: list[dict] | None) -> str | None:
        """Moves the bounds by a try's rows; returns why the search stops, or None."""
        nonlocal lo, hi, detail
        if rows is None:
            return "budget"
        for row in rows:
            status = row_status(row)
            if status == "ok":
                lo = max(lo or 0, row["seq_len"])
            elif status in FAILED:
                hi = row["seq_len"] if hi is None else min(hi, row["seq_len"])
                return None
            else:
                detail = f"{row['seq_len']} tokens: {row['error']}"
                return status
        return None

    stopped = None
    # Doubling (from start, or past the longest known to fit), while no try has failed.
    n = start if lo is None or start > lo else lo * factor
    while stopped is None and hi is None:
        if n > max_length:
            stopped, detail = "max_length", f"every length tried up to {max_length} fits"
            break
        lengths = [n]
        while grow_in_one_process and lengths[-1] * factor <= max_length:
            lengths.append(lengths[-1] * factor)
        stopped = outcome(attempt(lengths))
        n = (lo or n) * factor
    # Halving while nothing fits.
    while stopped is None and lo is None:
        n = align_down(hi // factor, align)
        if n >= hi:
            stopped, detail = "nothing_fits", f"{hi} tokens fail, the shortest to try"
            break
        stopped = outcome(attempt([n]))
    # Bisection.
    while stopped is None and hi - lo > resolution:
        mid = align_down((lo + hi) // 2, align)
        if mid <= lo:
            break  # no multiple of align between the bounds
        stopped = outcome(attempt([mid]))
    if stopped is None:
        stopped, detail = "resolved", f"{lo} tokens fit, {hi} fail"
    return {"longest_ok": lo, "shortest_failed": hi, "stopped": stopped, "stop_detail": detail,
            "resolution": resolution, "budget_s": budget_s, "elapsed_s": clock() - t0, "tries": tries}


def memory_fit(rows: list[dict], capacity_gib: float | None) -> dict | None:
    """Peak GPU memory against length, a least-squares line through the completed rows (a step's activations grow
    linearly with its length: Unsloth's checkpointing, chunked loss, flash-style attention), and the length at which
    it reaches ``capacity_gib`` (the card's memory): where to start --longest. None with fewer than two lengths."""
    points = sorted({r["seq_len"]: r["peak_gpu_gib"] for r in rows
                     if "error" not in r and r.get("peak_gpu_gib") is not None}.items())
    if len(points) < 2:
        return None
    xs, ys = zip(*points, strict=True)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    base = my - slope * mx
    reach = (capacity_gib - base) / slope if capacity_gib is not None and slope > 0 else None
    return {"gib_per_1k_tokens": slope * 1024, "base_gib": base, "capacity_gib": capacity_gib,
            "reaches_capacity_at": int(reach) if reach is not None else None, "lengths": list(xs)}


# --- arguments -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3-8b", help="oomb's model preset (oomb/train/presets/)")
    p.add_argument("--model-dir", default=None,
                   help="the model folder (built and saved there if it is not whole; default /tmp/oomb-unsloth/PRESET)")
    p.add_argument("--lengths", default=None, help="sequence lengths, comma-separated (e.g. 16384,65536)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per length")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one untimed step at each length first (--no-warmup: the first step is timed)")
    p.add_argument("--base", choices=BASES, default=None,
                   help="the frozen base under the adapters: nf4 (4-bit, QLoRA; the default) or bf16 (LoRA)")
    p.add_argument("--full", action="store_true",
                   help="every weight trained in bf16 (full_finetuning=True), no adapters")
    p.add_argument("--packed-data", default=None,
                   help="chat.jsonl (chat.jinja beside it): steps on oomb's packed sequences of it, not random ids")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank")
    p.add_argument("--alpha", type=int, default=32, help="LoRA alpha")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw8bit",
                   help="bitsandbytes' AdamW8bit (Unsloth's notebooks: optim='adamw_8bit') or torch's AdamW")
    p.add_argument("--tiled-mlp", action="store_true",
                   help="Unsloth's tiled MLP (from_pretrained(unsloth_tiled_mlp=True)): less memory, slower")
    p.add_argument("--out", default=None, help="write the JSON record here (rewritten after each length)")
    g = p.add_argument_group("--longest: the longest length whose step completes")
    g.add_argument("--longest", action="store_true")
    g.add_argument("--start", type=int, default=65536, help="the first length tried")
    g.add_argument("--max-length", type=int, default=1 << 20, help="no try longer than this")
    g.add_argument("--resolution", type=int, default=8192, help="stop once the bounds are this close")
    g.add_argument("--align", type=int, default=1024, help="tried lengths are multiples of this")
    g.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock seconds for the whole run (the model folder built in it counts)")
    g.add_argument("--min-try-s", type=float, default=60.0, help="start no try with less time than this left")
    g.add_argument("--grow-in-one-process", action="store_true",
                   help="the doubling lengths in one process (it stops at its first failure): one model load")
    g.add_argument("--known-fits", type=int, default=None, help="a length an earlier run found to fit")
    g.add_argument("--known-fails", type=int, default=None, help="a length an earlier run found to fail")
    g.add_argument("--work-dir", default=None, help="each try's record and log (default: a new temporary folder)")
    p.add_argument("--prepare-model", action="store_true", help=argparse.SUPPRESS)  # the model folder's own process
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.model_dir is None:
        args.model_dir = str(Path(tempfile.gettempdir()) / "oomb-unsloth" / args.preset)
    if not (args.longest or args.prepare_model) and not args.lengths:
        p.error("give --lengths, or --longest")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.known_fits is not None and args.known_fails is not None and args.known_fits >= args.known_fails:
        p.error("--known-fits must be shorter than --known-fails")
    if args.full and args.base == "nf4":
        p.error("--full trains every weight in bf16: leave out --base nf4")
    args.base = "bf16" if args.full else (args.base or "nf4")
    if args.packed_data is not None and not Path(args.packed_data).with_name("chat.jinja").is_file():
        p.error(f"--packed-data {args.packed_data}: no chat.jinja beside it (benchmarks.packed writes both)")
    return args


def settings(args) -> dict:
    """What the record says a step ran: the model, the adapters, the optimizer, the step."""
    lora = None if args.full else {"r": args.rank, "alpha": args.alpha, "dropout": 0.0, "bias": "none",
                                   "targets": TARGET_MODULES}
    data = ({"packed": str(args.packed_data), "labels": "the replies' tokens", "position_ids": "per conversation"}
            if args.packed_data else {"labels": "input ids (random)"})
    return {"preset": args.preset, "model_dir": str(args.model_dir), "init": "random",
            "load_in_4bit": args.base == "nf4", "full_finetuning": args.full, "dtype": "bfloat16", "lora": lora,
            "gradient_checkpointing": "unsloth", "tiled_mlp": args.tiled_mlp, "optimizer": args.optimizer,
            "lr": LEARNING_RATE, "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM, "autocast": "bfloat16",
            "batch": 1, **data, "warmup_step": args.warmup, "repeats": args.repeats}


def system_name(args) -> str:
    """unsloth-qlora-r32 (the default), unsloth-lora-r16 (--base bf16), unsloth-full (--full); -tiled-mlp added."""
    name = "unsloth-full" if args.full else f"unsloth-{'qlora' if args.base == 'nf4' else 'lora'}-r{args.rank}"
    return name + ("-tiled-mlp" if args.tiled_mlp else "")


def build_record(args, rows: list[dict], *, complete: bool, setup: dict | None = None,
                 longest: dict | None = None) -> dict:
    """The JSON record, as the other benchmarks write theirs: bench, command, date, machine, versions, settings,
    the rows (``results``); ``unsloth``: what the step process found (load time, attention kernels, environment);
    ``memory_fit``: peak memory against length and where it reaches the card's memory; ``longest``: the search's
    outcome (its tries are the rows)."""
    from benchmarks.common import command_line, installed_versions, library_versions, machine_description

    record = {
        "bench": "unsloth",
        "complete": complete,
        "command": command_line(MODULE, args.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": {**library_versions(), **installed_versions(UNSLOTH_DISTRIBUTIONS)},
        "settings": settings(args),
        "unsloth": setup or {},
        "results": rows,
    }
    capacity = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None
    record["memory_fit"] = memory_fit(rows, capacity)
    if longest is not None:
        record["longest"] = {k: v for k, v in longest.items() if k != "tries"}
    return record


# --- the model folder ----------------------------------------------------------------------------------------------


def model_dir_ready(folder: str | Path, preset: str) -> bool:
    """Whether ``folder`` holds a whole model folder of ``preset`` (its marker is written last)."""
    marker = Path(folder) / MARKER
    try:
        return json.loads(marker.read_text()).get("preset") == preset and (Path(folder) / "config.json").is_file()
    except (OSError, ValueError):
        return False


def save_model_dir(folder: str | Path, preset: str, *, config=None, device: str | None = None) -> None:
    """The preset with random weights in bf16, saved as a model folder (safetensors shards of at most 5 GB, oomb's
    byte-level tokenizer with a pad token), written beside ``folder`` and renamed into place once whole.
    ``config``: the preset's config changed (tests: a tiny one)."""
    from oomb.train.config.presets import build_model
    from oomb.train.data.corpus import byte_level_tokenizer

    folder = Path(folder)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    torch.manual_seed(0)
    model = build_model(preset, dtype=torch.bfloat16, device=device, config=config)
    model.save_pretrained(partial, max_shard_size="5GB")
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})  # Unsloth adds one to a tokenizer without
    tokenizer.save_pretrained(partial)
    (partial / MARKER).write_text(json.dumps({"preset": preset, "vocab_size": model.config.vocab_size,
                                              "weights": "random init, bf16"}))
    del model
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)


def ensure_model_dir(args) -> float:
    """Builds the model folder in a process of its own where it is not whole (so the step's process starts with an
    empty GPU and imports Unsloth first); returns the seconds it took (0 when it was there)."""
    if model_dir_ready(args.model_dir, args.preset):
        return 0.0
    print(f"building {args.preset} (random init, bf16) into {args.model_dir}", flush=True)
    t = time.monotonic()
    Path(args.model_dir).parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", MODULE, "--prepare-model", "--preset", args.preset,
                    "--model-dir", str(args.model_dir)], check=True)
    return time.monotonic() - t


# --- one process: Unsloth's steps ----------------------------------------------------------------------------------


def import_unsloth():
    """``import unsloth`` with UNSLOTH_ENV set first, refused where transformers, peft or trl came first."""
    for key, value in UNSLOTH_ENV.items():
        os.environ.setdefault(key, value)
    early = [m for m in ("transformers", "peft", "trl") if m in sys.modules]
    if early:
        raise RuntimeError(f"{', '.join(early)} imported before unsloth: its patches would be missing from the step")
    import unsloth

    return unsloth


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def error_text(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"out of memory: {first}" if is_oom(e) else f"{type(e).__name__}: {first}"


def attention_kernels() -> dict:
    """Which attention kernels Unsloth found (it runs torch SDPA where it finds neither)."""
    found = {}
    for key, module, name in (("flash_attn_2", "unsloth.models._utils", "HAS_FLASH_ATTENTION"),
                              ("xformers", "unsloth.utils.attention_dispatch", "HAS_XFORMERS")):
        try:
            found[key] = bool(getattr(__import__(module, fromlist=[name]), name))
        except Exception as e:  # a renamed flag: say so rather than fail the run
            found[key] = f"unknown ({type(e).__name__})"
    return found


def load_model(args, max_seq_length: int):
    """Unsloth's model, as its docs build one: QLoRA, LoRA on a bf16 base, or a full fine-tune."""
    from unsloth import FastLanguageModel

    kwargs = {"unsloth_tiled_mlp": True} if args.tiled_mlp else {}
    if args.full:
        model, _tokenizer = FastLanguageModel.from_pretrained(
            model_name=str(args.model_dir), max_seq_length=max_seq_length, dtype=torch.bfloat16, load_in_4bit=False,
            full_finetuning=True, use_gradient_checkpointing="unsloth", **kwargs)
        FastLanguageModel.for_training(model)
        return model
    model, _tokenizer = FastLanguageModel.from_pretrained(model_name=str(args.model_dir), max_seq_length=max_seq_length,
                                                          dtype=torch.bfloat16, load_in_4bit=args.base == "nf4",
                                                          load_in_16bit=args.base == "bf16", **kwargs)
    model = FastLanguageModel.get_peft_model(model, r=args.rank, target_modules=TARGET_MODULES, lora_alpha=args.alpha,
                                             lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth",
                                             random_state=3407, max_seq_length=max_seq_length)
    FastLanguageModel.for_training(model)
    return model


def make_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    return torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, fused=torch.cuda.is_available())


def step_inputs(args, vocab_size: int, n: int, device: str = "cuda") -> Callable[[], tuple]:
    """``next_inputs()`` -> (input_ids, labels, position_ids or None) of one step at ``n`` tokens: the same random
    ids every step, or with ``--packed-data`` the packer's next sequence (benchmarks.packed.packed_batches) with
    its labels and positions restarting at each conversation."""
    if args.packed_data is None:
        ids = torch.randint(0, vocab_size, (1, n), device=device)
        return lambda: (ids, ids, None)
    from benchmarks.packed import packed_batches, position_ids_of  # imports oomb: after unsloth

    data = Path(args.packed_data)
    corpus = packed_batches(args.preset, n, data, data.with_name("chat.jinja"))

    def next_inputs():
        batch = corpus.batch(1)
        return (batch.input_ids.to(device), batch.labels.to(device), position_ids_of(batch.doc_ids).to(device))

    return next_inputs


def run_lengths(args, started: float) -> int:
    if not torch.cuda.is_available():
        print("the unsloth benchmark needs a CUDA GPU (benchmarks/README.md: how to run it on one)", file=sys.stderr)
        return 2
    built_s = ensure_model_dir(args)
    t = time.monotonic()
    unsloth = import_unsloth()
    import_s = time.monotonic() - t
    from benchmarks.common import GpuClocks, int_list, time_steps, write_report

    lengths = int_list(args.lengths)
    t = time.monotonic()
    model = load_model(args, max(lengths))
    load_s = time.monotonic() - t
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(args.optimizer, params)
    setup = {"version": getattr(unsloth, "__version__", None), "attention": attention_kernels(),
             "env": {k: os.environ.get(k) for k in RECORDED_ENV}, "model_dir_built_s": built_s,
             "import_s": import_s, "load_s": load_s, "trainable_params": sum(p.numel() for p in params),
             "trainable_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
             "vocab_rows": model.get_input_embeddings().weight.shape[0], "max_seq_length": max(lengths),
             "rope_scaling": str(getattr(model.config, "rope_scaling", None)),
             "to_first_step_s": time.monotonic() - started}
    print(json.dumps({"unsloth": setup}), flush=True)
    rows: list[dict] = []
    loss: list[torch.Tensor] = []

    def step(next_inputs) -> None:
        ids, labels, position_ids = next_inputs()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=labels, position_ids=position_ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss[:] = [out.loss.detach()]

    failed_otherwise = False
    for n in lengths:
        row: dict = {"system": system_name(args), "seq_len": n, "load_s": load_s}
        try:
            inputs = step_inputs(args, model.config.vocab_size, n)
            if args.warmup:
                row["warmup_s"] = time_steps(lambda inputs=inputs: step(inputs), 1)[0]
            torch.cuda.reset_peak_memory_stats()
            with GpuClocks() as clocks:
                times = time_steps(lambda inputs=inputs: step(inputs), args.repeats)
            row.update(step_s=statistics.median(times), step_times_s=times, first_step_timed=not args.warmup,
                       tokens_per_s=n / statistics.median(times),
                       peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30,
                       peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                       loss=float(loss[0]), gpu_clocks=clocks.summary())
        except Exception as e:  # out of memory, or Unsloth failing: an error row, and the run ends
            row["error"] = error_text(e)
            failed_otherwise = not is_oom(e)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_times_s"}), flush=True)
        if args.out:
            write_report(args.out, build_record(args, rows, complete=False, setup=setup))
        inputs = None
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        if "error" in row:
            break
    if args.out:
        write_report(args.out, build_record(args, rows, complete=True, setup=setup))
    return 1 if failed_otherwise else 0


# --- --longest: each try a process --------------------------------------------------------------------------------


def try_command(args, lengths: list[int], out: Path) -> list[str]:
    """The arguments (after the interpreter) of one try's process: one timed step at each length."""
    cmd = ["-m", MODULE, "--preset", args.preset, "--model-dir", str(args.model_dir),
           "--lengths", ",".join(str(n) for n in lengths), "--repeats", "1", "--no-warmup",
           "--rank", str(args.rank), "--alpha", str(args.alpha), "--optimizer", args.optimizer, "--out", str(out)]
    cmd += ["--full"] if args.full else ["--base", args.base]
    cmd += ["--packed-data", str(args.packed_data)] if args.packed_data else []
    return cmd + (["--tiled-mlp"] if args.tiled_mlp else [])


def subprocess_runner(args, folder: Path, command: Callable[[list[int], Path], list[str]] | None = None,
                      ) -> Callable[[list[int], float], list[dict]]:
    """``run(lengths, timeout_s)`` for longest_search: each call a process of its own (``command(lengths, out)``:
    its command line, default ``try_command`` under this interpreter), killed with its process group past
    ``timeout_s``. Its rows come from the record it writes after each length; a length it did not report gets a row
    saying why (timeout, killed by a signal, or its exit code) with the last line of its log."""
    if command is None:
        def command(lengths: list[int], out: Path) -> list[str]:
            return [sys.executable, *try_command(args, lengths, out)]
    counter = itertools.count()
    folder.mkdir(parents=True, exist_ok=True)

    def run(lengths: list[int], timeout_s: float) -> list[dict]:
        i = next(counter)
        out, log = folder / f"try{i}.json", folder / f"try{i}.log"
        print(f"try {i}: {','.join(str(n) for n in lengths)} tokens ({timeout_s:.0f} s left)", flush=True)
        t = time.monotonic()
        why = None
        with open(log, "w") as f:
            proc = subprocess.Popen(command(lengths, out), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, timeout_s))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
                why = f"timeout: killed after {timeout_s:.0f} s (the budget ran out)"
        wall = time.monotonic() - t
        try:
            rows = json.loads(out.read_text())["results"]
        except (OSError, ValueError, KeyError):
            rows = []
        reported = {r["seq_len"] for r in rows}
        missing = [n for n in lengths if n not in reported]
        if missing and not any("error" in r for r in rows):
            if why is None:
                why = (f"killed by signal {-rc} (SIGKILL: the host's out-of-memory killer?)" if rc < 0
                       else f"exit code {rc}")
            lines = log.read_text(errors="replace").strip().splitlines()
            rows.append({"system": system_name(args), "seq_len": missing[0],
                         "error": f"{why}; {log}: {lines[-1][:300] if lines else '(no output)'}"})
        for row in rows:
            row["try"], row["try_wall_s"] = i, wall
            print(f"  {row['seq_len']}: {row_status(row)}, "
                  + (f"{row['step_s']:.1f} s, {row.get('peak_gpu_gib', 0):.1f} GiB" if "step_s" in row
                     else row["error"]), flush=True)
        return rows

    return run


def run_longest(args, started: float) -> int:
    if not torch.cuda.is_available():
        print("the unsloth benchmark needs a CUDA GPU (benchmarks/README.md: how to run it on one)", file=sys.stderr)
        return 2
    from benchmarks.common import write_report

    built_s = ensure_model_dir(args)
    folder = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="unsloth-longest-"))
    result = longest_search(subprocess_runner(args, folder), start=args.start, max_length=args.max_length,
                            resolution=args.resolution, align=args.align,
                            budget_s=args.budget_s - (time.monotonic() - started), min_try_s=args.min_try_s,
                            grow_in_one_process=args.grow_in_one_process, known_fits=args.known_fits,
                            known_fails=args.known_fails)
    setup = {"model_dir_built_s": built_s, "work_dir": str(folder)}
    for i in sorted({r["try"] for r in result["tries"]}):  # what the first try's process found
        try:
            setup.update(json.loads((folder / f"try{i}.json").read_text()).get("unsloth", {}))
            break
        except (OSError, ValueError):
            continue
    record = build_record(args, result["tries"], complete=True, setup=setup, longest=result)
    if args.out:
        write_report(args.out, record)
    print(json.dumps(record["longest"]), flush=True)
    return 1 if result["stopped"] == "error" else 0


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.prepare_model:
        save_model_dir(args.model_dir, args.preset)
        return 0
    if args.longest:
        return run_longest(args, started)
    return run_lengths(args, started)


if __name__ == "__main__":
    sys.exit(main())
