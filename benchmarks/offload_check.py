"""Diagnose test_offload_bit_identical_on_gpu[dense]: offload vs device-resident store, several ways.

One process, same model and inputs as tests/engine/test_gpu_bf16.py (Qwen2, 4 layers, bf16,
16384 + 77 tokens, chunk 2048, page 128). Runs, in order of importance (later ones are skipped
when the time budget would be exceeded; the JSON is rewritten after every run):

    dense   device store (ref), offload, offload in synchronous mode (OOMB_OFFLOAD_SYNC=1),
            device store again (is the reference itself deterministic?), offload again
    sparse  (page_budget=8) ref, offload, offload synchronous
    dense with backend="torch" (PyTorch reference kernels): ref, offload
    dense with the committed dK/dV tiles, if this tree's Triton tiles have ``dkdv_head_major``
            (uncommitted kernel tuning): ref, offload

and prints, for each comparison, whether the loss and every gradient are bit-identical, the
max abs difference, the number of differing elements, and the parameters that differ most.

Reading it: ref vs ref#2 differ -> the device-resident path is not deterministic (not offload);
offload differs but offload-sync does not -> a stream race in the offload overlap; offload-sync
differs too -> a logic difference (not timing); torch backend identical but Triton not ->
the kernels depend on something besides the values (addresses, uninitialised memory).

    python -m benchmarks.offload_check --out out/offload-bit-identity.json   # H200, < 90 s
    python -m benchmarks.offload_check --device cpu --out /tmp/check.json    # tiny config, checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import oomb
from benchmarks.common import command_line, machine_description
from oomb.engine import store_for_model
from oomb.offload.copy import SYNC_ENV


def _model(device: str, tiny: bool, dtype: torch.dtype):
    torch.manual_seed(0)
    if tiny:
        cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          attention_dropout=0.0)
    else:  # tests/engine/test_gpu_bf16.py::_model
        cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                          attention_dropout=0.0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


def _git_info() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception as e:  # no git on the machine, not a repository: not fatal
            return f"unavailable: {e}"
    return {"head": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "status": git("status", "--porcelain"), "diff_stat": git("diff", "--stat", "HEAD")}


def _tiles_info(device: str):
    if device != "cuda":
        return None
    try:
        from oomb.kernels import tiles as ta
        return {"tiles_d64_p128_bf16": repr(ta.choose_tiles(64, 128, torch.bfloat16)),
                "has_dkdv_head_major": "dkdv_head_major" in {f.name for f in dataclasses.fields(ta.Tiles)}}
    except Exception as e:
        return {"error": repr(e)}


class _CommittedTiles:
    """Context: the Triton launchers get tiles without the uncommitted head-major dK/dV tuning."""

    def __enter__(self):
        from oomb.kernels import tiles as ta
        self.ta, self.orig = ta, ta.choose_tiles

        def choose(*args, **kwargs):
            t = self.orig(*args, **kwargs)
            if getattr(t, "dkdv_head_major", False):
                t = dataclasses.replace(t, dkdv_head_major=False, dkdv_m=32)  # the committed 32-row tiles
            return t
        ta.choose_tiles = choose
        return self

    def __exit__(self, *exc):
        self.ta.choose_tiles = self.orig


def _run(model, ids, cfg: dict, spec: dict, cuda: bool) -> dict:
    os.environ[SYNC_ENV] = "1" if spec.get("sync") else "0"
    oomb.release_memory(model)  # a fresh store, so it reads the variable
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ctx = _CommittedTiles() if spec.get("committed_tiles") else None
    try:
        if ctx:
            ctx.__enter__()
        loss = oomb.chunked_backward(model, ids, chunk_size=cfg["chunk"], page_size=cfg["page"],
                                     page_budget=spec.get("budget"), offload=spec["offload"],
                                     backend=spec.get("backend", "auto"))
        if cuda:
            torch.cuda.synchronize()
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
        os.environ.pop(SYNC_ENV, None)
    seconds = time.perf_counter() - t0
    store = store_for_model(model)
    synchronous = getattr(store, "synchronous", None)
    oomb.release_memory(model)
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach().float().clone(), "grads": grads, "seconds": seconds,
            "store": type(store).__name__ if store is not None else None, "synchronous": synchronous}


def _compare(a: dict, b: dict, top: int = 6) -> dict:
    """b against the reference a."""
    params, by_layer = [], {}
    n_diff_total, max_abs = 0, 0.0
    for name, ga in a["grads"].items():
        gb = b["grads"].get(name)
        if gb is None:
            params.append({"name": name, "missing": True})
            continue
        differ = ~((ga == gb) | (torch.isnan(ga) & torch.isnan(gb)))
        n = int(differ.sum())
        if not n:
            continue
        d = (ga - gb).abs().nan_to_num(nan=float("inf"))
        i = int(torch.argmax(torch.where(differ, d, torch.zeros_like(d))))
        rel = (d / ga.abs().clamp_min(1e-30))[differ]
        entry = {"name": name, "n_diff": n, "numel": ga.numel(), "max_abs": float(d.max()),
                 "max_rel": float(rel.max()), "median_rel": float(rel.median()),
                 "at_max": {"index": i, "ref": float(ga.reshape(-1)[i]), "other": float(gb.reshape(-1)[i])}}
        params.append(entry)
        n_diff_total += n
        max_abs = max(max_abs, entry["max_abs"])
        m = re.search(r"layers\.(\d+)\.", name)
        layer = f"layer{m.group(1)}" if m else name.split(".")[-2] if "." in name else name
        by_layer[layer] = by_layer.get(layer, 0) + n
    params.sort(key=lambda e: -e.get("max_abs", float("inf")))
    numel = sum(g.numel() for g in a["grads"].values())
    return {"identical": n_diff_total == 0 and not any(p.get("missing") for p in params),
            "loss_identical": bool(torch.equal(a["loss"], b["loss"])),
            "loss_ref": float(a["loss"]), "loss_other": float(b["loss"]),
            "max_abs": max_abs, "n_diff": n_diff_total, "numel": numel,
            "n_params_differing": len(params), "diff_by_layer": by_layer, "top": params[:top]}


def _verdict(c: dict) -> list[str]:
    def same(label):
        return c[label]["identical"] if label in c else None
    lines = []
    if same("dense: ref#2 vs ref") is False:
        lines.append("the device-resident (non-offload) path is NOT deterministic run to run: not an offload bug")
    off, sync = same("dense: offload vs ref"), same("dense: offload-sync vs ref")
    if off is True and sync is True and same("dense: offload#2 vs ref") in (True, None):
        lines.append("dense offload is bit-identical now (the fixes on this branch, or the race did not fire)")
    if off is False and sync is True:
        lines.append("dense: offload differs, synchronous offload does not -> a stream race in the overlap")
    if sync is False:
        lines.append("dense: synchronous offload differs too -> a logic difference, not timing")
    if same("dense: offload#2 vs offload#1") is False:
        lines.append("dense: two offload runs differ from each other -> nondeterministic (race)")
    if same("dense-torch: offload vs ref") is True and off is False:
        lines.append("PyTorch kernels identical, Triton not -> kernels depend on more than the values")
    if same("dense-committed-tiles: offload vs ref") is True and off is False:
        lines.append("identical with the committed dK/dV tiles -> suspect the uncommitted head-major kernel tuning")
    return lines or ["no clear pattern: read the table"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.offload_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny model and sequence (default on CPU)")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--page", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None, help="page budget of the sparse runs")
    ap.add_argument("--time-budget", type=float, default=80.0, help="seconds; later runs are skipped past it")
    ap.add_argument("--out", default="offload_check.json", help="the JSON report")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    tiny = args.tiny or not cuda
    cfg = {"seq_len": args.seq_len or (200 + 13 if tiny else 16384 + 77),
           "chunk": args.chunk or (32 if tiny else 2048), "page": args.page or (8 if tiny else 128),
           "budget": args.budget or (2 if tiny else 8)}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    dtype = torch.bfloat16
    torch.manual_seed(1234)
    vocab = 256 if tiny else 4096
    ids = torch.randint(0, vocab, (1, cfg["seq_len"]), device=args.device)
    model = _model(args.device, tiny, dtype)

    tiles = _tiles_info(args.device)
    report = {"bench": "offload_check",
              "command": command_line("benchmarks.offload_check", argv),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine_description(),
              "config": {**cfg, "device": args.device, "tiny": tiny, "dtype": str(dtype)},
              "env": {"torch": torch.__version__, "python": sys.version.split()[0],
                      "gpu": torch.cuda.get_device_name() if cuda else None,
                      "triton": _version("triton"), "transformers": _version("transformers"),
                      "liger": _version("liger_kernel"), "oomb": oomb.__file__},
              "git": _git_info(), "tiles": tiles, "runs": {}, "comparisons": {}, "skipped": [], "errors": {}}

    b = cfg["budget"]
    runs = [
        ("dense/ref", {"offload": False}),
        ("dense/offload", {"offload": True}),
        ("dense/offload-sync", {"offload": True, "sync": True}),
        ("dense/ref#2", {"offload": False}),
        ("dense/offload#2", {"offload": True}),
        ("sparse/ref", {"offload": False, "budget": b}),
        ("sparse/offload", {"offload": True, "budget": b}),
        ("sparse/offload-sync", {"offload": True, "budget": b, "sync": True}),
    ]
    if cuda:
        runs += [("dense-torch/ref", {"offload": False, "backend": "torch"}),
                 ("dense-torch/offload", {"offload": True, "backend": "torch"})]
        if tiles and tiles.get("has_dkdv_head_major"):
            runs += [("dense-committed-tiles/ref", {"offload": False, "committed_tiles": True}),
                     ("dense-committed-tiles/offload", {"offload": True, "committed_tiles": True})]
    comparisons = [
        ("dense: offload vs ref", "dense/ref", "dense/offload"),
        ("dense: offload-sync vs ref", "dense/ref", "dense/offload-sync"),
        ("dense: ref#2 vs ref", "dense/ref", "dense/ref#2"),
        ("dense: offload#2 vs ref", "dense/ref", "dense/offload#2"),
        ("dense: offload#2 vs offload#1", "dense/offload", "dense/offload#2"),
        ("sparse: offload vs ref", "sparse/ref", "sparse/offload"),
        ("sparse: offload-sync vs ref", "sparse/ref", "sparse/offload-sync"),
        ("dense-torch: offload vs ref", "dense-torch/ref", "dense-torch/offload"),
        ("dense-committed-tiles: offload vs ref", "dense-committed-tiles/ref", "dense-committed-tiles/offload"),
        ("dense-committed-tiles: ref vs dense ref (tiles change the bits?)", "dense/ref", "dense-committed-tiles/ref"),
    ]

    results: dict[str, dict] = {}
    durations: dict[str, float] = {}

    def save():
        report["verdict"] = _verdict(report["comparisons"])
        report["elapsed_s"] = time.perf_counter() - t_start
        out_path.write_text(json.dumps(report, indent=1))

    for name, spec in runs:
        group = name.split("/")[0]
        # The first run of a group compiles its kernels: guess 20 s, then the slowest seen.
        estimate = max(durations.get(group, 20.0 if cuda else 5.0), 1.0) * 1.3
        elapsed = time.perf_counter() - t_start
        if elapsed + estimate > args.time_budget:
            report["skipped"].append(name)
            print(f"skip {name}: {elapsed:.0f} s elapsed, ~{estimate:.0f} s more would pass --time-budget")
            continue
        try:
            r = _run(model, ids, cfg, spec, cuda)
        except Exception as e:  # report and go on: one broken mode must not hide the others
            report["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"{name}: ERROR {type(e).__name__}: {e}")
            oomb.release_memory(model)
            save()
            continue
        results[name] = r
        durations[group] = max(durations.get(group, 0.0), r["seconds"])
        report["runs"][name] = {"seconds": round(r["seconds"], 2), "loss": float(r["loss"]), "store": r["store"],
                                "synchronous": r["synchronous"], **{k: v for k, v in spec.items() if k != "offload"},
                                "offload": spec["offload"]}
        print(f"{name:32s} {r['seconds']:6.2f} s  loss {float(r['loss']):.6f}  store {r['store']}"
              f"{'  (synchronous)' if r['synchronous'] else ''}", flush=True)
        for label, ref_name, other_name in comparisons:
            if label not in report["comparisons"] and ref_name in results and other_name in results:
                report["comparisons"][label] = _compare(results[ref_name], results[other_name])
        save()

    print()
    print(f"{'comparison':62s} {'same':>5s} {'loss':>5s} {'max_abs':>10s} {'n_diff':>9s}  most different")
    for label, c in report["comparisons"].items():
        worst = ", ".join(f"{p['name']} ({p.get('n_diff')}, {p.get('max_abs', 0):.3g})" for p in c["top"][:3])
        print(f"{label:62s} {str(c['identical']):>5s} {str(c['loss_identical']):>5s} {c['max_abs']:10.3g} "
              f"{c['n_diff']:9d}  {worst}")
        if c["diff_by_layer"]:
            print(f"{'':62s} differing elements by layer: {c['diff_by_layer']}")
    if report["skipped"]:
        print(f"skipped (time budget): {', '.join(report['skipped'])}")
    for name, err in report["errors"].items():
        print(f"error in {name}: {err}")
    save()
    print("verdict:", *report["verdict"], sep="\n  ")
    print(f"git: {report['git']['head'][:12]} {report['git']['branch']}; uncommitted: "
          f"{report['git']['status'].count(chr(10)) + 1 if report['git']['status'] else 0} files; tiles: {tiles}")
    print(f"wrote {out_path} ({report['elapsed_s']:.1f} s)")
    return 0


def _version(module: str):
    try:
        return __import__(module).__version__
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
