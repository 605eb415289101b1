"""The baseline a user picks instead of oomb: transformers, full sequence, as well tuned as they run it.

    python -m benchmarks.baseline --stack fa4 --lengths 65536,131072 --out out/fa4.json

One process per stack (benchmarks.core starts them), so what a stack patches stays out of the
others' rows:
- ``fa4``: ``attn_implementation="flash_attention_4"`` (flash-attn-4 installed; it runs on
  Hopper and Blackwell), ``sdpa``: torch SDPA (cuDNN or FlashAttention-2 as torch picks);
- both with Liger on the model (RoPE, RMSNorm, SwiGLU: ``_apply_liger_kernel_to_instance``),
  non-reentrant gradient checkpointing of every layer, and Liger's fused linear cross-entropy on
  the last hidden state (never the [tokens, vocab] logits).
Parameters bf16 with bf16 gradients held for those trained (``--trainable``), no optimizer, random
init, one sequence of random tokens: the same work as oomb's rows in benchmarks.core. Each length: one
warm-up step at that length, then ``--repeats`` timed steps (CUDA events), median; peak = max_memory_allocated of the
timed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.common import TRAINABLE, GpuClocks, int_list, set_trainable, time_steps
from benchmarks.timeline import step_profile

STACKS = {"fa4": "flash_attention_4", "sdpa": "sdpa"}


def stack_available(stack: str) -> str | None:
    """None when ``stack`` can run here, else why not."""
    if stack == "fa4":
        try:
            import flash_attn.cute  # noqa: F401  (flash-attn-4's package)
        except ImportError as e:
            return f"flash-attn-4 is not installed ({e})"
        if torch.cuda.get_device_capability()[0] < 9:
            return "flash-attn-4 needs a Hopper or Blackwell GPU"
    try:
        import liger_kernel  # noqa: F401
    except ImportError as e:
        return f"liger-kernel is not installed ({e})"
    return None


def build_stack(preset: str, stack: str, trainable: str = "all"):
    """The model as the stack runs it, and its step function ``step(ids)``."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss, _apply_liger_kernel_to_instance

    from oomb.train.config.presets import build_model

    model = build_model(preset, dtype=torch.bfloat16, device="cuda", attn_implementation=STACKS[stack])
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, trained = set_trainable(model, trainable)
    for p in trained:  # bf16 gradients held, as a trainer holds them
        p.grad = torch.zeros_like(p)
    loss_fn = LigerFusedLinearCrossEntropyLoss()
    head = model.get_output_embeddings()

    def step(ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> None:
        """One forward and backward: next-token loss on ``labels`` (default ``ids``; -100: no loss); packed
        documents by ``position_ids`` restarting at each one (transformers' flash attention then attends within
        each, as DataCollatorWithFlattening's batches do)."""
        hidden = model.get_decoder()(input_ids=ids, position_ids=position_ids, use_cache=False).last_hidden_state
        labels = ids if labels is None else labels
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        loss = loss_fn(head.weight, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1))
        loss.backward()

    return model, step


def run(args) -> list[dict]:
    why = stack_available(args.stack)
    if why is not None:
        return [{"system": f"transformers-{args.stack}", "seq_len": n, "error": why} for n in args.lengths]
    model, step = build_stack(args.preset, args.stack, args.trainable)
    rows = []
    for n in args.lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")
        row = {"system": f"transformers-{args.stack}-liger-ckpt", "seq_len": n,
               "attn_implementation": STACKS[args.stack], "trainable": args.trainable}
        try:
            step(ids)  # warm-up at this length (kernels compiled, the allocator's pools grown)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with GpuClocks() as clocks:
                times = time_steps(lambda ids=ids: step(ids), args.repeats)
            row.update(step_s=statistics.median(times), step_times_s=times,
                       peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30, gpu_clocks=clocks.summary())
            if n in args.profile_lengths:  # after the timed steps, so the profiler never touches their times
                row["profile"] = step_profile(lambda ids=ids: step(ids))
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e).splitlines()[0]}"
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_times_s", "profile")}), flush=True)
        torch.cuda.empty_cache()
        if "error" in row:
            break  # longer sequences need more
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.baseline", description=__doc__.splitlines()[0])
    p.add_argument("--stack", choices=sorted(STACKS), required=True)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--lengths", type=int_list, required=True)
    p.add_argument("--trainable", choices=TRAINABLE, default="all",
                   help="parameters trained: all, the attention layers' only, or peft LoRA r=16 on every linear layer "
                        "(lora and lora-unfused alike: a stack runs peft's own; benchmarks.common.set_trainable)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile-lengths", type=int_list, default=[],
                   help="at these lengths, one more step under torch.profiler: where its GPU time goes")
    p.add_argument("--out", required=True, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the baseline needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(args)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
