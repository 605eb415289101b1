"""Sweep tile settings of the Triton paged attention on a GPU (forward and backward timed apart).

    python -m oomb.bench.tune_attention --kv-len 65536 --out results/tune.json

Qwen2.5-7B heads (28 query, 4 KV, d=128), a 4096-token chunk, page 128, bf16 pools and
gradient pools. Each candidate replaces ``triton_attention.choose_tiles`` and is timed
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

from oomb.bench.attention import H_KV, C, H, _paged_inputs, attention_flops
from oomb.bench.common import run_benchmark
from oomb.kernels import triton_attention as T

# (name, overrides of the default Tiles). The default is measured first.
CANDIDATES = [
    ("default", {}),
    ("dq-n64", {"dq_n": 64}),
    ("no-tma", {"tma": False}),
    ("bwd-4-stages", {"bwd_stages": 4}),
    ("dq-m64", {"dq_m": 64, "dq_n": 128}),
    ("dkdv-m64-4st", {"dkdv_m": 64, "bwd_stages": 4}),
    ("fwd-n64", {"fwd_n": 64}),
    ("fwd-2-stages", {"fwd_stages": 2}),
    ("fwd-m256", {"fwd_m": 256}),
]


def run(args) -> dict:
    import triton.testing

    dev = torch.device("cuda")
    q, _, _, k_pool, v_pool, page_table = _paged_inputs(args.kv_len, args.page_size, dev)
    d_out = torch.randn_like(q)
    dk_pool, dv_pool = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    scale = q.shape[-1] ** -0.5
    base = T.choose_tiles(q.shape[-1], args.page_size, q.dtype)
    original = T.choose_tiles
    flops = attention_flops(C, args.kv_len)
    rows, ref = [], None
    for name, override in CANDIDATES:
        tiles = dataclasses.replace(base, **override)
        T.choose_tiles = lambda *a, tiles=tiles: tiles  # noqa: E731
        try:
            def fwd():
                return T.paged_attention_forward(q, k_pool, v_pool, page_table, args.kv_len, scale=scale)

            out, lse = fwd()

            def bwd(out=out, lse=lse):
                return T.paged_attention_backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool,
                                                  page_table, args.kv_len, scale=scale)

            dq, _ = bwd()
            if ref is None:
                ref = (out.float(), dq.float())
            err = max(float((out.float() - ref[0]).norm() / ref[0].norm()),
                      float((dq.float() - ref[1]).norm() / ref[1].norm()))
            t_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median") / 1e3
            t_b = triton.testing.do_bench(bwd, warmup=25, rep=100, return_mode="median") / 1e3
            row = {"name": name, "tiles": dataclasses.asdict(tiles), "fwd_ms": t_f * 1e3, "bwd_ms": t_b * 1e3,
                   "fwd_tflops": flops / t_f / 1e12, "bwd_tflops": 2.5 * flops / t_b / 1e12,
                   "fwd_bwd_tflops": 3.5 * flops / (t_f + t_b) / 1e12, "max_rel_diff_vs_default": err}
        except Exception as e:  # a setting that does not compile or fit is a result too
            row = {"name": name, "tiles": dataclasses.asdict(tiles), "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    T.choose_tiles = original
    return {"bench": "tune_attention", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "kv_len": args.kv_len, "q_len": C, "heads": [H, H_KV],
            "page_size": args.page_size, "command": "python -m oomb.bench.tune_attention " + " ".join(sys.argv[1:]),
            "results": rows}


def _print_table(report: dict) -> None:
    rows = report["results"]
    print(f"\n{'name':<18}{'fwd ms':>8}{'fwd TF/s':>10}{'bwd ms':>8}{'bwd TF/s':>10}{'f+b TF/s':>10}{'diff':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<18} {r['error'][:80]}")
        else:
            print(f"{r['name']:<18}{r['fwd_ms']:>8.2f}{r['fwd_tflops']:>10.1f}{r['bwd_ms']:>8.2f}"
                  f"{r['bwd_tflops']:>10.1f}{r['fwd_bwd_tflops']:>10.1f}{r['max_rel_diff_vs_default']:>10.1e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oomb bench tune", description=__doc__.splitlines()[0])
    p.add_argument("--kv-len", type=int, default=65536)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--out", default=None, help="write the JSON report here")
    return run_benchmark("tune", p.parse_args(argv), run, _print_table)


if __name__ == "__main__":
    sys.exit(main())
