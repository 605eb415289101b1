"""What every benchmark entry point shares: list arguments, the CUDA check, the report."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from oomb.train.runfolder.checkpoint import write_text_atomic


def int_list(text: str) -> list[int]:
    """'16384,65536' -> [16384, 65536] (an argparse type)."""
    return [int(x) for x in text.split(",") if x]


def run_benchmark(name: str, args, run: Callable[[object], dict], print_table: Callable[[dict], None], *,
                  require_cuda: bool = True) -> int:
    """Refuse without CUDA (unless not ``require_cuda``), run, write the JSON report to ``args.out``
    (if given), print the table."""
    if require_cuda and not torch.cuda.is_available():
        print(f"the {name} benchmark needs a CUDA GPU (benchmarks/README.md: how to run it on one)", file=sys.stderr)
        return 2
    report = run(args)
    if args.out:
        write_report(args.out, report)
    print_table(report)
    return 0


def write_report(path: str, report: dict) -> None:
    """Write a JSON record whole (oomb's atomic write): a bench killed mid-write leaves the last one."""
    write_text_atomic(Path(path), json.dumps(report, indent=2))


def add_step_arguments(parser, *, budget: bool = True) -> None:
    """The options every step benchmark shares: model, chunking, repeats, output."""
    parser.add_argument("--preset", default="qwen2.5-7b")
    if budget:
        parser.add_argument("--budget", type=int, default=64, help="pages per query block (sparse rows)")
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--page", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the JSON report here")


def add_grad_accumulation_argument(parser) -> None:
    """--grad-accumulation for benches whose oomb rows run fused ops (``use_bench_grad_accumulation``)."""
    parser.add_argument("--grad-accumulation", default="fused", choices=["fused", "plain"],
                        help="with fused ops on CUDA: weight gradients added into .grad by their matmuls "
                             "(train.fused_grad_accumulation, as `oomb train` does) or by autograd's add (plain, as "
                             "the records measured without it)")


def bench_adds_into_grad(model, args) -> bool:
    """Whether --grad-accumulation asks for weight gradients added by their matmuls where `oomb train` would add
    them so (one process, so where ``fused_grad_accumulation_applies``)."""
    from oomb.surgery.grad_accumulation import fused_grad_accumulation_applies

    return args.grad_accumulation == "fused" and fused_grad_accumulation_applies(model, args.fused_ops)


def use_bench_grad_accumulation(model, args) -> list[str]:
    """Weight gradients added by their matmuls where ``bench_adds_into_grad``; returns the swapped linear layers'
    names."""
    from oomb.surgery.grad_accumulation import use_fused_grad_accumulation

    return use_fused_grad_accumulation(model) if bench_adds_into_grad(model, args) else []


# What a row trains (--trainable): every parameter; only the attention layers' (their q/k/v/o projections, biases,
# norms inside attention and GPT-OSS's sinks) where a model's weights and their gradients do not fit the card in
# bf16 (GPT-OSS-20B: 2 x 39 GiB); or peft LoRA adapters of rank LORA_RANK on every linear layer (experts too), as
# `oomb train lora.r=16 lora.targets=all-linear` trains them — oomb's rows with its fused LoRA layers ("lora") or
# peft's own ("lora-unfused"); a stack always runs peft's own.
TRAINABLE = ("all", "attention", "lora", "lora-unfused")
LORA_RANK = 16


def set_trainable(model, which: str) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """Freezes what ``which`` (TRAINABLE) leaves out; returns the model (peft's wrapper for LoRA) and the
    parameters left trainable. Call it before swapping in fused ops, as `oomb train` adds its adapters first."""
    if which not in TRAINABLE:
        raise ValueError(f"--trainable {which!r}: choose one of {', '.join(TRAINABLE)}")
    if which.startswith("lora"):
        import peft

        from oomb.surgery.adapters import ALL_LINEAR, lora_config

        model = peft.get_peft_model(model, lora_config(model, LORA_RANK, 2 * LORA_RANK, ALL_LINEAR))
    else:
        for name, p in model.named_parameters():
            p.requires_grad_(which == "all" or ".self_attn." in name)
    return model, [p for p in model.parameters() if p.requires_grad]


def ask_fa4_block_sparse(on: bool) -> None:
    """Page-sparse calls of the fa4 backend on FA4's block sparsity (the default) or, off, on the Triton kernels
    (oomb.kernels.flash4_calls.BLOCK_SPARSE_ENV), for a bench's --[no-]fa4-block-sparse; before the fa4 backend is
    first built (it is built once per process)."""
    from oomb.kernels.flash4_calls import BLOCK_SPARSE_ENV

    os.environ[BLOCK_SPARSE_ENV] = "1" if on else "0"


def command_line(module: str, argv: list[str] | None = None) -> str:
    """How a record's bench was invoked, as a shell would take it back (empty lists quoted: --lengths '')."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


# The distributions whose versions decide what a bench's step runs: flash-attn-4 and liger-kernel are optional (a
# machine without them runs the Triton kernels and transformers' modules), so a record names them or says absent.
RECORDED_DISTRIBUTIONS = ("torch", "triton", "transformers", "oomb", "flash-attn-4", "liger-kernel",
                          "nvidia-cutlass-dsl")


def installed_versions(names) -> dict[str, str | None]:
    """Each distribution's installed version, None where it is not installed."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def library_versions() -> dict[str, str | None]:
    """Each of RECORDED_DISTRIBUTIONS' installed version, None where it is not installed; torch as it reports
    itself (with its CUDA build, as `torch.__version__`)."""
    return {**installed_versions(RECORDED_DISTRIBUTIONS), "torch": torch.__version__}


def machine_description() -> str:
    """The machine a record was measured on, in words: GPU and its memory, host memory."""
    host = f"{psutil.virtual_memory().total / 2**30:.1f} GiB host memory"
    if not torch.cuda.is_available():
        return f"CPU only, {host}"
    props = torch.cuda.get_device_properties(0)
    return f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.1f} GiB), {host}"


def time_steps(fn, repeats: int) -> list[float]:
    """Seconds per call of ``fn``, each between CUDA events (the caller warmed up)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


class GpuClocks:
    """The GPU's SM clock, power draw and temperature while timed steps run, sampled by ``nvidia-smi`` in a process
    of its own (NVML from outside: nothing in the timed process), so that two rows' times can be told apart from
    their clocks: a step whose matrix products run at a lower clock (the card at its power limit) is slower for
    that alone. ``summary()`` is None where no sampler ran (no CUDA device or no nvidia-smi).

        with GpuClocks() as clocks:
            times = time_steps(step, repeats)
        row["gpu_clocks"] = clocks.summary()
    """

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "power.limit")

    def __init__(self, interval_ms: int = 200, command: list[str] | None = None):
        if command is None and torch.cuda.is_available() and shutil.which("nvidia-smi"):
            uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            gpu = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            command = ["nvidia-smi", f"--id={gpu}", f"--query-gpu={','.join(self.FIELDS)}",
                       "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"]
        self.command = command
        self._proc: subprocess.Popen | None = None
        self.samples: list[tuple[float, ...]] = []

    def __enter__(self) -> GpuClocks:
        if self.command:
            self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        for line in out.splitlines():
            try:
                values = tuple(float(v) for v in line.split(","))
            except ValueError:  # "[N/A]", a cut-off last line
                continue
            if len(values) == len(self.FIELDS):
                self.samples.append(values)

    def summary(self) -> dict | None:
        """Medians of the SM clock (MHz) and power draw (W), their lows, the hottest reading and the power limit."""
        if not self.samples:
            return None
        sm, power, temp, limit = zip(*self.samples, strict=True)
        return {"sm_mhz": statistics.median(sm), "sm_mhz_min": min(sm), "power_w": statistics.median(power),
                "power_limit_w": max(limit), "temp_c_max": max(temp), "samples": len(self.samples)}


def kernel_times(fn, repeats: int = 5) -> dict[str, float]:
    """Mean CUDA milliseconds per call of each kernel fn launches (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.device_time_total > 0:
            totals[evt.key[:80]] = evt.device_time_total / 1e3 / repeats
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:20])


def do_bench_s(fn, grad_to_none=None) -> float:
    """Median seconds of fn (one call first, so compilation and autotuning stay out of the timing)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median") / 1e3


def pages_moved_by_kind(store, config) -> dict | None:
    """An offloaded store's last step of host<->GPU page traffic summed over its sliding layers and its full ones
    (``store.moved_bytes_by_layer``; None for a store on the GPU): {kind: {"layers", "to_device_gib", "to_host_gib",
    "per_layer_gib"}}. A sliding layer moves its window's pages, a full one its whole past."""
    from oomb.engine.sizes import config_windows

    by_layer = getattr(store, "moved_bytes_by_layer", None)
    if by_layer is None:
        return None
    windows = config_windows(config) or (None,) * config.num_hidden_layers
    out: dict[str, dict] = {}
    for layer, window in enumerate(windows):
        kind = "window" if window else "full"
        moved = by_layer.get(layer, {"to_device": 0, "to_host": 0})
        entry = out.setdefault(kind, {"layers": 0, "to_device_gib": 0.0, "to_host_gib": 0.0})
        entry["layers"] += 1
        entry["to_device_gib"] += moved["to_device"] / 2**30
        entry["to_host_gib"] += moved["to_host"] / 2**30
    for entry in out.values():
        entry["per_layer_gib"] = (entry["to_device_gib"] + entry["to_host_gib"]) / entry["layers"]
    return out
