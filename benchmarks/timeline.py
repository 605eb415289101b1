"""Where a step's GPU time goes, per CUDA stream, from a torch.profiler (Kineto) trace.

A step that got slower can have longer kernels (they share the GPU with something, e.g. copy
kernels on another stream) or gaps (the compute stream waits: for copies, for the host).
``stream_summary`` tells the two apart: per stream, the time covered by kernels and copies,
and for the stream that computes (the most kernel time) its idle time inside the step.

    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof: step()
    prof.export_chrome_trace(path); stream_summary(json.load(open(path))["traceEvents"])
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable

_KERNEL = "kernel"
_COPIES = ("gpu_memcpy", "gpu_memset")
_HOST_CALLS = ("cuda_runtime", "cuda_driver")  # the host's CUDA API calls (with ProfilerActivity.CPU)
# Kernel name -> group, first match wins (lower-cased substrings). Our Triton kernels keep their
# Python names (oomb/kernels/forward.py, dq.py, dkdv.py, ..., oomb/offload/copy.py); FlashAttention-4's
# CuTe kernels carry their class names (FlashAttentionForwardSm90, ...Backward..., flash_bwd_*);
# cuBLAS/CUTLASS matmuls are named nvjet_*, sm90_xmma_*, cutlass*, *gemm*; liger's kernels
# _rms_norm_*, _swiglu_*, _triton_rope; PyTorch's indexing index_*/gather/scatter kernels.
KERNEL_GROUPS = (
    ("attention forward (FA4)", ("attentionforward", "flash_fwd")),
    ("attention backward (FA4)", ("attentionbackward", "flash_bwd")),
    ("attention other (FA4)", ("flash",)),
    ("attention forward", ("_fwd_kernel",)),
    ("attention dq", ("_bwd_dq_kernel",)),
    ("attention dk/dv", ("_bwd_dkdv",)),
    ("attention delta", ("_bwd_delta_kernel",)),
    ("page copies", ("copy_pages", "_copy_pages")),
    ("page selection", ("select", "topk", "radix", "sort")),
    ("matmul", ("nvjet", "gemm", "xmma", "cutlass", "cublas")),
    ("loss", ("cross_entropy", "liger")),
    ("norm", ("rms_norm", "layer_norm")),
    ("swiglu", ("swiglu", "silu")),
    ("rope", ("rope", "rotary")),
    ("gather/scatter", ("index", "gather", "scatter")),
    ("fill", ("fill",)),
    ("copy/cast", ("copy_kernel", "catarray", "cat_")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
    ("reduction", ("reduce",)),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def _union_ms(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans (microseconds in, milliseconds out)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


def stream_summary(events: list[dict], top: int = 20) -> dict:
    """Per-stream busy time of GPU work in Kineto trace events, and the compute stream's gaps.

    Returns {"wall_ms", "compute_stream", "compute_busy_ms", "compute_idle_ms", "streams":
    {stream: {"kernel_ms", "copy_ms", "busy_ms", "kernels", "copies", "groups"}}, "top_kernels":
    [(name, ms, count)], "kernel_groups" {group: {"ms", "count"}} (``kernel_group``) and
    "top_gaps" [(work before, work after, idle ms, count)] of the compute stream, and
    "host_calls" [(CUDA API call, ms, count)] of the host, "copies_by_op" (``copies_by_op``)}. Times in
    milliseconds; kernel times are summed durations (kernels of one stream do not overlap, so on
    the compute stream they add up to its busy time).
    """
    spans: dict[int, list[tuple[float, float, str]]] = defaultdict(list)  # (start, end, name) per stream
    per: dict[int, dict] = defaultdict(lambda: {"kernel_ms": 0.0, "copy_ms": 0.0, "kernels": 0, "copies": 0})
    names: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    groups: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    lo, hi = float("inf"), float("-inf")
    host_calls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in events:
        cat = ev.get("cat")
        if ev.get("ph") == "X" and cat in _HOST_CALLS:
            entry = host_calls[ev.get("name", "?")]
            entry[0] += float(ev.get("dur", 0.0)) / 1e3
            entry[1] += 1
            continue
        if ev.get("ph") != "X" or (cat != _KERNEL and cat not in _COPIES):
            continue
        stream = int(ev.get("args", {}).get("stream", -1))
        start, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        spans[stream].append((start, start + dur, ev.get("name", "?")[:60]))
        lo, hi = min(lo, start), max(hi, start + dur)
        if cat == _KERNEL:
            per[stream]["kernel_ms"] += dur / 1e3
            per[stream]["kernels"] += 1
            name = ev.get("name", "?")
            for entry in (names[stream][name[:90]], groups[stream][kernel_group(name)]):
                entry[0] += dur / 1e3
                entry[1] += 1
        else:
            per[stream]["copy_ms"] += dur / 1e3
            per[stream]["copies"] += 1
    if not spans:
        return {"wall_ms": 0.0, "compute_stream": None, "compute_busy_ms": 0.0, "compute_idle_ms": 0.0,
                "streams": {}, "top_kernels": [], "kernel_groups": {}, "top_gaps": [],
                "host_calls": _by_time(host_calls, top), "copies_by_op": [], "ranges": {}}
    for stream, s in spans.items():
        per[stream]["busy_ms"] = _union_ms([(a, b) for a, b, _ in s])
        if groups[stream]:
            per[stream]["groups"] = {g: {"ms": v[0], "count": v[1]}
                                     for g, v in sorted(groups[stream].items(), key=lambda t: -t[1][0])}
    compute = max(per, key=lambda k: per[k]["kernel_ms"])
    wall = (hi - lo) / 1e3
    busy = per[compute]["busy_ms"]
    top_kernels = _by_time(names[compute], top)
    # The compute stream's idle time by what it waited between: (work before, work after) -> total.
    # A host sync (the host waiting for a result before it queues more) shows as many gaps after
    # the same op; a stream waiting for copies shows as gaps before the op that reads them.
    gaps: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    work = sorted(spans[compute])
    end, before = float("-inf"), None
    for start, stop, name in work:
        if before is not None and start > end:
            entry = gaps[(before, name)]
            entry[0] += (start - end) / 1e3
            entry[1] += 1
        if stop > end:
            end, before = stop, name
    top_gaps = sorted(((a, b, v[0], v[1]) for (a, b), v in gaps.items()), key=lambda t: -t[2])[:top]
    return {"wall_ms": wall, "compute_stream": compute, "compute_busy_ms": busy, "compute_idle_ms": wall - busy,
            "streams": {str(k): dict(v) for k, v in sorted(per.items())}, "top_kernels": top_kernels,
            "kernel_groups": per[compute].get("groups", {}), "top_gaps": top_gaps,
            # The host's CUDA API calls: a host waiting for the GPU shows as cudaStreamSynchronize /
            # cudaDeviceSynchronize / cudaEventSynchronize (or a blocking cudaMemcpy); a host merely
            # slow does not (its time is in Python and in cudaLaunchKernel).
            "host_calls": _by_time(host_calls, top),
            "copies_by_op": copies_by_op(events, top), "ranges": gpu_ms_by_range(events)}


def gpu_ms_by_range(events: list[dict], prefix: str = "oomb.") -> dict[str, dict]:
    """GPU time of the kernels and copies queued inside each profiler range (``torch.profiler.record_function``)
    whose name starts with ``prefix``: {name: {"ms", "gpu_ops", "ranges"}}, most time first. A kernel counts for
    the innermost such range around the host call that queued it (matched by correlation id, as
    ``copies_by_op`` does): oomb names its attention calls by what a layer attends (oomb.attention.forward.window,
    .full, .sparse; oomb/attention/function.py), so a sliding layer's cost shows beside a full one's. Needs the
    host's events (ProfilerActivity.CPU)."""
    gpu = [ev for ev in events if ev.get("ph") == "X" and (ev.get("cat") == _KERNEL or ev.get("cat") in _COPIES)]
    wanted = {ev.get("args", {}).get("correlation") for ev in gpu} - {None}
    calls: dict[tuple, list[tuple[float, float, int]]] = defaultdict(list)  # thread -> (ts, end, correlation)
    ranges: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for ev in events:
        if ev.get("ph") != "X":
            continue
        key, ts = (ev.get("pid"), ev.get("tid")), float(ev.get("ts", 0.0))
        if ev.get("cat") in _HOST_CALLS and ev.get("args", {}).get("correlation") in wanted:
            calls[key].append((ts, ts + float(ev.get("dur", 0.0)), ev["args"]["correlation"]))
        elif ev.get("cat") == "user_annotation" and ev.get("name", "").startswith(prefix):
            ranges[key].append((ts, ts + float(ev.get("dur", 0.0)), ev["name"]))
            counts[ev["name"]] += 1
    # correlation -> the innermost range around its call
    inside = {corr: around[-1][2] for corr, around in spans_around_calls(calls, ranges).items() if around}
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in gpu:
        name = inside.get(ev.get("args", {}).get("correlation"))
        if name is not None:
            totals[name][0] += float(ev.get("dur", 0.0)) / 1e3
            totals[name][1] += 1
    return {name: {"ms": ms, "gpu_ops": n, "ranges": counts[name]}
            for name, (ms, n) in sorted(totals.items(), key=lambda t: -t[1][0])}


def spans_around_calls(calls: dict[tuple, list[tuple[float, float, int]]],
                       spans: dict[tuple, list[tuple]]) -> dict[int, list[tuple]]:
    """For each host call ({thread: [(ts, end, correlation)]}), the spans of its thread ({thread: [(ts, end,
    ...)]}) that enclose it, outermost first: one sweep per thread with a stack of open spans (a thread's spans
    nest, so a closed one leaves the stack before the next opens)."""
    around: dict[int, list[tuple]] = {}
    for key, pending in calls.items():
        ordered = sorted(spans.get(key, []), key=lambda s: (s[0], -s[1]))
        stack: list[tuple] = []
        i = 0
        for ts, end, corr in sorted(pending):
            while i < len(ordered) and ordered[i][0] <= ts:
                while stack and stack[-1][1] < ordered[i][0]:
                    stack.pop()
                stack.append(ordered[i])
                i += 1
            while stack and stack[-1][1] < end:
                stack.pop()
            around[corr] = [s for s in stack if s[0] <= ts and end <= s[1]]
    return around


def copies_by_op(events: list[dict], top: int = 20) -> list[tuple[str, str, str, float, int]]:
    """Which host code issued each GPU copy and memset: [(copy, op, frame, ms, count)], most time first.

    A copy on the GPU carries the correlation id of the host's CUDA call that queued it; that call
    runs inside the profiler's op events (``cpu_op``: aten::copy_, aten::topk, ...) and, when the
    profile records stacks (``with_stack=True``), inside ``python_function`` events. ``op`` is the
    innermost op around the call, ``frame`` the innermost Python frame of oomb's own code ("?"
    without stacks or outside oomb). Why: a pageable host-to-device copy blocks the host until the
    GPU has drained the work queued before it, so the GPU idles while the host queues the next ops;
    this says which line to change.
    """
    copies = [ev for ev in events if ev.get("ph") == "X" and ev.get("cat") in _COPIES]
    wanted = {ev.get("args", {}).get("correlation") for ev in copies} - {None}
    calls = {}  # correlation -> (pid, tid, ts, end) of the host's CUDA call
    threads: dict[tuple, list[tuple[float, float, str, str]]] = defaultdict(list)
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat, key = ev.get("cat"), (ev.get("pid"), ev.get("tid"))
        ts, end = float(ev.get("ts", 0.0)), float(ev.get("ts", 0.0)) + float(ev.get("dur", 0.0))
        if cat in _HOST_CALLS and ev.get("args", {}).get("correlation") in wanted:
            calls[ev["args"]["correlation"]] = (key, ts, end)
        elif cat in ("cpu_op", "python_function"):
            threads[key].append((ts, end, cat, ev.get("name", "?")))
    # The innermost op and oomb frame around each call.
    by_thread: dict[tuple, list[tuple[float, float, int]]] = defaultdict(list)
    for corr, (key, ts, end) in calls.items():
        by_thread[key].append((ts, end, corr))
    where: dict[int, tuple[str, str]] = {}
    for corr, around in spans_around_calls(by_thread, threads).items():
        ops = [s for s in around if s[2] == "cpu_op"]
        frames = [s for s in around if s[2] == "python_function" and "oomb" in s[3]]
        where[corr] = (ops[-1][3] if ops else "?", frames[-1][3] if frames else "?")
    totals: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in copies:
        op, frame = where.get(ev.get("args", {}).get("correlation"), ("?", "?"))
        entry = totals[(ev.get("name", "?"), op, frame)]
        entry[0] += float(ev.get("dur", 0.0)) / 1e3
        entry[1] += 1
    return sorted(((*k, v[0], v[1]) for k, v in totals.items()), key=lambda t: (-t[4], -t[3]))[:top]


def _by_time(totals: dict[str, list[float]], top: int) -> list[tuple[str, float, int]]:
    """{name: [ms, count]} -> the ``top`` (name, ms, count), most time first."""
    return sorted(((n, v[0], v[1]) for n, v in totals.items()), key=lambda t: -t[1])[:top]


def profile_streams(fn: Callable[[], object], *, trace_path: str | None = None, stacks: bool = False,
                    host: bool = True) -> dict:
    """Run ``fn`` once under torch.profiler (CUDA activity) and summarise its streams.

    ``trace_path``: also keep the trace there, gzipped (it opens in chrome://tracing or Perfetto).
    ``stacks``: record Python stacks, so ``copies_by_op`` names oomb's line behind each copy (it
    slows the host, so the step's idle time is not the plain step's). ``host``: also trace the host's CUDA
    calls (without, the trace of a step of minutes stays small: its kernels only, no host_calls).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if host or stacks else [ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=stacks) as prof:
        fn()
        torch.cuda.synchronize()
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp) as f:
            trace = json.load(f)
        if trace_path:
            with open(tmp, "rb") as src, gzip.open(trace_path, "wb") as dst:
                dst.write(src.read())
    finally:
        os.unlink(tmp)
    return stream_summary(trace.get("traceEvents", []))


def step_profile(fn: Callable[[], object], top: int = 25, host: bool = True) -> dict:
    """Where one step's GPU time goes: ``profile_streams`` of one call of ``fn``, the parts a report keeps
    (wall, the compute stream's busy and idle time, kernel groups, the ``top`` kernels, host CUDA calls unless
    not ``host``)."""
    s = profile_streams(fn, host=host)
    return {"wall_ms": s["wall_ms"], "compute_busy_ms": s["compute_busy_ms"], "compute_idle_ms": s["compute_idle_ms"],
            "kernel_groups": s["kernel_groups"], "top_kernels": s["top_kernels"][:top],
            "host_calls": s["host_calls"][:10], "ranges": s["ranges"]}


def format_profile(profile: dict) -> str:
    """One line: wall, idle and each kernel group's milliseconds."""
    groups = ", ".join(f"{g} {v['ms']:.0f}" for g, v in profile["kernel_groups"].items())
    ranges = ", ".join(f"{r} {v['ms']:.0f}" for r, v in profile.get("ranges", {}).items())
    return (f"profiled step {profile['wall_ms']:.0f} ms, GPU idle {profile['compute_idle_ms']:.0f} ms; "
            f"kernels (ms): {groups}" + (f"; ranges (ms): {ranges}" if ranges else ""))

