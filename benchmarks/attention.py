"""Paged attention kernels against torch SDPA (cuDNN, FLASH), Qwen2.5-7B heads, on a GPU; where flash-attn-4
runs, also oomb's fa4 backend over the pages against FlashAttention-4 on contiguous K/V (what its gather and
scatter cost).

    python -m benchmarks.attention --out out/attention.json
    python -m benchmarks.attention --contexts 16384 --page-size 64

Work: a chunk of C=4096 queries (the newest tokens) over kv_len stored tokens, 28 query /
4 KV heads, d=128, bf16, pages in a pool in shuffled order. Our forward and forward+backward
(dQ, and dK/dV added into bf16 gradient pages) are timed with triton.testing.do_bench
(median, after a warm-up call that compiles). The baseline is torch SDPA on the same dense
work: queries = the last C positions against all kv_len keys (enable_gqa=True), with the
causal diagonal offset by kv_len - C. Backends take that offset in different ways:

- cuDNN: an explicit boolean mask [C, kv_len];
- FLASH: torch.nn.attention.bias.causal_lower_right (flash aligns causal masks bottom-right);
- a backend that refuses both is timed on full causal attention over kv_len instead
  (mode "full_causal"): its TFLOP/s are of that work, its seconds are not comparable.

With ``--window W`` only oomb's kernels run, each with and without a W-token sliding window (Gemma-3's 1024,
GPT-OSS's 128): a windowed call's time should stay flat as kv_len grows, a full one's grow with it.

FLOPs (forward) = 2 matmuls * 2 * H * D * (visible keys summed over queries)
                ~= 2 * 2 * C * H * D * (kv_len - C/2); forward+backward = 3.5x forward
(so full causal over S tokens is 2 * S^2 * H * D).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import (
    command_line,
    do_bench_s,
    int_list,
    library_versions,
    machine_description,
    run_benchmark,
)
from oomb.kernels import flash4_unavailable

H, H_KV, D, C = 28, 4, 128, 4096


def attention_flops(q_len: int, kv_len: int, window: int | None = None) -> float:
    """Forward FLOPs of causal attention of the last q_len positions over kv_len keys (each query sees at most
    ``window`` of them)."""
    if window is None:
        return 2.0 * 2.0 * q_len * H * D * (kv_len - q_len / 2)
    visible = sum(min(window, pos + 1) for pos in range(kv_len - q_len, kv_len))
    return 2.0 * 2.0 * H * D * visible


def paged_inputs(kv_len: int, page_size: int, device, *, h: int = H, h_kv: int = H_KV):
    n_pages = -(-kv_len // page_size)
    g = torch.Generator(device="cpu").manual_seed(0)
    page_table = torch.randperm(n_pages, generator=g).to(torch.int32).view(1, n_pages).to(device)
    k = torch.randn(1, h_kv, kv_len, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, h_kv, kv_len, D, device=device, dtype=torch.bfloat16)
    q = torch.randn(1, h, C, D, device=device, dtype=torch.bfloat16)
    pad = n_pages * page_size - kv_len

    def to_pool(x):  # [1, H_kv, T, D] -> pool [n_pages, H_kv, page, D] with page i at id page_table[i]
        x = F.pad(x, (0, 0, 0, pad)).view(h_kv, n_pages, page_size, D).transpose(0, 1)
        pool = torch.empty_like(x)
        pool[page_table[0].long()] = x
        return pool.contiguous()

    return q, k, v, to_pool(k), to_pool(v), page_table


def _ours(q, k_pool, v_pool, page_table, kv_len, backend: str = "triton", window: int | None = None) -> dict:
    from oomb.kernels import get_backend

    kernels = get_backend(backend, "cuda")
    paged_attention_forward, paged_attention_backward = kernels.forward, kernels.backward
    scale = D**-0.5
    dk_pool, dv_pool = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    d_out = torch.randn_like(q)

    def fwd():
        return paged_attention_forward(q, k_pool, v_pool, page_table, kv_len, scale=scale, sliding_window=window)

    def fwd_bwd():
        out, lse = fwd()
        paged_attention_backward(d_out, q, out, lse, k_pool, v_pool, dk_pool, dv_pool, page_table, kv_len,
                                 scale=scale, sliding_window=window)

    flops = attention_flops(C, kv_len, window)
    t_fwd, t_all = do_bench_s(fwd), do_bench_s(fwd_bwd)
    mode = "paged" if window is None else f"paged-window-{window}"
    return {"system": f"oomb-{kernels.name}-paged", "mode": mode, "window": window, "fwd_s": t_fwd, "fwd_bwd_s": t_all,
            "fwd_tflops": flops / t_fwd / 1e12, "fwd_bwd_tflops": 3.5 * flops / t_all / 1e12,
            "out": fwd()[0]}


def _fa4_contiguous(q, k, v, kv_len) -> dict:
    """FlashAttention-4 itself on the same work with contiguous K/V (no pages): what the fa4 backend's
    gather and scatter are measured against (its forward and backward functions, as the backend calls them)."""
    from flash_attn.cute import interface as fa

    scale = D**-0.5
    qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [1, T, H, D]
    d_out = torch.randn_like(qf)

    def fwd():
        return fa._flash_attn_fwd(qf, kf, vf, softmax_scale=scale, causal=True, return_lse=True)[:2]

    def fwd_bwd():
        out, lse = fwd()
        fa._flash_attn_bwd(qf, kf, vf, out, d_out, lse, softmax_scale=scale, causal=True)

    flops = attention_flops(C, kv_len)
    t_fwd, t_all = do_bench_s(fwd), do_bench_s(fwd_bwd)
    return {"system": "flash-attn-4-contiguous", "mode": "dense", "fwd_s": t_fwd, "fwd_bwd_s": t_all,
            "fwd_tflops": flops / t_fwd / 1e12, "fwd_bwd_tflops": 3.5 * flops / t_all / 1e12,
            "out": fwd()[0].transpose(1, 2)}


def _time_sdpa(backend, q, k, v, mask, full: bool) -> tuple[float, float, torch.Tensor]:
    """(fwd seconds, fwd+bwd seconds, output) of SDPA with one backend."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    d_out = torch.randn_like(q)

    def fwd():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=full, enable_gqa=True)

    def fwd_bwd():
        fwd().backward(d_out)

    with torch.no_grad():
        t_fwd = do_bench_s(fwd)
        out = fwd()
    return t_fwd, do_bench_s(fwd_bwd, grad_to_none=[q, k, v]), out


def _sdpa(backend_name, q, k, v, kv_len) -> dict:
    """Time SDPA with one backend on the offset-causal work, or on full causal work if it refuses."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import causal_lower_right

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    q_pos = torch.arange(kv_len - C, kv_len, device=q.device)[:, None]
    modes = {
        "cudnn": [("bool_mask", lambda: torch.arange(kv_len, device=q.device)[None, :] <= q_pos)],
        "flash": [("causal_lower_right", lambda: causal_lower_right(C, kv_len))],
    }[backend_name] + [("full_causal", lambda: None)]
    errors = []
    for mode, make_mask in modes:
        full = mode == "full_causal"
        try:
            if full:  # every position of kv_len as a query
                qq = torch.randn(1, H, kv_len, D, device=q.device, dtype=q.dtype)
                t_fwd, t_all, _ = _time_sdpa(backend, qq, k, v, None, True)
                out, flops = None, attention_flops(kv_len, kv_len)
            else:
                t_fwd, t_all, out = _time_sdpa(backend, q, k, v, make_mask(), False)
                flops = attention_flops(C, kv_len)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            errors.append(f"{mode}: {str(e).splitlines()[0][:200]}")
            continue
        finally:
            torch.cuda.empty_cache()
        row = {"system": f"torch-sdpa-{backend_name}", "mode": mode, "fwd_s": t_fwd, "fwd_bwd_s": t_all,
               "fwd_tflops": flops / t_fwd / 1e12, "fwd_bwd_tflops": 3.5 * flops / t_all / 1e12, "out": out}
        if full:
            row["note"] = (f"refused the offset mask ({'; '.join(errors)}); timed full causal attention with "
                           f"kv_len={kv_len} queries: TFLOP/s of that work, seconds not comparable")
        return row
    return {"system": f"torch-sdpa-{backend_name}", "mode": "failed", "error": "; ".join(errors)}


def _sdpa_split(backend_name, q, k, v, kv_len) -> dict:
    """The same work in SDPA's fastest paths: the chunk's queries over the past keys (no mask) plus
    over the chunk's own keys (``is_causal``, a square), timed as two calls with their backwards.

    Same FLOPs as the offset-causal work, but the two partial outputs are not merged (that would need
    their log-sum-exps, which SDPA does not return), so this is a speed reference, not an equal result.
    """
    from torch.nn.attention import SDPBackend

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    past = kv_len - C
    try:
        t_fwd, t_all, _ = _time_sdpa(backend, q, k[:, :, kv_len - C:], v[:, :, kv_len - C:], None, True)
        if past > 0:
            f2, a2, _ = _time_sdpa(backend, q, k[:, :, :past].contiguous(), v[:, :, :past].contiguous(), None, False)
            t_fwd, t_all = t_fwd + f2, t_all + a2
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return {"system": f"torch-sdpa-{backend_name}", "mode": "split_same_work",
                "error": str(e).splitlines()[0][:200]}
    finally:
        torch.cuda.empty_cache()
    flops = attention_flops(C, kv_len)
    return {"system": f"torch-sdpa-{backend_name}", "mode": "split_same_work", "fwd_s": t_fwd, "fwd_bwd_s": t_all,
            "fwd_tflops": flops / t_fwd / 1e12, "fwd_bwd_tflops": 3.5 * flops / t_all / 1e12,
            "note": "two calls (past keys unmasked + the chunk causal): same FLOPs, outputs not merged"}


def run(args) -> dict:
    device = torch.device("cuda")
    if args.fa4 and (reason := flash4_unavailable()) is not None:
        raise SystemExit(f"--fa4: {reason}")
    results = []
    for kv_len in args.contexts:
        q, k, v, k_pool, v_pool, page_table = paged_inputs(kv_len, args.page_size, device)
        rows = [_ours(q, k_pool, v_pool, page_table, kv_len)]
        if args.window is not None:  # the same kernels with a sliding window: only oomb's rows
            rows.append(_ours(q, k_pool, v_pool, page_table, kv_len, window=args.window))
            if args.fa4:
                rows += [_ours(q, k_pool, v_pool, page_table, kv_len, "fa4", window)
                         for window in (None, args.window)]
        elif args.fa4:  # the fa4 backend over the same pages, and FA4 on contiguous K/V
            rows += [_ours(q, k_pool, v_pool, page_table, kv_len, "fa4"), _fa4_contiguous(q, k, v, kv_len)]
        for backend in ("cudnn", "flash") if args.window is None else ():
            rows.append(_sdpa(backend, q, k, v, kv_len))
            rows.append(_sdpa_split(backend, q, k, v, kv_len))
        ours_out = rows[0]["out"].float()
        for row in rows:
            out = row.pop("out", None)
            row.update(kv_len=kv_len, q_len=C, page_size=args.page_size)
            if out is not None and row is not rows[0] and row.get("window") is None:
                # The same work? Our output against the baseline's (bf16 both).
                row["rel_diff_vs_ours"] = float((out.float() - ours_out).norm() / ours_out.norm())
            results.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, k_pool, v_pool, page_table, rows
        torch.cuda.empty_cache()

    return {
        "bench": "attention",
        "command": command_line("benchmarks.attention"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "gpu": torch.cuda.get_device_name(),
        "host": platform.node(),
        "versions": {**library_versions(), "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()},
        "shape": {"heads": H, "kv_heads": H_KV, "head_dim": D, "q_len": C, "dtype": "bfloat16",
                  "grad_pool_dtype": "bfloat16"},
        "window": args.window,
        "flops": "fwd = 2*2*H*D*(keys each query sees, summed: C*(kv_len - C/2) causal, about C*W with a window W); "
                 "fwd+bwd = 3.5x fwd",
        "results": results,
    }


def _print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  {report['date']}  H={H} H_kv={H_KV} D={D} C={C} bf16")
    print(f"{'system':<22}{'mode':<20}{'kv_len':>8}{'fwd ms':>9}{'fwd TF/s':>10}{'f+b ms':>9}{'f+b TF/s':>10}"
          f"{'% best SDPA':>12}")
    best = {}  # the fastest SDPA forward+backward per kv_len, any mode that does the same work
    for r in report["results"]:
        if r["system"].startswith("torch-sdpa") and "fwd_bwd_tflops" in r and r["mode"] != "full_causal":
            best[r["kv_len"]] = max(best.get(r["kv_len"], 0.0), r["fwd_bwd_tflops"])
    for r in report["results"]:
        if "error" in r:
            print(f"{r['system']:<22}{r['mode']:<20}{r.get('kv_len', 0):>8}  {r['error'][:70]}")
            continue
        ref = best.get(r["kv_len"])
        pct = f"{100 * r['fwd_bwd_tflops'] / ref:>11.0f}%" if ref else f"{'-':>12}"
        print(f"{r['system']:<22}{r['mode']:<20}{r['kv_len']:>8}{1e3 * r['fwd_s']:>9.2f}{r['fwd_tflops']:>10.1f}"
              f"{1e3 * r['fwd_bwd_s']:>9.2f}{r['fwd_bwd_tflops']:>10.1f}{pct}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int_list, default=[16384, 65536, 131072], help="kv_len values")
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--fa4", action="store_true",
                   help="also time oomb's fa4 backend over the pages and FlashAttention-4 on contiguous K/V")
    p.add_argument("--window", type=int, default=None,
                   help="time oomb's kernels with and without a sliding window of this many tokens (no SDPA rows)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    return run_benchmark("attention", p.parse_args(argv), run, _print_table)

if __name__ == "__main__":
    sys.exit(main())
