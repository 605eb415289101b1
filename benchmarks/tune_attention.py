"""Sweep tile settings of the Triton paged attention on a GPU (forward and backward timed apart).

    python -m benchmarks.tune_attention --kv-len 65536 --out out/tune.json

Qwen2.5-7B heads (28 query, 4 KV, d=128), a 4096-token chunk, page 128, bf16 pools and
gradient pools. Each candidate replaces ``oomb.kernels.tiles.choose_tiles`` and is timed
with triton.testing.do_bench (median, after a compiling call). Every candidate's output
is compared with the default's, so a fast but wrong setting shows up.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys

import torch

from benchmarks.attention import H_KV, C, H, attention_flops, paged_inputs
from benchmarks.common import command_line, int_list, kernel_times, run_benchmark
from oomb.kernels import tiles as kernel_tiles
from oomb.kernels.backward import paged_attention_backward
from oomb.kernels.forward import paged_attention_forward

# (name, overrides of the default Tiles). The default is measured first.
CANDIDATES = [
    ("default", {}),
    ("interleaved-m32", {"dkdv_head_major": False, "dkdv_m": 32}),  # rows interleaving a group's heads
    ("head-major-m32", {"dkdv_m": 32}),
    ("head-major-m64-4st", {"bwd_stages": 4}),
    ("head-major-m64-2st", {"bwd_stages": 2}),
    ("dq-m64", {"dq_m": 64}),
    ("no-tma", {"tma": False}),
    # the forward (424-443 TFLOP/s against cuDNN's 600+ on the H200): key blocks, stages, a smaller row tile
    ("fwd-n64", {"fwd_n": 64}),
    ("fwd-2st", {"fwd_stages": 2}),
    ("fwd-4st", {"fwd_stages": 4}),
    ("fwd-m64-w4", {"fwd_m": 64, "fwd_warps": 4}),
    # dQ inside the dK/dV kernel (fp32 atomics, no dQ kernel). Its [dkdv_m, D] fp32 tile spills inside the row
    # loops at 64 rows and not at 32 (offline ptxas for sm_90a), so 32 rows with 3 and 4 stages too.
    ("dq-fused", {"dq_fused": True}),
    ("dq-fused-m32", {"dq_fused": True, "dkdv_m": 32}),
    ("dq-fused-m32-4st", {"dq_fused": True, "dkdv_m": 32, "bwd_stages": 4}),
    ("dq-fused-2st", {"dq_fused": True, "bwd_stages": 2}),
]


def run(args) -> dict:
    import triton.testing

    from oomb.sparse import PageSelection, select_pages

    dev = torch.device("cuda")
    h, h_kv = args.heads
    q, _, _, k_pool, v_pool, page_table = paged_inputs(args.kv_len, args.page_size, dev, h=h, h_kv=h_kv)
    d_out = torch.randn_like(q)
    dk_pool, dv_pool = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    scale = q.shape[-1] ** -0.5
    kw = {}
    flops = attention_flops(C, args.kv_len) * h / H
    if args.budget:
        n_past = (args.kv_len - C) // args.page_size
        policy = PageSelection(page_budget=args.budget, block=128, score="mean")  # the pools' mean keys below
        sel = select_pages(q, k_pool.float().mean(dim=2), page_table, n_past, args.page_size, policy)
        kw = {"page_select": sel, "select_block": 128}
        flops = attention_flops(C, min(args.kv_len, args.budget * args.page_size + C)) * h / H
    base = kernel_tiles.choose_tiles(q.shape[-1], args.page_size, q.dtype)
    original = kernel_tiles.choose_tiles
    rows, ref = [], None
    wanted = [c for c in CANDIDATES if args.candidates is None or c[0] in args.candidates]
    for name, override in wanted:
        tiles = dataclasses.replace(base, **override)
        kernel_tiles.choose_tiles = lambda *a, tiles=tiles: tiles  # noqa: E731
        try:
            def fwd():
                return paged_attention_forward(q, k_pool, v_pool, page_table, args.kv_len, scale=scale, **kw)

            out, lse = fwd()

            def bwd(out=out, lse=lse):
                return paged_attention_backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool,
                                                page_table, args.kv_len, scale=scale, **kw)

            dk_pool.zero_()
            dv_pool.zero_()
            dq, _ = bwd()
            got = (out.float(), dq.float(), dk_pool.float().clone())
            if ref is None:
                ref = got
            err = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref, strict=True))
            t_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median") / 1e3
            t_b = triton.testing.do_bench(bwd, warmup=25, rep=100, return_mode="median") / 1e3
            row = {"name": name, "tiles": dataclasses.asdict(tiles), "fwd_ms": t_f * 1e3, "bwd_ms": t_b * 1e3,
                   "fwd_tflops": flops / t_f / 1e12, "bwd_tflops": 2.5 * flops / t_b / 1e12,
                   "fwd_bwd_tflops": 3.5 * flops / (t_f + t_b) / 1e12, "max_rel_diff_vs_default": err,
                   "bwd_kernels_ms": kernel_times(bwd)}
        except Exception as e:  # a setting that does not compile or fit is a result too
            row = {"name": name, "tiles": dataclasses.asdict(tiles), "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    kernel_tiles.choose_tiles = original
    return {"bench": "tune_attention", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "kv_len": args.kv_len, "q_len": C, "heads": [h, h_kv],
            "budget_pages": args.budget, "page_size": args.page_size,
            "flops": "fwd = 2*2*C*H*D*(visible keys - C/2); bwd = 2.5x fwd",
            "command": command_line("benchmarks.tune_attention"),
            "results": rows}


def _print_table(report: dict) -> None:
    rows = report["results"]
    print(f"\nkv_len {report['kv_len']} heads {report['heads']} budget {report['budget_pages']}")
    print(f"{'name':<22}{'fwd ms':>8}{'fwd TF/s':>10}{'bwd ms':>8}{'bwd TF/s':>10}{'f+b TF/s':>10}{'diff':>10}"
          "  backward kernels (ms)")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<22} {r['error'][:80]}")
        else:
            kernels = " ".join(f"{k.strip('_')[:14]}={v:.2f}" for k, v in r["bwd_kernels_ms"].items() if v > 0.05)
            print(f"{r['name']:<22}{r['fwd_ms']:>8.2f}{r['fwd_tflops']:>10.1f}{r['bwd_ms']:>8.2f}"
                  f"{r['bwd_tflops']:>10.1f}{r['fwd_bwd_tflops']:>10.1f}{r['max_rel_diff_vs_default']:>10.1e}"
                  f"  {kernels}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune_attention", description=__doc__.splitlines()[0])
    p.add_argument("--kv-len", type=int, default=65536)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--heads", type=int_list, default=[H, H_KV], help="query,KV heads (default 28,4)")
    p.add_argument("--budget", type=int, default=None, help="page-sparse: pages per block of 128 queries")
    p.add_argument("--candidates", type=lambda t: t.split(","), default=None,
                   help=f"comma-separated names to time (default all: {','.join(c[0] for c in CANDIDATES)})")
    p.add_argument("--out", default=None, help="write the JSON report here")
    return run_benchmark("tune", p.parse_args(argv), run, _print_table)


if __name__ == "__main__":
    sys.exit(main())
