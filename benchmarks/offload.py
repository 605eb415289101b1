"""Offload against pages on the GPU: step time, GPU memory, pinned host memory, the planner's prediction.

    python -m benchmarks.offload --out out/offload.json
    python -m benchmarks.offload --dense-lengths 65536 --sparse-lengths 131072 \\
        --growth-lengths 65536,131072,262144,524288 --select-blocks 4096,128
    python -m benchmarks.offload --dense-lengths "" --sparse-lengths "" --growth-lengths "" \\
        --longest-lengths 1048576 --repeat-steps 20 --repeat-length 131072
    python -m benchmarks.offload --device cpu --preset tiny ...       # checks the bench, no GPU numbers

One chunked_backward step of ``--preset`` (random init, bf16, bf16 gradients kept allocated, no
optimizer) per row, after a warm-up step of the same setting at a short length (CUDA events).
Pair rows (``--steady``, the default) first run one step at their own length, timed apart as
``first_step_s``: it allocates the store and pins its host pools, which a training run does once;
the overheads are of the steps after it, as a run's steps are (``offload_overhead``), with the
first step's beside them (``offload_overhead_first_step``).
Rows, in this order (the JSON is rewritten after every row, so a run cut short keeps what it did):

1. pairs: dense with and without offload at ``--dense-lengths``; for each ``--select-blocks``
   entry (in the order given), sparse (``--budget`` pages per block of that many queries) with and
   without offload at ``--sparse-lengths``;
2. growth: for each select block, sparse + offload at ``--growth-lengths`` (a length measured
   among the pairs is not run again). GPU memory per extra 10K tokens, per select block: between
   the shortest and the longest sparse + offload step (endpoints) and as a least-squares slope
   over every one, of the peak GPU memory and of the store's device bytes;
3. longest: one sparse + offload step at each ``--longest-lengths`` (first select block). Before
   each, the memory planner must say the row fits the GPU and the host, and the bytes it will pin
   (plus ``--host-margin-gib``) must be free in host memory now; otherwise the row records why it
   was refused. A row that fails (CUDA out of memory, host memory that cannot be pinned) records
   the error and the bench goes on. ``--longest-first-fit``: the lengths are tried in the order
   given until one runs (give them longest first). ``--longest-steady``: the first step is timed
   apart (``first_step_s``) and a second one gives ``step_s``, as for pairs. ``--longest-lengths
   plan``: the longest length the planner says fits (multiples of ``--chunk``; with the settings of
   the longest rows), then 95% and 90%
   of it: the first that runs says how close the planner's longest is to what runs;
4. repeat: ``--repeat-steps`` consecutive sparse + offload steps at ``--repeat-length`` (first
   select block, the store kept between steps as in training), with RSS, pinned bytes and
   torch's pinned-allocator statistics after each; the growth from step 2 to the last (step 1
   allocates).

``--offload-gpu-memory``: the GPU memory in which every offloaded row's store keeps whole layers' pages
(StepOptions.offload_gpu_bytes; ``train.offload_gpu_memory``): a size, or ``auto``, what the row's
plan (no optimizer) leaves free on the GPU less oomb.planning.plan.AUTO_GPU_MARGIN_BYTES, so the pages fill
the GPU and the host together. Default 0: only the two working layers on the GPU, as in the paper.

``--fused-ops``: liger's fused RMSNorm, SwiGLU and RoPE as `oomb train` swaps them in (default ``auto``:
on CUDA where liger imports; the records measured without them ran ``none``). ``--no-fa4-block-sparse``:
page-sparse rows on the Triton kernels instead of FA4's block sparsity (kernels/flash4_sparse.py; as the records
measured on the Triton kernels ran them).

``--time-budget S``: rows not started within S seconds are recorded as skipped (the device scripts
give the bench a hard timeout as well). ``--device cpu --dtype float32`` runs the same rows on CPU
with wall-clock timing (tests/bench/test_offload_bench.py).

Every row carries the planner's prediction (oomb.planning.plan.plan_memory, "parameters + gradients,
no optimizer": see PLAN_NO_OPTIMIZER) beside the measurement and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass

import torch

import oomb
from benchmarks.common import (
    add_grad_accumulation_argument,
    add_step_arguments,
    ask_fa4_block_sparse,
    command_line,
    int_list,
    library_versions,
    machine_description,
    run_benchmark,
    time_steps,
    use_bench_grad_accumulation,
    write_report,
)
from benchmarks.timeline import format_profile, profile_streams, step_profile
from oomb.engine import MemoryLimits, RunShape, StepOptions, store_for_model
from oomb.kernels import get_backend
from oomb.planning.plan import AUTO_GPU_MARGIN_BYTES, plan_memory
from oomb.sparse import PageSelection
from oomb.surgery.fused_ops import MODES as FUSED_OPS_MODES
from oomb.surgery.fused_ops import use_fused_ops

GIB = 2**30
# plan_memory has no "no optimizer" setting: the rows are planned with optimizer="adamw" and
# master_weights=False, and these items (the optimizer's) are left out of the sums.
EXCLUDED_PLAN_ITEMS = ("optimizer states", "optimizer update", "master weights")
PLAN_NO_OPTIMIZER = (
    "plan_memory(optimizer='adamw', master_weights=False) minus its items "
    + ", ".join(repr(i) for i in EXCLUDED_PLAN_ITEMS)
    + " (plan_memory has no 'no optimizer' option). predicted_gpu_bytes: the GPU items without the 'CUDA "
    "context' allowance, against torch.cuda.max_memory_allocated (predicted_gpu_total_bytes includes it). "
    "predicted_host_bytes: the host items (offloaded pages + the 'process' allowance), against "
    "measured_host_bytes = store.host_nbytes() + the process RSS just before the row's step (taken after "
    "the previous store was released: the store's pools count in RSS once their pages are touched, and "
    "pinning touches them, so RSS after the step would count them twice); rss_after_bytes is the RSS "
    "after the step, and host_ratio_rss_after compares against it. ratio = predicted / measured."
)
CONTEXT_ITEM = "CUDA context"
PROCESS_ITEM = "process"


@dataclass(frozen=True)
class Setting:
    kind: str  # "pair", "growth" or "longest"
    seq_len: int
    budget: int | None  # None = dense
    block: int | None  # queries per selection block (sparse only)
    offload: bool

    @property
    def mode(self) -> str:
        return "dense" if self.budget is None else "sparse"

    @property
    def key(self) -> tuple:
        return (self.seq_len, self.budget, self.block, self.offload)

    def head(self, chunk_pages: int | None = None) -> dict:
        """The fields that open every row of this setting (``chunk_pages``: the sparse rows' cap, if any)."""
        head = {"kind": self.kind, "seq_len": self.seq_len, "mode": self.mode, "budget_pages": self.budget,
                "select_block": self.block, "offload": self.offload}
        if chunk_pages and self.budget is not None:
            head["chunk_pages"] = chunk_pages
        return head


def row_settings(dense_lengths, sparse_lengths, growth_lengths, longest_lengths, select_blocks,
                 budget) -> list[Setting]:
    """The rows in the order they run: pairs, growth per select block, longest; no setting twice."""
    rows = [Setting("pair", n, None, None, off) for n in dense_lengths for off in (False, True)]
    rows += [Setting("pair", n, budget, b, off) for b in select_blocks for n in sparse_lengths for off in (False, True)]
    seen = {s.key for s in rows}
    for b in select_blocks:
        for n in growth_lengths:
            s = Setting("growth", n, budget, b, True)
            if s.key not in seen:
                seen.add(s.key)
                rows.append(s)
    if longest_lengths:
        rows += [Setting("longest", n, budget, select_blocks[0], True) for n in longest_lengths]
    return rows


# ---------------------------------------------------------------------------- pure summaries
def least_squares_slope(xs: list[float], ys: list[float]) -> float | None:
    """Slope of the least-squares line through (xs, ys); None with fewer than two distinct xs."""
    if len(xs) != len(ys):
        raise ValueError("xs and ys differ in length")
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def _ok(row: dict) -> bool:
    return "step_s" in row


def memory_growth(rows: list[dict]) -> dict:
    """Per select block: GPU memory per extra 10K tokens of the sparse + offload rows (longest rows excluded).

    ``gpu_mib_per_10k_tokens``: peak GPU memory between the shortest and the longest row;
    ``..._lstsq``: the least-squares slope over all rows; ``store_device_...``: the same of the
    store's device bytes.
    """
    out = {}
    blocks = list(dict.fromkeys(r["select_block"] for r in rows if r["mode"] == "sparse"))  # in run order
    for block in blocks:
        pts = sorted((r for r in rows if r["mode"] == "sparse" and r["offload"] and r["select_block"] == block
                      and r.get("kind") != "longest" and _ok(r)), key=lambda r: r["seq_len"])
        if len({r["seq_len"] for r in pts}) < 2:
            continue
        lo, hi = pts[0], pts[-1]
        xs = [r["seq_len"] for r in pts]
        g = {"select_block": block, "from": lo["seq_len"], "to": hi["seq_len"], "lengths": xs,
             "peak_gpu_gib": [r["peak_gpu_gib"] for r in pts],
             "store_device_gib": [r["store_device_gib"] for r in pts]}
        for name, field in (("gpu", "peak_gpu_gib"), ("store_device", "store_device_gib")):
            ys = [r[field] for r in pts]
            if any(y is None for y in ys):
                g[f"{name}_mib_per_10k_tokens"] = g[f"{name}_mib_per_10k_tokens_lstsq"] = None
                continue
            g[f"{name}_mib_per_10k_tokens"] = (hi[field] - lo[field]) * 1024 / (hi["seq_len"] - lo["seq_len"]) * 1e4
            g[f"{name}_mib_per_10k_tokens_lstsq"] = least_squares_slope(xs, [y * 1024 for y in ys]) * 1e4
        out[str(block)] = g
    return out


def overhead_key(row: dict) -> str:
    if row["mode"] == "dense":
        return f"dense@{row['seq_len']}"
    cap = f"/chunk_pages{row['chunk_pages']}" if row.get("chunk_pages") else ""
    return f"sparse@{row['seq_len']}/block{row['select_block']}{cap}"


def offload_overheads(rows: list[dict], field: str = "step_s") -> dict:
    """Step time with offload over without, minus 1, for every setting measured both ways.

    ``field``: "step_s" (the timed steps: after a first step at the same length when the rows are
    ``steady``) or "first_step_s" (that first step, which allocates the store and pins its pools).
    """
    by = {(r["seq_len"], r["mode"], r["select_block"], r["offload"]): r for r in rows
          if _ok(r) and r.get("kind") != "longest" and field in r}
    return {overhead_key(r): r[field] / by[(n, mode, block, False)][field] - 1
            for (n, mode, block, off), r in by.items() if off and (n, mode, block, False) in by}


def plan_prediction(plan) -> dict:
    """A MemoryPlan -> the bytes of "parameters + gradients, no optimizer" (PLAN_NO_OPTIMIZER), and the GPU
    allowance of an offloaded store it was made with (``offload_gpu_bytes``, the layers it keeps whole)."""
    items = [i for i in plan.items if i.name not in EXCLUDED_PLAN_ITEMS]
    gpu_total = sum(i.gpu_bytes for i in items)
    context = sum(i.gpu_bytes for i in items if i.name == CONTEXT_ITEM)
    host = sum(i.host_bytes for i in items)
    new_host = sum(i.host_bytes for i in items if i.name != PROCESS_ITEM)
    gpu_fits = plan.device_total_bytes is None or gpu_total <= plan.device_total_bytes
    host_fits = plan.host_total_bytes is None or host <= plan.host_total_bytes
    reasons = []
    if not gpu_fits:
        reasons.append(f"planner: GPU {gpu_total / GIB:.2f} GiB > {plan.device_total_bytes / GIB:.2f} GiB")
    if not host_fits:
        reasons.append(f"planner: host {host / GIB:.2f} GiB > {plan.host_total_bytes / GIB:.2f} GiB")
    return {
        "predicted_gpu_total_bytes": gpu_total, "predicted_gpu_bytes": gpu_total - context,
        "predicted_host_bytes": host, "predicted_new_host_bytes": new_host,
        "gpu_fits": gpu_fits, "host_fits": host_fits, "fits": gpu_fits and host_fits,
        "reason": "; ".join(reasons) or None,
        "excluded": {i.name: [i.gpu_bytes, i.host_bytes] for i in plan.items if i.name in EXCLUDED_PLAN_ITEMS},
        "items": {i.name: [i.gpu_bytes, i.host_bytes] for i in items},
        "device_total_bytes": plan.device_total_bytes, "host_total_bytes": plan.host_total_bytes,
        "offload_gpu_bytes": plan.settings["offload_gpu_bytes"],
        "offload_resident_layers": plan.settings["offload_resident_layers"],
    }


def plan_without_optimizer(model_config, options: StepOptions, shape: RunShape, limits: MemoryLimits, *,
                           offload_gpu_memory: int | str = 0) -> dict:
    """plan_prediction of the row's plan with the optimizer left out (PLAN_NO_OPTIMIZER: planned as AdamW without
    master weights, its items then dropped). With offload, ``offload_gpu_memory`` "auto" gives the store what that
    plan leaves free on the GPU (as the planner's own "auto" does for a run with its optimizer), a byte count
    gives it that."""
    shape = dataclasses.replace(shape, optimizer="adamw", master_weights=False)

    def predict(allowance: int) -> dict:
        return plan_prediction(plan_memory(model_config, options, shape, limits,
                                           offload_gpu_bytes=allowance if options.offload else 0))

    if offload_gpu_memory != "auto":
        return predict(offload_gpu_memory)
    pred = predict(0)
    if not options.offload or limits.gpu_bytes is None:
        return pred
    return predict(max(0, limits.gpu_bytes - pred["predicted_gpu_total_bytes"] - AUTO_GPU_MARGIN_BYTES))


def planned_longest(fits, unit: int, limit: int) -> int:
    """The largest multiple of ``unit`` up to ``limit`` for which ``fits(n)`` (0 if none): memory grows with the
    length, so bisection."""
    lo, hi = 0, limit // unit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * unit):
            lo = mid
        else:
            hi = mid - 1
    return lo * unit


def longest_candidates(longest: int, unit: int) -> list[int]:
    """The planner's longest, then 95% and 90% of it (multiples of ``unit``, longest first, no repeats)."""
    out = [n for n in (longest, longest * 95 // 100 // unit * unit, longest * 90 // 100 // unit * unit) if n > 0]
    return list(dict.fromkeys(out))


def _ratio(a, b):
    return a / b if a is not None and b else None


def planner_agreement(pred: dict, *, peak_gpu_bytes, store_host_bytes: int, rss_before_bytes: int,
                      rss_after_bytes: int) -> dict:
    """Predicted against measured bytes (PLAN_NO_OPTIMIZER says which against which)."""
    measured_host = store_host_bytes + rss_before_bytes
    return {
        "predicted_gpu_bytes": pred["predicted_gpu_bytes"], "measured_gpu_bytes": peak_gpu_bytes,
        "gpu_ratio": _ratio(pred["predicted_gpu_bytes"], peak_gpu_bytes),
        "predicted_host_bytes": pred["predicted_host_bytes"], "measured_host_bytes": measured_host,
        "host_ratio": _ratio(pred["predicted_host_bytes"], measured_host),
        "rss_after_bytes": rss_after_bytes,
        "host_ratio_rss_after": _ratio(pred["predicted_host_bytes"], rss_after_bytes),
    }


def admission(pred: dict, *, host_available_bytes: int, host_margin_bytes: int,
              gpu_free_bytes: int | None = None, gpu_allocated_bytes: int = 0) -> str | None:
    """Why a row must not run (None = run it): the planner's verdict, then what is free right now.

    Host: the bytes the row will add (pinned pages) plus the margin must be available now, so the
    kernel's OOM killer never has to choose. GPU (when ``gpu_free_bytes`` is given): what the
    plan adds to what torch already holds must be free.
    """
    reasons = [pred["reason"]] if pred["reason"] else []
    need = pred["predicted_new_host_bytes"] + host_margin_bytes
    if need > host_available_bytes:
        reasons.append(f"host: {pred['predicted_new_host_bytes'] / GIB:.2f} GiB to pin + {host_margin_bytes / GIB:.2f}"
                       f" GiB margin > {host_available_bytes / GIB:.2f} GiB available")
    if gpu_free_bytes is not None:
        extra = pred["predicted_gpu_bytes"] - gpu_allocated_bytes
        if extra > gpu_free_bytes:
            reasons.append(f"GPU: {extra / GIB:.2f} GiB more than held now > {gpu_free_bytes / GIB:.2f} GiB free")
    return "; ".join(reasons) or None


def repeat_growth(steps: list[dict]) -> dict:
    """Largest growth from step 2 to any later step of RSS, pinned store bytes and torch's pinned pool."""
    out = {"steps": len(steps)}
    ok = [s for s in steps if "error" not in s]
    fields = (("rss_gib", "rss_growth_gib"), ("store_host_gib", "store_host_growth_gib"),
              ("host_alloc_gib", "host_alloc_growth_gib"))
    for field, name in fields:
        vals = [s.get(field) for s in ok[1:]]
        out[name] = (max(v - vals[0] for v in vals) if vals and None not in vals else None)
    out["from_step"], out["to_step"] = (2, len(ok)) if len(ok) >= 2 else (None, None)
    return out


# ---------------------------------------------------------------------------- measuring
def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (bytes on macOS)
    return kib if sys.platform == "darwin" else kib * 1024


def _host_memory() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.total, vm.available


def _host_alloc_stats(cuda: bool) -> dict | None:
    """torch's pinned-allocator statistics (torch >= 2.6 on CUDA); None where there are none."""
    if not cuda or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        return {k: v for k, v in torch.cuda.host_memory_stats().items() if isinstance(v, int | float)}
    except Exception as e:  # an API that exists but does not work here must not stop the bench
        return {"error": repr(e)}


class Bench:
    def __init__(self, args):
        from oomb.train.config.presets import build_model

        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = getattr(torch, args.dtype)
        if self.cuda:  # the fa4 backend runs on CUDA only
            ask_fa4_block_sparse(args.fa4_block_sparse)
        self.model = build_model(args.preset, dtype=self.dtype, device=self.device)
        self.model.train()
        # What chunked_backward's backend="auto" runs here: a machine without flash-attn-4 runs the Triton
        # kernels, a different step, and the record must say so.
        self.attention_backend = get_backend("auto", self.device.type).name
        # liger's RMSNorm, SwiGLU and RoPE as `oomb train` swaps them in (train.fused_ops=auto: on CUDA)
        self.fused = use_fused_ops(self.model, args.fused_ops)
        # and weight gradients added by their matmuls (train.fused_grad_accumulation), on CUDA with fused ops
        self.linears = use_bench_grad_accumulation(self.model, args)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.vocab = self.model.config.vocab_size
        self.warmed: set = set()
        self.chunk_pages = args.chunk_pages or None  # the sparse rows' cap on a chunk's pages (None: no cap)
        self.host_total, _ = _host_memory()
        self.device_total = torch.cuda.get_device_properties(self.device).total_memory if self.cuda else None

    # --------------------------------------------------------------- helpers
    def step_kwargs(self, s: Setting, pred: dict | None = None) -> dict:
        """chunked_backward's options of the row; ``pred`` (its plan) gives an offloaded store's GPU allowance."""
        kw = dict(chunk_size=self.args.chunk, page_size=self.args.page, offload=s.offload)
        if s.offload and pred is not None and pred["offload_gpu_bytes"]:
            kw["offload_gpu_bytes"] = pred["offload_gpu_bytes"]
        if s.budget is not None:
            kw["selection"] = PageSelection(page_budget=s.budget, block=s.block, chunk_pages=self.chunk_pages)
        return kw

    def plan(self, s: Setting) -> dict:
        selection = None if s.budget is None else PageSelection(page_budget=s.budget, block=s.block or 128,
                                                                 chunk_pages=self.chunk_pages)
        options = StepOptions(chunk_size=self.args.chunk, page_size=self.args.page, selection=selection,
                              offload=s.offload, backend="triton")
        shape = RunShape(seq_len=s.seq_len, dtype=self.dtype, device_type="cuda" if self.cuda else "cpu",
                         fused_ops=bool(self.fused))
        limits = MemoryLimits(gpu_bytes=self.device_total, host_bytes=self.host_total)
        return plan_without_optimizer(self.model.config, options, shape, limits,
                                      offload_gpu_memory=self.args.offload_gpu_memory)

    def planned_longest(self) -> int:
        """The longest sparse + offload row (first select block) the planner says fits, with this bench's
        host margin kept free as the longest rows keep it."""
        margin = int(self.args.host_margin_gib * GIB)

        def fits(n: int) -> bool:
            pred = self.plan(Setting("longest", n, self.args.budget, self.args.select_blocks[0], True))
            return pred["fits"] and pred["predicted_host_bytes"] + margin <= self.host_total

        return planned_longest(fits, self.args.chunk, 1 << 26)

    def release(self) -> None:
        oomb.release_memory(self.model)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_steps(self, fn, repeats: int) -> list[float]:
        if self.cuda:
            return time_steps(fn, repeats)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return times

    def ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (1, n), device=self.device)

    def warm_up(self, s: Setting) -> None:
        if (s.budget, s.block, s.offload) in self.warmed:
            return
        n = min(s.seq_len, 3 * self.args.chunk + (s.budget or 0) * self.args.page)
        oomb.chunked_backward(self.model, self.ids(n), **self.step_kwargs(s))
        self.warmed.add((s.budget, s.block, s.offload))

    def memory_now(self, offload: bool) -> dict:
        store = store_for_model(self.model)
        out = {"store_device_gib": store.nbytes() / GIB if store is not None else 0.0,
               "store_host_gib": store.host_nbytes() / GIB if store is not None and offload else 0.0,
               "rss_gib": _rss_bytes() / GIB, "peak_rss_gib": _peak_rss_bytes() / GIB}
        moved = getattr(store, "moved_bytes", None) if offload else None  # the last step's copies, if counted
        if isinstance(moved, dict):
            out["moved_gib"] = {k: v / GIB for k, v in moved.items()}
        if self.cuda:
            out.update(peak_gpu_gib=torch.cuda.max_memory_allocated() / GIB,
                       peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
        else:
            out.update(peak_gpu_gib=None, peak_reserved_gib=None)
        return out

    # --------------------------------------------------------------- rows
    def run_row(self, s: Setting, on_timed=None) -> dict:
        """One row; ``on_timed(row)`` once its steps are timed, before a profiled step (``--profile-longest``)."""
        row = s.head(self.chunk_pages)
        pred = self.plan(s)
        row["plan"] = pred
        try:
            self.warm_up(s)
            self.release()
            if s.kind == "longest":
                total, available = _host_memory()
                row.update(host_total_gib=total / GIB, host_available_gib=available / GIB)
                free = torch.cuda.mem_get_info(self.device)[0] if self.cuda else None
                held = torch.cuda.memory_allocated(self.device) if self.cuda else 0
                cached = (torch.cuda.memory_reserved(self.device) - held) if self.cuda else 0
                reason = admission(pred, host_available_bytes=available,
                                   host_margin_bytes=int(self.args.host_margin_gib * GIB),
                                   gpu_free_bytes=None if free is None else free + cached, gpu_allocated_bytes=held)
                if reason:
                    row["refused"] = reason
                    return row
            ids = self.ids(s.seq_len)
            rss_before = _rss_bytes()
            self.sync()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            repeats = 1 if s.kind == "longest" else self.args.repeats
            kw = self.step_kwargs(s, pred)
            row["offload_gpu_bytes"] = kw.get("offload_gpu_bytes", 0)
            row["offload_resident_layers"] = pred["offload_resident_layers"]

            def step():
                oomb.chunked_backward(self.model, ids, **kw)

            steady = ((s.kind == "pair" and self.args.steady)
                      or (s.kind == "longest" and self.args.longest_steady))
            if steady:
                # A training run's first step allocates the store (and pins its host pools); every
                # later step reuses it. Time that first step apart, then the steps that follow it.
                row["first_step_s"] = self.time_steps(step, 1)[0]
                if self.cuda:
                    torch.cuda.reset_peak_memory_stats()
            times = self.time_steps(step, repeats)
            row.update(step_s=sorted(times)[len(times) // 2], step_times_s=times, steady=steady,
                       **self.memory_now(s.offload))
            row["rss_before_gib"] = rss_before / GIB
            row["planner"] = planner_agreement(
                pred, peak_gpu_bytes=None if row["peak_gpu_gib"] is None else int(row["peak_gpu_gib"] * GIB),
                store_host_bytes=int(row["store_host_gib"] * GIB), rss_before_bytes=rss_before,
                rss_after_bytes=int(row["rss_gib"] * GIB))
            if s.kind == "longest" and self.args.profile_longest:
                # The timed row first, printed and handed to on_timed (which writes the record), so a job
                # stopped during the profiled step keeps it (the 1M step's profile runs past a device call's
                # 10 minutes).
                print(json.dumps({"seq_len": s.seq_len, "first_step_s": row.get("first_step_s"),
                                  "step_times_s": times, "peak_gpu_gib": row.get("peak_gpu_gib")}), flush=True)
                if on_timed is not None:
                    on_timed({**row, "profile": "in progress"})
                # one more step under torch.profiler, kernels only (a step of minutes; the host's calls would
                # make its trace gigabytes): where the longest step's time goes
                row["profile"] = step_profile(step, host=False) if self.cuda else {"skipped": "needs CUDA"}
        except (torch.OutOfMemoryError, RuntimeError) as e:  # CUDA out of memory, host memory that cannot be pinned
            kind = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
            row["error"] = f"{kind}: {str(e).splitlines()[0] if str(e) else repr(e)}"
            row.update(rss_gib=_rss_bytes() / GIB, peak_rss_gib=_peak_rss_bytes() / GIB)
        finally:
            self.release()
        return row

    def run_profile(self, s: Setting, trace_dir: str | None) -> dict:
        """One step under torch.profiler: per-stream GPU busy time and the compute stream's idle time
        (benchmarks.timeline), after an unprofiled step of the same length."""
        head = s.head(self.chunk_pages)
        if not self.cuda:
            return {**head, "skipped": "needs CUDA"}
        try:
            self.warm_up(s)
            ids, kw = self.ids(s.seq_len), self.step_kwargs(s)

            def step():
                oomb.chunked_backward(self.model, ids, **kw)

            step()  # pools at their size, every kernel compiled
            path = None
            if trace_dir:
                os.makedirs(trace_dir, exist_ok=True)
                path = os.path.join(trace_dir, f"trace-{s.mode}-{'offload' if s.offload else 'gpu'}-{s.seq_len}"
                                               ".json.gz")
            return {**head, **profile_streams(step, trace_path=path, stacks=self.args.profile_stacks), "trace": path,
                    "stacks": self.args.profile_stacks}
        except torch.OutOfMemoryError as e:
            return {**head, "error": f"out of memory: {str(e).splitlines()[0]}"}
        finally:
            self.release()

    def run_repeat(self, n: int, steps: int, on_step=None) -> dict:
        """``steps`` steps at ``n`` tokens, the store kept between them; ``on_step(report so far)`` after each."""
        s = Setting("repeat", n, self.args.budget, self.args.select_blocks[0], True)
        rep = {**s.head(self.chunk_pages), "mode": "sparse", "plan": self.plan(s), "steps": []}
        self.release()
        ids = self.ids(n)
        kw = self.step_kwargs(s)
        rss_before = _rss_bytes()
        for i in range(steps):
            entry = {"step": i + 1}
            try:
                self.sync()
                if self.cuda:
                    torch.cuda.reset_peak_memory_stats()
                entry["step_s"] = self.time_steps(lambda: oomb.chunked_backward(self.model, ids, **kw), 1)[0]
                entry.update(self.memory_now(True))
                stats = _host_alloc_stats(self.cuda)
                if stats is not None:
                    entry["host_memory_stats"] = stats
                    if "allocated_bytes.current" in stats:
                        entry["host_alloc_gib"] = stats["allocated_bytes.current"] / GIB
            except (torch.OutOfMemoryError, RuntimeError) as e:
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else repr(e)}"
                rep["steps"].append(entry)
                break
            rep["steps"].append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "host_memory_stats"}), flush=True)
            if on_step is not None:
                on_step({**rep, "growth": repeat_growth(rep["steps"])})
        first = next((e for e in rep["steps"] if "step_s" in e), None)
        if first is not None:
            rep["planner"] = planner_agreement(
                rep["plan"], peak_gpu_bytes=None if first["peak_gpu_gib"] is None else int(first["peak_gpu_gib"] * GIB),
                store_host_bytes=int(first["store_host_gib"] * GIB), rss_before_bytes=rss_before,
                rss_after_bytes=int(first["rss_gib"] * GIB))
        rep["growth"] = repeat_growth(rep["steps"])
        self.release()
        return rep


def summarize(meta: dict, results: list[dict], repeat: dict | None, complete: bool) -> dict:
    return {**meta, "complete": complete, "results": results,
            "offload_overhead": offload_overheads(results),
            "offload_overhead_first_step": offload_overheads(results, "first_step_s"),
            "sparse_offload_memory_growth": memory_growth(results),
            "repeat": repeat}


def run(args) -> dict:
    t0 = time.perf_counter()
    bench = Bench(args)
    cuda = bench.cuda
    meta = {
        "bench": "offload",
        "command": command_line("benchmarks.offload", args.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "gpu": torch.cuda.get_device_name(bench.device) if cuda else "cpu",
        "host": platform.node(),
        "versions": library_versions(),
        "preset": args.preset, "dtype": args.dtype, "chunk_size": args.chunk, "page_size": args.page,
        "budget_pages": args.budget, "select_blocks": args.select_blocks, "chunk_pages": args.chunk_pages or None,
        "host_total_gib": bench.host_total / GIB,
        "gpu_total_gib": bench.device_total / GIB if cuda else None,
        "host_margin_gib": args.host_margin_gib, "time_budget_s": args.time_budget,
        "planner_method": PLAN_NO_OPTIMIZER, "fused_ops": args.fused_ops, "fused_modules": bench.fused,
        "fused_grad_accumulation": len(bench.linears),
        "attention_backend": bench.attention_backend,
        "fa4_block_sparse": args.fa4_block_sparse and bench.attention_backend == "fa4",
    }
    results: list[dict] = []
    repeat = None
    profiles = [Setting("profile", args.profile_dense_length, None, None, off)
                for off in (False, True) if args.profile_dense_length]
    profiles += [Setting("profile", args.profile_length, args.budget, args.select_blocks[0], off)
                 for off in (False, True) if args.profile_length]
    if profiles:  # first: the diagnosis of an overhead is what the rest is read against
        meta["stream_profiles"] = []
        for s in profiles:
            meta["stream_profiles"].append(bench.run_profile(s, args.trace_dir))
            print(json.dumps({k: v for k, v in meta["stream_profiles"][-1].items() if k != "top_kernels"}), flush=True)
            if args.out:
                write_report(args.out, summarize(meta, results, repeat, False))
    longest_lengths = args.longest_lengths
    if longest_lengths == "plan":
        meta["planned_longest"] = bench.planned_longest()
        longest_lengths = longest_candidates(meta["planned_longest"], args.chunk)
    meta["offload_gpu_memory"] = args.offload_gpu_memory
    settings = row_settings(args.dense_lengths, args.sparse_lengths, args.growth_lengths, longest_lengths,
                            args.select_blocks, args.budget)
    for s in settings:
        head = s.head(bench.chunk_pages)
        if args.time_budget and time.perf_counter() - t0 > args.time_budget:
            row = {**head, "skipped": "time budget"}
        elif (s.kind == "longest" and args.longest_first_fit
              and any(r["kind"] == "longest" and _ok(r) for r in results)):
            row = {**head, "skipped": "an earlier longest length ran (--longest-first-fit)"}
        else:
            if args.out:  # a run killed during this row still says which row it was in
                write_report(args.out, {**summarize(meta, results, repeat, False), "in_progress": head})

            def timed(row, results=results):
                if args.out:
                    write_report(args.out, summarize(meta, [*results, row], repeat, False))

            row = bench.run_row(s, on_timed=timed)
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_times_s", "plan", "profile")}), flush=True)
        if args.out:
            write_report(args.out, summarize(meta, results, repeat, False))
    if args.repeat_steps and args.repeat_length:
        if args.time_budget and time.perf_counter() - t0 > args.time_budget:
            repeat = {"seq_len": args.repeat_length, "skipped": "time budget"}
        else:
            def save(partial):
                if args.out:
                    write_report(args.out, {**summarize(meta, results, partial, False),
                                            "in_progress": {"kind": "repeat", "seq_len": args.repeat_length}})

            save(None)
            repeat = bench.run_repeat(args.repeat_length, args.repeat_steps, on_step=save)
    report = summarize(meta, results, repeat, True)
    report["elapsed_s"] = time.perf_counter() - t0
    return report


def _gib(v) -> str:
    return "      -" if v is None else f"{v:7.2f}"


def _pct(v) -> str:
    return "    -" if v is None else f"{v:5.2f}"


def _print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  {report['date']}  preset {report['preset']}  host {report['host_total_gib']:.1f} GiB")
    print(f"{'kind':<8}{'mode':<7}{'blk':>5} {'where':<8}{'tokens':>9}{'step s':>9}{'peak GPU':>9}{'store GPU':>10}"
          f"{'host':>8}{'RSS':>7}{'peakRSS':>8}{'plan GPU':>9}{'ratio':>6}{'plan host':>10}{'ratio':>6}  (GiB)")
    for r in report["results"]:
        head = (f"{r['kind']:<8}{r['mode']:<7}{r['select_block'] or '-':>5} {'offload' if r['offload'] else 'gpu':<8}"
                f"{r['seq_len']:>9}")
        note = r.get("error") or r.get("refused") or r.get("skipped")
        if note:
            plan = r.get("plan") or {}
            extra = (f"  [plan GPU {plan['predicted_gpu_bytes'] / GIB:.1f}, "
                     f"host {plan['predicted_host_bytes'] / GIB:.1f}]" if plan else "")
            label = "error" if "error" in r else "refused" if "refused" in r else "skipped"
            print(f"{head}  {label}: {note[:110]}{extra}")
            continue
        p = r["planner"]
        print(f"{head}{r['step_s']:9.2f}{_gib(r['peak_gpu_gib']):>9}{r['store_device_gib']:10.2f}"
              f"{r['store_host_gib']:8.2f}{r['rss_gib']:7.1f}{r['peak_rss_gib']:8.1f}"
              f"{p['predicted_gpu_bytes'] / GIB:9.2f}{_pct(p['gpu_ratio']):>6}"
              f"{p['predicted_host_bytes'] / GIB:10.2f}{_pct(p['host_ratio']):>6}")
        if "kernel_groups" in r.get("profile", {}):
            print(f"{'':<8}{format_profile(r['profile'])}")
    first = report.get("offload_overhead_first_step", {})
    for k, v in report["offload_overhead"].items():
        also = f" (first step, which allocates and pins the store: {100 * first[k]:+.1f}%)" if k in first else ""
        print(f"offload overhead {k}: {100 * v:+.1f}%{also}")
    for block, g in report["sparse_offload_memory_growth"].items():
        def mib(v):
            return "-" if v is None else f"{v:.2f}"
        print(f"sparse+offload, select block {block}, GPU memory per extra 10K tokens ({g['from']} -> {g['to']}, "
              f"{len(g['lengths'])} points): peak {mib(g['gpu_mib_per_10k_tokens'])} MiB endpoints, "
              f"{mib(g['gpu_mib_per_10k_tokens_lstsq'])} MiB least squares; store device "
              f"{mib(g['store_device_mib_per_10k_tokens'])} / {mib(g['store_device_mib_per_10k_tokens_lstsq'])} MiB")
    for p in report.get("stream_profiles", []):
        where = "offload" if p["offload"] else "gpu"
        if "wall_ms" not in p:
            print(f"profile {p['mode']} {where} {p['seq_len']}: {p.get('error') or p.get('skipped')}")
            continue
        others = ", ".join(f"stream {k} busy {v['busy_ms']:.0f} ms" for k, v in p["streams"].items()
                           if k != str(p["compute_stream"]))
        print(f"profile {p['mode']} {where} {p['seq_len']} (block {p['select_block']}): "
              f"GPU span {p['wall_ms']:.0f} ms, compute stream busy {p['compute_busy_ms']:.0f} ms, "
              f"idle {p['compute_idle_ms']:.0f} ms; {others}")
        groups = ", ".join(f"{g} {v['ms']:.0f} ms" for g, v in p.get("kernel_groups", {}).items())
        if groups:
            print(f"  compute stream kernels: {groups}")
        for before, after, ms, n in p.get("top_gaps", [])[:6]:
            print(f"  idle {ms:7.1f} ms in {n:6d} gaps between {before[:45]} and {after[:45]}")
        calls = ", ".join(f"{name} {ms:.0f} ms x {n}" for name, ms, n in p.get("host_calls", [])[:5])
        if calls:
            print(f"  host CUDA calls: {calls}")
        for copy, op, frame, ms, n in p.get("copies_by_op", [])[:6]:
            print(f"  {n:6d} x {copy[:34]} ({ms:.0f} ms) from {op} in {frame[:70]}")
    rep = report.get("repeat")
    if rep:
        if "skipped" in rep:
            print(f"repeat {rep['seq_len']}: skipped ({rep['skipped']})")
        else:
            g = rep["growth"]
            errors = [s["error"] for s in rep["steps"] if "error" in s]
            print(f"repeat {g['steps']} sparse+offload steps at {rep['seq_len']} (block {rep['select_block']}): "
                  f"growth from step {g['from_step']} to {g['to_step']}: RSS {_gib(g['rss_growth_gib']).strip()} GiB, "
                  f"pinned store {_gib(g['store_host_growth_gib']).strip()} GiB, torch pinned pool "
                  f"{_gib(g['host_alloc_growth_gib']).strip()} GiB" + (f"; error: {errors[0]}" if errors else ""))


def _longest_lengths(text: str) -> list[int] | str:
    return "plan" if text.strip() == "plan" else int_list(text)


def _gpu_memory(text: str) -> int | str:
    from oomb.train.config.settings import ConfigError
    from oomb.train.config.step import offload_gpu_bytes

    try:
        return offload_gpu_bytes(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offload", description=__doc__.splitlines()[0])
    p.add_argument("--dense-lengths", type=int_list, default=[65536])
    p.add_argument("--sparse-lengths", type=int_list, default=[131072])
    p.add_argument("--growth-lengths", type=int_list, default=[65536, 262144])
    p.add_argument("--select-blocks", type=int_list, default=[128],
                   help="queries per page-selection block (PageSelection.block); sparse rows run once per entry, "
                        "in this order (the longest and repeat rows use the first)")
    p.add_argument("--chunk-pages", type=int, default=0,
                   help="sparse rows: the most pages a chunk's blocks choose among (PageSelection.chunk_pages; "
                        "train.chunk_pages=auto is the page budget with offload); default 0, no cap")
    p.add_argument("--longest-lengths", type=_longest_lengths, default=[],
                   help="one sparse + offload step at each (refused where the planner or free memory says no); "
                        "'plan': the planner's longest, then 95%% and 90%% of it")
    p.add_argument("--offload-gpu-memory", type=_gpu_memory, default=0,
                   help="offloaded rows: GPU memory for whole layers' pages (a size such as 60GiB, or 'auto': what "
                        "the row's plan leaves free); default 0, the two working layers only")
    p.add_argument("--longest-first-fit", action="store_true",
                   help="list --longest-lengths longest first: once one runs, skip the rest")
    p.add_argument("--host-margin-gib", type=float, default=4.0,
                   help="longest rows: host memory that must stay available beyond what the row pins")
    p.add_argument("--repeat-steps", type=int, default=0, help="consecutive sparse + offload steps (0 = skip)")
    p.add_argument("--repeat-length", type=int, default=0, help="tokens of each repeated step")
    p.add_argument("--profile-length", type=int, default=0,
                   help="first, one sparse step this long with and without offload under torch.profiler: per-stream "
                        "busy time and the compute stream's idle time (0 = skip)")
    p.add_argument("--profile-dense-length", type=int, default=0,
                   help="the same for one dense step this long (before the sparse profile; 0 = skip)")
    p.add_argument("--profile-longest", action="store_true",
                   help="after each longest row that ran, one more step of it under torch.profiler (kernels only): "
                        "wall, GPU idle time and time per kernel group, in the row's 'profile'")
    p.add_argument("--profile-stacks", action="store_true",
                   help="record Python stacks in the profiled steps: each copy is traced to oomb's line that "
                        "queued it (slows the host, so their idle times are not a plain step's)")
    p.add_argument("--trace-dir", default=None, help="keep the profiled steps' traces here (gzipped Chrome traces)")
    p.add_argument("--steady", action=argparse.BooleanOptionalAction, default=True,
                   help="pair rows: one step at the row's length first (allocating the store and pinning its "
                        "pools, as a run's first step does; recorded as first_step_s), then the timed steps")
    p.add_argument("--longest-steady", action="store_true",
                   help="longest rows: time a second step after the first (which allocates the store and pins "
                        "its host pools, recorded as first_step_s), as a training run's later steps are")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds: rows not started by then are recorded as skipped (0 = no limit)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: check the bench on a tiny preset (no GPU memory numbers, wall-clock timing)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="parameters, gradients and pages (float32 only to check the bench quickly on CPU)")
    p.add_argument("--fused-ops", default="auto", choices=FUSED_OPS_MODES,
                   help="liger's fused RMSNorm/SwiGLU/RoPE as `oomb train` uses them (train.fused_ops; records "
                        "measured without them: none)")
    add_grad_accumulation_argument(p)
    p.add_argument("--fa4-block-sparse", action=argparse.BooleanOptionalAction, default=True,
                   help="page-sparse rows on FA4's block sparsity where the fa4 backend runs them (oomb's default "
                        "on Hopper) or, with --no-fa4-block-sparse, on the Triton kernels "
                        "(OOMB_FA4_BLOCK_SPARSE=0)")
    add_step_arguments(p)
    args = p.parse_args(argv)
    args.argv = argv
    if not args.select_blocks or min(args.select_blocks) < 1:
        p.error("--select-blocks needs at least one positive block size")
    return run_benchmark("offload", args, run, _print_table, require_cuda=args.device == "cuda")


if __name__ == "__main__":
    sys.exit(main())
