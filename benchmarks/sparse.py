"""Page-sparse attention against dense, on a GPU: attention kernels and whole training steps.

    python -m benchmarks.sparse --out out/sparse.json
    python -m benchmarks.sparse --contexts 65536 --lengths 65536 --sparse-lengths 524288

Kernels: one chunk of C=4096 queries of Qwen2.5-7B's heads (28 query / 4 KV, d=128, bf16)
over kv_len stored tokens in 128-token pages; forward+backward (dQ, dK/dV added into bf16
gradient pages) with dense attention and with a budget of ``--budget`` pages per block of
``--block`` queries (triton.testing.do_bench medians after a compiling call). The page
lists come from oomb.sparse.select_pages on the same inputs; its time is reported apart.

Steps: one chunked_backward of the ``--preset`` model (random init, bf16, bf16 gradients
kept allocated) at each length, dense and sparse, after a warm-up step (CUDA events,
median of ``--repeats``); sparse alone at ``--sparse-lengths``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys

import torch

import oomb
from benchmarks.attention import H_KV, C, D, H, attention_flops, paged_inputs
from benchmarks.common import (
    add_step_arguments,
    command_line,
    do_bench_s,
    int_list,
    kernel_times,
    library_versions,
    run_benchmark,
    time_steps,
)
from oomb.engine import store_for_model
from oomb.sparse import PageSelection, select_pages


def _kernel_rows(kv_len: int, args) -> list[dict]:
    from oomb.kernels.backward import paged_attention_backward
    from oomb.kernels.forward import paged_attention_forward

    page = args.page
    q, _, _, k_pool, v_pool, page_table = paged_inputs(kv_len, page, torch.device("cuda"))
    mean_k = k_pool.float().mean(dim=2)  # [pages, H_kv, D], as the store keeps it for score="mean"
    n_past = (kv_len - C) // page
    policy = PageSelection(page_budget=args.budget, block=args.block, score="mean")
    sel = select_pages(q, mean_k, page_table, n_past, page, policy)
    t_select = do_bench_s(lambda: select_pages(q, mean_k, page_table, n_past, page, policy))
    dk_pool, dv_pool = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    d_out = torch.randn_like(q)
    scale = D**-0.5
    rows = []
    for mode, kw in (("dense", {}), ("sparse", {"page_select": sel, "select_block": args.block})):
        def fwd(kw=kw):
            return paged_attention_forward(q, k_pool, v_pool, page_table, kv_len, scale=scale, **kw)

        def fwd_bwd(kw=kw):
            out, lse = fwd()
            paged_attention_backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, page_table, kv_len,
                                     scale=scale, **kw)

        visible_kv = kv_len if sel is None or mode == "dense" else min(kv_len, args.budget * page + C)
        flops = attention_flops(C, visible_kv)  # keys each query actually attends
        t_fwd, t_all = do_bench_s(fwd), do_bench_s(fwd_bwd)
        rows.append({"kind": "kernel", "mode": mode, "kv_len": kv_len, "fwd_s": t_fwd, "fwd_bwd_s": t_all,
                     "fwd_bwd_tflops_of_work_done": 3.5 * flops / t_all / 1e12,
                     "select_s": t_select if mode == "sparse" else None,
                     "budget_pages": args.budget if mode == "sparse" else None})
        print(json.dumps(rows[-1]), flush=True)
    dense, sparse = rows
    sparse["speedup_fwd_bwd"] = dense["fwd_bwd_s"] / sparse["fwd_bwd_s"]
    sparse["speedup_incl_selection"] = dense["fwd_bwd_s"] / (sparse["fwd_bwd_s"] + sparse["select_s"])
    return rows


def _split_and_sweep(kv_len: int, args) -> list[dict]:
    """Per-kernel times of sparse and dense fwd+bwd, then sparse fwd+bwd under tile variants."""
    import dataclasses

    from oomb.kernels import tiles as kernel_tiles
    from oomb.kernels.backward import paged_attention_backward
    from oomb.kernels.forward import paged_attention_forward

    page = args.page
    q, _, _, k_pool, v_pool, page_table = paged_inputs(kv_len, page, torch.device("cuda"))
    mean_k = k_pool.float().mean(dim=2)
    n_past = (kv_len - C) // page
    # Mean keys only: which pages are chosen does not change the kernels' work, only which pages they read.
    policy = PageSelection(page_budget=args.budget, block=args.block, score="mean")
    sel = select_pages(q, mean_k, page_table, n_past, page, policy)
    dk_pool, dv_pool = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    d_out = torch.randn_like(q)
    rows = []
    for mode, kw in (("dense", {}), ("sparse", {"page_select": sel, "select_block": args.block})):
        def fwd_bwd(kw=kw):
            out, lse = paged_attention_forward(q, k_pool, v_pool, page_table, kv_len, scale=D**-0.5, **kw)
            paged_attention_backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, page_table, kv_len,
                                     scale=D**-0.5, **kw)

        rows.append({"kind": "kernel_split", "mode": mode, "kv_len": kv_len, "ms_per_call": kernel_times(fwd_bwd)})
        print(json.dumps(rows[-1]), flush=True)
    base = kernel_tiles.choose_tiles(D, page, torch.bfloat16)
    variants = {
        "default": base,
        "dkdv_n64": dataclasses.replace(base, dkdv_n=64),
        "dkdv_m64": dataclasses.replace(base, dkdv_m=64),
        "dkdv_n64_m64": dataclasses.replace(base, dkdv_n=64, dkdv_m=64),
        "dq_m64": dataclasses.replace(base, dq_m=64),
        "bwd_warps4": dataclasses.replace(base, bwd_warps=4),
        "bwd_stages2": dataclasses.replace(base, bwd_stages=2),
    }
    original = kernel_tiles.choose_tiles
    kw = {"page_select": sel, "select_block": args.block}
    try:
        for name, tiles in variants.items():
            kernel_tiles.choose_tiles = lambda *a, tiles=tiles: tiles  # noqa: E731

            def fwd_bwd():
                out, lse = paged_attention_forward(q, k_pool, v_pool, page_table, kv_len, scale=D**-0.5, **kw)
                paged_attention_backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, page_table,
                                         kv_len, scale=D**-0.5, **kw)
            try:
                rows.append({"kind": "sweep", "variant": name, "kv_len": kv_len, "tiles": dataclasses.asdict(tiles),
                             "fwd_bwd_s": do_bench_s(fwd_bwd)})
            except Exception as e:  # a variant that does not compile (registers, shared memory) is skipped
                rows.append({"kind": "sweep", "variant": name, "kv_len": kv_len, "error": str(e)[:200]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        kernel_tiles.choose_tiles = original
    return rows


def _profile_step(model, n: int, args) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")
    policy = PageSelection(page_budget=args.budget, block=args.block)
    times = kernel_times(lambda: oomb.chunked_backward(model, ids, chunk_size=args.chunk, page_size=args.page,
                                                        selection=policy), repeats=1)
    return {"kind": "step_profile", "mode": "sparse", "seq_len": n, "ms_per_step": times}


def run(args) -> dict:
    results = []
    for kv_len in args.contexts:
        results += _kernel_rows(kv_len, args)
        torch.cuda.empty_cache()
    for kv_len in args.split_contexts:
        results += _split_and_sweep(kv_len, args)
        torch.cuda.empty_cache()

    steps = [(n, m) for n in args.lengths for m in ("dense", "sparse")] + [(n, "sparse") for n in args.sparse_lengths]
    if steps or args.profile_step:
        from oomb.train.config.presets import build_model

        model = build_model(args.preset, dtype=torch.bfloat16, device=torch.device("cuda"))
        model.train()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        warmed = set()
        if args.profile_step:
            results.append(_profile_step(model, args.profile_step, args))
            print(json.dumps(results[-1]), flush=True)
            oomb.release_memory(model)
        for n, mode in steps:
            ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda")
            budget = args.budget if mode == "sparse" else None
            policy = PageSelection(page_budget=args.budget, block=args.block) if mode == "sparse" else None

            def step(ids=ids, budget=budget, policy=policy):
                oomb.chunked_backward(model, ids, chunk_size=args.chunk, page_size=args.page,
                                      page_budget=budget, selection=policy)

            row = {"kind": "step", "mode": mode, "seq_len": n, "preset": args.preset, "chunk_size": args.chunk,
                   "budget_pages": budget}
            try:
                if mode not in warmed:  # compile this mode's kernels at a short length
                    warm = torch.randint(0, model.config.vocab_size, (1, min(n, 4 * args.chunk + args.budget
                                                                             * args.page)), device="cuda")
                    oomb.chunked_backward(model, warm, chunk_size=args.chunk, page_size=args.page,
                                          page_budget=budget, selection=policy)
                    warmed.add(mode)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                times = time_steps(step, args.repeats)
                med = statistics.median(times)
                row.update(step_s=med, step_times_s=times, tokens_per_s=n / med,
                           peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30,
                           store_gib=store_for_model(model).nbytes() / 2**30)
            except torch.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e).splitlines()[0]}"
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "step_times_s"}), flush=True)
            oomb.release_memory(model)
            torch.cuda.empty_cache()
        by = {(r["seq_len"], r["mode"]): r for r in results if r["kind"] == "step" and "step_s" in r}
        for (n, mode), r in by.items():
            if mode == "sparse" and (n, "dense") in by:
                r["speedup_vs_dense"] = by[(n, "dense")]["step_s"] / r["step_s"]

    return {
        "bench": "sparse",
        "command": command_line("benchmarks.sparse"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "host": platform.node(),
        "versions": library_versions(),
        "kernel_shape": {"heads": H, "kv_heads": H_KV, "head_dim": D, "q_len": C, "page_size": args.page,
                         "dtype": "bfloat16", "select_block": args.block, "budget_pages": args.budget},
        "results": results,
    }


def _print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  {report['date']}  budget {report['kernel_shape']['budget_pages']} pages, "
          f"block {report['kernel_shape']['select_block']}")
    for r in report["results"]:
        if r["kind"] in ("kernel_split", "sweep", "step_profile"):
            continue
        if r["kind"] == "kernel":
            extra = (f"  x{r['speedup_fwd_bwd']:.1f} (x{r['speedup_incl_selection']:.1f} with selection "
                     f"{1e3 * r['select_s']:.2f} ms)") if r["mode"] == "sparse" else ""
            print(f"kernel {r['mode']:<7} kv {r['kv_len']:>8}  fwd {1e3 * r['fwd_s']:8.2f} ms  "
                  f"fwd+bwd {1e3 * r['fwd_bwd_s']:8.2f} ms{extra}")
        elif "error" in r:
            print(f"step   {r['mode']:<7} {r['seq_len']:>8}  {r['error'][:70]}")
        else:
            extra = f"  x{r['speedup_vs_dense']:.2f} vs dense" if "speedup_vs_dense" in r else ""
            print(f"step   {r['mode']:<7} {r['seq_len']:>8}  {r['step_s']:8.2f} s  peak {r['peak_gpu_gib']:6.1f} GiB"
                  f"{extra}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int_list, default=[65536, 131072, 262144], help="kernel kv_len values")
    p.add_argument("--lengths", type=int_list, default=[65536, 131072], help="step lengths, dense and sparse")
    p.add_argument("--sparse-lengths", type=int_list, default=[], help="step lengths, sparse only")
    p.add_argument("--split-contexts", type=int_list, default=[],
                   help="kv_len values at which to time each kernel and sweep backward tiles (sparse)")
    p.add_argument("--profile-step", type=int, default=0, help="profile the kernels of one sparse step this long")
    p.add_argument("--block", type=int, default=128, help="queries per selection block")
    add_step_arguments(p)
    return run_benchmark("sparse", p.parse_args(argv), run, _print_table)


if __name__ == "__main__":
    sys.exit(main())
