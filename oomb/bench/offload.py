"""Offload against pages on the GPU: step time, GPU memory, pinned host memory, on a GPU.

    python -m oomb.bench.offload --out results/offload.json
    python -m oomb.bench.offload --dense-lengths 65536 --sparse-lengths 131072 --growth-lengths 65536,262144

One chunked_backward step of ``--preset`` (random init, bf16, bf16 gradients kept
allocated) per setting, after a warm-up step of the same setting at a short length (CUDA
events). Pairs: dense with and without offload at ``--dense-lengths``, sparse (budget
``--budget``) with and without offload at ``--sparse-lengths``; then sparse + offload at
``--growth-lengths``; the GPU memory per extra 10K tokens is taken between the shortest
and the longest sparse + offload step. Reports the peak GPU memory,
the store's device bytes and pinned host bytes, and the process RSS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import torch

import oomb
from oomb.bench.common import add_step_arguments, int_list, run_benchmark
from oomb.bench.core import _time_steps
from oomb.engine import store_for_model


def _rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def run(args) -> dict:
    from oomb.train.presets import build_model

    model = build_model(args.preset, dtype=torch.bfloat16, device=torch.device("cuda"))
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    vocab = model.config.vocab_size
    settings = ([(n, None, off) for n in args.dense_lengths for off in (False, True)]
                + [(n, args.budget, off) for n in args.sparse_lengths for off in (False, True)]
                + [(n, args.budget, True) for n in args.growth_lengths])
    results, warmed = [], set()
    for n, budget, offload in settings:
        kw = dict(chunk_size=args.chunk, page_size=args.page, page_budget=budget, offload=offload)
        row = {"seq_len": n, "mode": "dense" if budget is None else "sparse", "budget_pages": budget,
               "offload": offload}
        try:
            if (budget, offload) not in warmed:
                warm = torch.randint(0, vocab, (1, min(n, 3 * args.chunk + (budget or 0) * args.page)), device="cuda")
                oomb.chunked_backward(model, warm, **kw)
                warmed.add((budget, offload))
            oomb.release_memory(model)
            torch.cuda.empty_cache()
            ids = torch.randint(0, vocab, (1, n), device="cuda")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = _time_steps(lambda ids=ids, kw=kw: oomb.chunked_backward(model, ids, **kw), args.repeats)
            store = store_for_model(model)
            row.update(step_s=sorted(times)[len(times) // 2], step_times_s=times,
                       peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30,
                       store_device_gib=store.nbytes() / 2**30,
                       store_host_gib=store.host_nbytes() / 2**30 if offload else 0.0,
                       rss_gib=_rss_gib())
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e).splitlines()[0]}"
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_times_s"}), flush=True)
        oomb.release_memory(model)
        torch.cuda.empty_cache()

    by = {(r["seq_len"], r["mode"], r["offload"]): r for r in results if "step_s" in r}
    overhead = {f"{mode}@{n}": by[(n, mode, True)]["step_s"] / by[(n, mode, False)]["step_s"] - 1
                for (n, mode, off) in by if off and (n, mode, False) in by}
    growth = {}
    rows = sorted((r for r in results if r["mode"] == "sparse" and r["offload"] and "step_s" in r),
                  key=lambda r: r["seq_len"])
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        growth = {"from": lo["seq_len"], "to": hi["seq_len"],
                  "gpu_mib_per_10k_tokens": (hi["peak_gpu_gib"] - lo["peak_gpu_gib"]) * 1024 / (hi["seq_len"]
                                                                                              - lo["seq_len"]) * 1e4}
    return {
        "bench": "offload",
        "command": "python -m oomb.bench.offload " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "host": platform.node(),
        "versions": {"torch": torch.__version__, "oomb": oomb.__version__},
        "preset": args.preset, "chunk_size": args.chunk, "page_size": args.page,
        "results": results,
        "offload_overhead": overhead,
        "sparse_offload_memory_growth": growth,
    }


def _print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  {report['date']}  preset {report['preset']}")
    for r in report["results"]:
        head = f"{r['mode']:<7}{'offload' if r['offload'] else 'gpu':<8}{r['seq_len']:>9}"
        if "error" in r:
            print(f"{head}  {r['error'][:70]}")
        else:
            print(f"{head}  {r['step_s']:8.2f} s  peak GPU {r['peak_gpu_gib']:7.2f} GiB  store GPU "
                  f"{r['store_device_gib']:6.2f} GiB  host {r['store_host_gib']:6.2f} GiB  RSS {r['rss_gib']:6.1f} GiB")
    for k, v in report["offload_overhead"].items():
        print(f"offload overhead {k}: {100 * v:+.1f}%")
    g = report["sparse_offload_memory_growth"]
    if g:
        print(f"sparse+offload GPU memory per extra 10K tokens ({g['from']} -> {g['to']}): "
              f"{g['gpu_mib_per_10k_tokens']:.2f} MiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oomb bench offload", description=__doc__.splitlines()[0])
    p.add_argument("--dense-lengths", type=int_list, default=[65536])
    p.add_argument("--sparse-lengths", type=int_list, default=[131072])
    p.add_argument("--growth-lengths", type=int_list, default=[65536, 262144])
    add_step_arguments(p)
    return run_benchmark("offload", p.parse_args(argv), run, _print_table)


if __name__ == "__main__":
    sys.exit(main())
