"""Tokens per second on packed chat data at the lengths most fine-tuning runs use: `oomb train` against the stack.

    python -m benchmarks.packed --preset qwen2.5-7b --lengths 4096,16384,32768 --out out/packed-7b.json
    python -m benchmarks.packed --lengths 4096 --variants lora --unsloth --out out/packed-7b-4k-lora.json

Data: seeded synthetic conversations (a system line, a user turn, an assistant reply; their lengths drawn from
log-normal distributions like those of instruction-tuning sets: median reply ~1,200 tokens, a long tail to
~16K) written as chat JSONL with a chat template, read by the model's byte-level tokenizer (a random-init preset
has no tokenizer files: one token per byte). Every system reads the same samples in the same order, packed whole
into sequences of ``--lengths`` tokens by oomb's own packer (loss on the assistant's tokens, attention within
each conversation).

Rows, each (length, variant) in a process of its own, one after the other on one GPU:
- ``oomb train`` as a user runs it (``benchmarks.train_steps``): model.preset, data.task=chat and the data's
  keys, the variant's keys, everything else at its default (chunk, batch size, attention cache chosen by its
  memory plan); AdamW included. Tokens per step: its batch size x grad_accum x length. With ``--one-chunk``
  also with train.chunk_size = the length where its own chunk is shorter (whether one chunk a sequence wins).
- the stack (``--stack``, default fa4: transformers + flash_attention_4, or sdpa): Liger's fused ops and fused
  linear cross-entropy, non-reentrant checkpointing, one packed sequence a step with position_ids restarting at
  each conversation (transformers' varlen flash attention), peft LoRA or every weight trained as the variant
  says, torch's fused AdamW on the trained parameters after each backward.
- Unsloth (``--unsloth``: benchmarks.unsloth_step in a process of its own with ``--unsloth-path`` on its
  PYTHONPATH, dev/unsloth-device.md): the preset saved as a model folder, LoRA on a bf16 base or
  ``full_finetuning``, its own checkpointing, the same packed sequences with position_ids restarting at each
  conversation (its padding-free packing), torch's fused AdamW, gradient clipping as its notebooks' Trainer does.

Variants: ``full`` (every weight) and ``lora`` (r=16 on every linear layer, as `lora.r=16
lora.targets=all-linear`). The record's ``versus_baselines`` gives, for each oomb row, its tokens per second over
each other system's at the same length and variant, and over the fastest of them (oomb is meant to be at least 1.0
against the fastest).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import LORA_RANK, command_line, int_list, machine_description, write_report

ROOT = Path(__file__).resolve().parents[1]

# Words the conversations are made of: ASCII, so the byte-level tokenizer's token count is the character count.
WORDS = ("the of and to in is that for it as with was on be by this are or from at an which have not has but "
         "function return value model train data loss token context memory page chunk layer attention gradient "
         "step batch sequence length write read file folder run checkpoint resume export config key error").split()
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# variant -> (oomb train keys, what the stack trains: benchmarks.common.TRAINABLE)
VARIANTS = {"full": ("", "all"), "lora": (f"lora.r={LORA_RANK} lora.targets=all-linear", "lora-unfused")}


def _text(rng: random.Random, chars: int) -> str:
    words, n = [], 0
    while n < chars:
        word = rng.choice(WORDS)
        words.append(word)
        n += len(word) + 1
    return " ".join(words)[:chars]


def conversation_lengths(rng: random.Random) -> tuple[int, int]:
    """(prompt, reply) characters of one conversation: log-normal, medians 400 and 1,200, clipped."""
    prompt = int(min(max(rng.lognormvariate(math.log(400), 1.0), 16), 8000))
    reply = int(min(max(rng.lognormvariate(math.log(1200), 0.9), 16), 16000))
    return prompt, reply


def write_chat_data(folder: Path, conversations: int, seed: int = 0) -> tuple[Path, Path]:
    """chat.jsonl (``conversations`` rows) and chat.jinja in ``folder``; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    data, template = folder / "chat.jsonl", folder / "chat.jinja"
    with open(data, "w") as f:
        for _ in range(conversations):
            prompt, reply = conversation_lengths(rng)
            messages = [{"role": "system", "content": "You are a careful assistant."},
                        {"role": "user", "content": _text(rng, prompt)},
                        {"role": "assistant", "content": _text(rng, reply)}]
            f.write(json.dumps({"messages": messages}) + "\n")
    template.write_text(TEMPLATE)
    return data, template


def data_keys(data: Path, template: Path) -> str:
    """The oomb train keys that read the data (and every stack row reads it as they say)."""
    return f"data.task=chat data.paths=[{data}] data.chat_template={template}"


def position_ids_of(doc_ids):
    """Each token's position within its document: 0 at every document's first token (doc_ids [B, N])."""
    import torch

    n = doc_ids.shape[1]
    index = torch.arange(n, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def packed_batches(preset: str, seq_len: int, data: Path, template: Path):
    """oomb's packer over the data, as `oomb train` reads it: an endless ``batch(1)`` source of TextBatch."""
    from oomb.train.config.settings import load_config
    from oomb.train.data.chat_packing import ChatCorpus
    from oomb.train.data.inputs import wanted_tokenizer

    cfg = load_config(None, [f"model.preset={preset}", f"data.seq_len={seq_len}", *data_keys(data, template).split()])
    return ChatCorpus([str(data)], wanted_tokenizer(cfg), seq_len, template=template.read_text(), seed=cfg.train.seed)


def stack_row(args) -> dict:
    """One stack row (this process): warm-up, then --repeats timed steps on the next packed sequences."""
    import torch

    from benchmarks.baseline import STACKS, build_stack, stack_available
    from benchmarks.common import GpuClocks, time_steps

    n, variant = args.stack_row[0], args.stack_row[1]
    row = {"system": f"transformers-{args.stack}-liger-ckpt", "variant": variant, "seq_len": n,
           "attn_implementation": STACKS[args.stack]}
    if (why := stack_available(args.stack)) is not None:
        return {**row, "error": why}
    model, step = build_stack(args.preset, args.stack, VARIANTS[variant][1])
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, fused=True)
    corpus = packed_batches(args.preset, n, Path(args.data), Path(args.data).with_name("chat.jinja"))
    tokens_with_loss = []

    def train_step():
        batch = corpus.batch(1)
        ids, labels = batch.input_ids.cuda(), batch.labels.cuda()
        step(ids, labels, position_ids_of(batch.doc_ids.cuda()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated, as a trainer holds them
        tokens_with_loss.append(int((batch.labels != -100).sum()))

    try:
        train_step()  # warm-up: kernels compiled, the optimizer's states made
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with GpuClocks() as clocks:
            times = time_steps(train_step, args.repeats)
        med = statistics.median(times)
        row.update(tokens_per_step=n, step_s=med, step_times_s=times, tokens_per_s=n / med,
                   peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30, gpu_clocks=clocks.summary(),
                   loss_tokens_per_step=statistics.median(tokens_with_loss[1:]))
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0]}"
    return row


def oomb_row(args, n: int, variant: str, folder: Path, one_chunk: bool = False) -> dict:
    """`oomb train` at ``n`` for ``variant``, its own settings (benchmarks.train_steps.run_length); ``one_chunk``:
    with train.chunk_size=n (one chunk a sequence), the rest its own."""
    from benchmarks.train_steps import run_length

    data = Path(args.data)
    keys = VARIANTS[variant][0] + (f" train.chunk_size={n}" if one_chunk else "")
    name = variant + ("-one-chunk" if one_chunk else "")  # its run folder's name
    row = run_length(args.preset, n, args.steps, folder, args.timeout, (name, keys),
                     data_keys(data, data.with_name("chat.jinja")))
    row["variant"] = variant
    row["system"] = "oomb train" + (", one chunk" if one_chunk else "")
    if row.get("warm_step_s"):
        row["tokens_per_step"] = n * row["batch_size"] * row["grad_accum"]
        row["tokens_per_s"] = row["tokens_per_step"] / row["warm_step_s"]
    return row


def unsloth_row(args, n: int, variant: str) -> dict:
    """Unsloth at ``n`` for ``variant`` on the same packed data (benchmarks.unsloth_step, a process of its own: it
    must import unsloth before transformers, and its path holds no flash-attn-4)."""
    row = {"system": "unsloth", "variant": variant, "seq_len": n}
    cmd = [sys.executable, "-m", "benchmarks.unsloth_step", "--preset", args.preset, "--lengths", str(n),
           "--repeats", str(args.repeats), "--optimizer", "adamw", "--packed-data", args.data]
    lora = ["--base", "bf16", "--rank", str(LORA_RANK), "--alpha", str(2 * LORA_RANK)]
    cmd += ["--full"] if variant == "full" else lora
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), args.unsloth_path])}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([*cmd, "--out", out.name], env=env, cwd=ROOT)
        try:
            record = json.loads(Path(out.name).read_text())
        except ValueError:
            return {**row, "error": f"exit {proc.returncode}, no record"}
    found = record.get("results") or [{"error": f"exit {proc.returncode}, no row"}]
    return {**row, **{k: v for k, v in found[0].items() if k not in ("system", "seq_len")},
            "unsloth_system": found[0].get("system"), "unsloth": record.get("unsloth"),
            "settings": record.get("settings")}


def versus_baselines(rows: list[dict]) -> list[dict]:
    """For each oomb row, its tokens per second over each other system's at the same length and variant where both
    ran (``ratios``), and over the fastest of them (``fastest_baseline``, ``throughput_ratio``)."""
    out = []
    for r in rows:
        if not r["system"].startswith("oomb") or not r.get("tokens_per_s"):
            continue
        others = [b for b in rows if not b["system"].startswith("oomb") and b.get("tokens_per_s")
                  and (b["seq_len"], b.get("variant")) == (r["seq_len"], r.get("variant"))]
        if not others:
            continue
        fastest = max(others, key=lambda b: b["tokens_per_s"])
        out.append({"system": r["system"], "seq_len": r["seq_len"], "variant": r["variant"],
                    "ratios": {b["system"]: r["tokens_per_s"] / b["tokens_per_s"] for b in others},
                    "fastest_baseline": fastest["system"],
                    "throughput_ratio": r["tokens_per_s"] / fastest["tokens_per_s"]})
    return out


def run(args) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="packed-"))
    if args.data is None:
        args.data = str(write_chat_data(folder / "data", args.conversations, args.seed)[0])
    rows = []

    def report() -> dict:
        return {"bench": "packed", "command": command_line("benchmarks.packed"),
                "date": datetime.date.today().isoformat(), "machine": machine_description(), "preset": args.preset,
                "data": {"conversations": args.conversations, "seed": args.seed, "template": TEMPLATE},
                "results": rows, "versus_baselines": versus_baselines(rows)}

    for n in args.lengths:
        for variant in args.variants:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                proc = subprocess.run([sys.executable, "-m", "benchmarks.packed", "--stack-row", str(n), variant,
                                       "--preset", args.preset, "--stack", args.stack, "--data", args.data,
                                       "--repeats", str(args.repeats), "--out", out.name])
                rows.append(json.loads(Path(out.name).read_text()) if proc.returncode == 0 and
                            Path(out.name).stat().st_size else
                            {"system": f"transformers-{args.stack}-liger-ckpt", "variant": variant, "seq_len": n,
                             "error": f"exit {proc.returncode}"})
            first = len(rows) - 1
            if args.unsloth:
                rows.append(unsloth_row(args, n, variant))
            rows.append(oomb_row(args, n, variant, folder))
            if args.one_chunk and rows[-1].get("chunk_size") != n:  # its own choice was not one chunk already
                rows.append(oomb_row(args, n, variant, folder, one_chunk=True))
            if args.out:
                write_report(args.out, report())
            for r in rows[first:]:
                print(json.dumps({k: v for k, v in r.items() if k not in ("steps", "startup", "step_times_s")}),
                      flush=True)
    return report()


def _variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"variants are {', '.join(VARIANTS)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.packed", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--lengths", type=int_list, default=[4096, 16384, 32768])
    p.add_argument("--variants", type=_variants, default=list(VARIANTS), help="full, lora or both (default)")
    p.add_argument("--stack", choices=("fa4", "sdpa"), default="fa4")
    p.add_argument("--unsloth", action="store_true", help="also Unsloth's rows (its packages on --unsloth-path)")
    p.add_argument("--unsloth-path", default="/tmp/unsloth_site",
                   help="the folder holding unsloth, unsloth_zoo, trl and their needs (h200.sh unpacks them)")
    p.add_argument("--steps", type=int, default=4, help="oomb train steps logged per row (the first warms up)")
    p.add_argument("--repeats", type=int, default=3, help="timed stack steps per row, after one warm-up step")
    p.add_argument("--timeout", type=float, default=240, help="seconds allowed per oomb train row")
    p.add_argument("--one-chunk", action="store_true",
                   help="also run oomb train with train.chunk_size = the length (one chunk a sequence) where its own "
                        "choice is shorter: whether one chunk wins")
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="a chat.jsonl with chat.jinja beside it (default: written anew)")
    p.add_argument("--stack-row", nargs=2, metavar=("LENGTH", "VARIANT"), default=None,
                   help=argparse.SUPPRESS)  # one stack row, in the process run() starts for it
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.stack_row is not None:
        args.stack_row = [int(args.stack_row[0]), _variants(args.stack_row[1])[0]]
        if args.data is None:
            p.error("--stack-row needs --data")
        row = stack_row(args)
        Path(args.out).write_text(json.dumps(row))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("the packed benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
