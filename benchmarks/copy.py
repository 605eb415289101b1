"""Host <-> GPU page copies: the copy engine against the mapped-memory copy kernel, on a GPU.

    python -m benchmarks.copy --out out/copy.json

Pages of Qwen2.5-7B's shape ([4 KV heads, 128 tokens, 128] bf16 = 128 KiB) in a pinned,
mapped host pool (oomb.offload.copy.pinned_empty). For ``--pages`` chosen pages (random,
ascending, as a sparse selection's union): the copy engine moving that many pages as one
contiguous block (the dense path's copy, a bandwidth ceiling), and the copy kernel gathering
the chosen pages host -> GPU and scattering them GPU -> host, for each kernel configuration
(programs x block x warps). Then each of them on a side stream while a bf16 matrix product
runs on the main stream: how much each slows the other (what overlapping copies with compute
costs). CUDA events, median of ``--repeats`` after a warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys

import torch

from benchmarks.common import command_line, int_list, run_benchmark, time_steps

CONFIGS = {  # name: (programs, block elements, warps); "per-part": one program per work item
    "p16-b16k-w8": (16, 16384, 8),
    "p32-b16k-w8": (32, 16384, 8),
    "p64-b16k-w8": (64, 16384, 8),
    "p132-b16k-w8": (132, 16384, 8),
    "p32-b8k-w4": (32, 8192, 4),
    "per-part-b8k-w4": (None, 8192, 4),
}


def _median_ms(fn, repeats: int) -> float:
    return statistics.median(time_steps(fn, repeats)) * 1e3


def run(args) -> dict:
    from oomb.offload.copy import copy_pages, pinned_empty

    dev = torch.device("cuda")
    page = (4, 128, 128)
    page_bytes = 4 * 128 * 128 * 2
    host = pinned_empty((1, args.pool_pages, *page), torch.bfloat16)
    host.normal_()
    slot = torch.empty((1, max(args.pages), *page), dtype=torch.bfloat16, device=dev)
    results = []
    for n in args.pages:
        idx = torch.randperm(args.pool_pages, device=dev)[:n].sort().values.to(torch.int32)
        nbytes = n * page_bytes
        rows = {}

        def dma(n=n):
            slot[:, :n].copy_(host[:, :n], non_blocking=True)

        rows["copy engine (contiguous)"] = dma
        for name, (programs, block, warps) in CONFIGS.items():
            progs = programs if programs is not None else n * (4 * 128 * 128 // block)

            def gather(progs=progs, block=block, warps=warps, idx=idx, n=n):
                copy_pages(host, slot, src_index=idx, use_kernel=True, programs=progs, block=block, num_warps=warps)

            def scatter(progs=progs, block=block, warps=warps, idx=idx, n=n):
                copy_pages(slot[:, :n], host, dst_index=idx, use_kernel=True, programs=progs, block=block,
                           num_warps=warps)

            rows[f"gather {name}"] = gather
            rows[f"scatter {name}"] = scatter
        expect = host[:, idx.cpu().long()].to(dev)
        copy_pages(host, slot, src_index=idx, use_kernel=True)
        torch.cuda.synchronize()
        assert torch.equal(slot[:, :n], expect), "the copy kernel moved the wrong pages"
        for name, fn in rows.items():
            fn()
            torch.cuda.synchronize()
            ms = _median_ms(fn, args.repeats)
            results.append({"pages": n, "copy": name, "ms": ms, "gb_per_s": nbytes / ms / 1e6})
            print(json.dumps(results[-1]), flush=True)

        # Overlap: a matrix product on the main stream, copies on a side stream.
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        side = torch.cuda.Stream()

        def matmuls(a=a):
            for _ in range(args.matmuls):
                a @ a

        matmuls()
        alone = _median_ms(matmuls, args.repeats)
        for name in ("copy engine (contiguous)", "gather p32-b16k-w8", "gather p132-b16k-w8",
                     "gather per-part-b8k-w4"):
            fn = rows[name]
            single = next(r["ms"] for r in results if r["pages"] == n and r.get("copy") == name)
            reps = max(1, int(alone / max(1e-3, single)))
            mm, cp = [], []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s0.record()
                c0.record(side)
                with torch.cuda.stream(side):
                    for _ in range(reps):
                        fn()
                c1.record(side)
                matmuls()
                s1.record()
                torch.cuda.synchronize()
                mm.append(s0.elapsed_time(s1))
                cp.append(c0.elapsed_time(c1) / reps)
            row = {"pages": n, "overlap": name, "matmul_alone_ms": alone,
                   "matmul_with_copies_ms": statistics.median(mm), "matmul_slowdown": statistics.median(mm) / alone - 1,
                   "copy_ms_during": statistics.median(cp),
                   "copy_gb_per_s_during": nbytes / statistics.median(cp) / 1e6, "copies": reps}
            results.append(row)
            print(json.dumps(row), flush=True)
    return {
        "bench": "copy",
        "command": command_line("benchmarks.copy"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__},
        "page_bytes": page_bytes, "pool_pages": args.pool_pages, "repeats": args.repeats,
        "results": results,
    }


def _print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  {report['date']}  pages of {report['page_bytes'] // 1024} KiB")
    for r in report["results"]:
        if "copy" in r:
            print(f"{r['pages']:>5} pages  {r['copy']:<28}{r['ms']:8.3f} ms {r['gb_per_s']:7.1f} GB/s")
        else:
            print(f"{r['pages']:>5} pages  beside a matmul: {r['overlap']:<28} "
                  f"matmul {100 * r['matmul_slowdown']:+.1f}%, copy {r['copy_gb_per_s_during']:.1f} GB/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.copy", description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int_list, default=[64, 900])
    p.add_argument("--pool-pages", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--matmuls", type=int, default=10)
    p.add_argument("--out", default=None, help="write the JSON report here")
    return run_benchmark("copy", p.parse_args(argv), run, _print_table)


if __name__ == "__main__":
    sys.exit(main())
