"""Memory and time of one chunked_backward step against context length, on a GPU.

    python -m benchmarks.core --out out/core.json                # Qwen2.5-7B, 16K/32K/64K
    python -m benchmarks.core --lengths 16384,65536 --hf-lengths 16384

Each length: one warm-up step at the first length, then ``--repeats`` timed steps
(CUDA events; the median is reported) with the peak GPU memory of the timed steps.
Parameters are bf16 with bf16 gradients kept allocated (no optimizer), random init.
The baseline a user would pick instead (``--baseline-lengths``): transformers with
FlashAttention-4 (where flash-attn-4 is installed) and with SDPA, each with Liger's kernels,
gradient checkpointing and Liger's fused linear cross-entropy (benchmarks.baseline), each in a
process of its own started before oomb's model exists; every oomb row then gets its time and
peak memory as a ratio of the faster stack's at the same length. ``--auto-lengths`` times the
configuration `oomb train` picks by itself for that length (chunk size, attention cache, fused
ops, settled by its memory plan for this GPU). ``--hf-lengths`` keeps the older plain
transformers row (SDPA, checkpointing, no Liger). oomb's rows run with liger's fused RMSNorm
and SwiGLU where available (``--fused-ops``, as ``oomb train`` does), and with the CUDA allocator `oomb train`
sets up (expandable segments where the environment sets none; the record's ``oomb_allocator``, from 2026-12-07
on); the stacks run in the environment as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import oomb
from benchmarks.common import (
    LORA_RANK,
    TRAINABLE,
    GpuClocks,
    add_grad_accumulation_argument,
    ask_fa4_block_sparse,
    bench_adds_into_grad,
    command_line,
    int_list,
    library_versions,
    machine_description,
    pages_moved_by_kind,
    run_benchmark,
    set_trainable,
    time_steps,
    use_bench_grad_accumulation,
    write_report,
)
from benchmarks.timeline import format_profile, step_profile
from benchmarks.tune_attention import CANDIDATES
from oomb.engine import linear_cross_entropy_sum, store_for_model
from oomb.engine.sizes import ModelShape
from oomb.kernels import get_backend
from oomb.kernels import tiles as kernel_tiles
from oomb.planning.timing import step_flops
from oomb.sparse import DEFAULT_SCORE, SCORES, PageSelection
from oomb.surgery.fused_ops import MODES as FUSED_OPS_MODES
from oomb.surgery.fused_ops import plain_rope, use_fused_ops
from oomb.surgery.grad_accumulation import plain_linears
from oomb.surgery.lora import plain_lora, use_fused_lora
from oomb.train.config.presets import build_model, preset_config
from oomb.train.loop.trainer import allocator_setting, prefer_expandable_segments


def model_flops(config, seq_len: int) -> float:
    """Training FLOPs of one sequence without recomputation: 6*N*P (matmuls) + causal attention
    (6*N^2*H*D per layer, forward and backward), as the planner's step-time model counts them."""
    return sum(step_flops(config, seq_len))


def _hf_step(model, ids):
    """Full-sequence training step through transformers with gradient checkpointing."""
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    loss = linear_cross_entropy_sum(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, None,
                                    targets.reshape(-1)) / (ids.numel() - ids.shape[0])
    loss.backward()


def rope_calls_per_step(num_layers: int, seq_len: int, chunk: int) -> dict[str, int]:
    """How many times a chunked step applies RoPE to a chunk's q and k per layer: stage 1's forward of every chunk
    but the last, stage 2's recompute forward of every chunk (the cache skips attention, not RoPE), and the
    recompute's backward through it."""
    chunks = -(-seq_len // chunk)
    return {"forward": num_layers * (2 * chunks - 1), "backward": num_layers * chunks}


def rope_cost(config, chunk: int, dtype=torch.bfloat16) -> dict:
    """Milliseconds of one chunk's RoPE on q and k (Qwen-style: [1, H, C, D] and [1, H_kv, C, D]) with
    transformers' apply_rotary_pos_emb and with liger's fused kernel (the baseline stack's), forward and
    forward + backward, on this GPU (CUDA events, median of triton's do_bench)."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from benchmarks.common import do_bench_s

    shape = ModelShape.from_config(config)
    d = shape.head_dim
    q = torch.randn(1, chunk, shape.heads, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(1, chunk, shape.kv_heads, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    angles = torch.arange(chunk, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")
    cos = torch.cat([angles.cos()] * 2, dim=-1)[None].to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1)[None].to(dtype)
    result = {}
    for name, fn in (("transformers", apply_rotary_pos_emb), ("liger", liger_rotary_pos_emb)):
        def forward(fn=fn):
            with torch.no_grad():
                fn(q.detach(), k.detach(), cos, sin)

        def both(fn=fn):
            a, b = fn(q, k, cos, sin)
            torch.autograd.backward((a, b), (torch.ones_like(a), torch.ones_like(b)))

        result[name] = {"forward_ms": do_bench_s(forward) * 1e3,
                        "forward_backward_ms": do_bench_s(both, grad_to_none=[q, k]) * 1e3}
    return result


def run_baselines(args, env: dict | None = None) -> list[dict]:
    """The transformers stacks at ``args.baseline_lengths``, each in a process of its own (benchmarks.baseline), in
    the environment ``env`` (None: this process's)."""
    rows = []
    for stack in args.baseline_stacks:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.baseline", "--stack", stack, "--preset",
                                   args.preset, "--trainable", args.trainable,
                                   "--lengths", ",".join(map(str, args.baseline_lengths)),
                                   "--repeats", str(max(2, args.repeats)), "--out", out.name,
                                   "--profile-lengths", ",".join(map(str, args.profile_lengths))], env=env)
            if proc.returncode != 0:
                rows += [{"system": f"transformers-{stack}", "seq_len": n, "error": f"exit {proc.returncode}"}
                         for n in args.baseline_lengths]
                continue
            rows += json.loads(Path(out.name).read_text())
    config = preset_config(args.preset)
    for r in rows:  # the rates oomb's rows carry, for the table and the record
        if "step_s" in r:
            r.update(tokens_per_s=r["seq_len"] / r["step_s"],
                     model_tflops=model_flops(config, r["seq_len"]) / r["step_s"] / 1e12)
    return rows


def earlier_baselines(record: Path) -> list[dict]:
    """The transformers stacks' rows of an earlier core record (``--baseline-from``: a step too long to time
    beside oomb's in one device call), each saying which run timed it."""
    earlier = json.loads(record.read_text())
    if earlier.get("bench") != "core":
        raise ValueError(f"{record}: not a benchmarks.core record (bench={earlier.get('bench')!r})")
    rows = [{**r, "timed_by": f"{earlier['command']} ({earlier['date']})"} for r in earlier["results"]
            if r["system"].startswith("transformers-")]
    if not rows:
        raise ValueError(f"{record}: no transformers rows (was it run with --baseline-lengths?)")
    return rows


# The `oomb train` keys that train what --trainable says (attention-only training is a bench's, not oomb train's).
TRAINED_BY_KEYS = {"all": [], "lora": [f"lora.r={LORA_RANK}", "lora.targets=all-linear"],
                   "lora-unfused": [f"lora.r={LORA_RANK}", "lora.targets=all-linear", "lora.fused=false"]}


def auto_settings(args) -> dict[int, dict]:
    """What `oomb train model.preset=P data.seq_len=N` picks on this GPU: chunk, cache, fused ops.

    Settled by its memory plan before this process holds a model (the plan counts free memory).
    """
    from oomb.train.config.checks import check_config
    from oomb.train.config.settings import load_config
    from oomb.train.loop.memory import available_memory, resolve_auto_settings

    picked = {}
    for n in args.auto_lengths:
        cfg = load_config(None, [f"model.preset={args.preset}", f"data.seq_len={n}", "train.device=cuda",
                                 *TRAINED_BY_KEYS[args.trainable]])
        check_config(cfg)
        gpu, host = available_memory(torch.device("cuda"))
        plan, _ = resolve_auto_settings(cfg, "cuda", torch.bfloat16, gpu_bytes=gpu, host_bytes=host)
        if not plan.fits:  # `oomb train` refuses such a run before it starts: no row, and the refusal recorded
            picked[n] = {"refused": f"`oomb train` refuses {n} tokens on this card: its plan needs "
                                    f"{plan.gpu_bytes / 2**30:.1f} GiB of GPU and {plan.host_bytes / 2**30:.1f} GiB "
                                    f"of host memory (its optimizer's states included)"}
            continue
        picked[n] = {"chunk_size": cfg.train.chunk_size, "page_size": cfg.train.page_size,
                     "cache_attention": cfg.train.cache_attention, "fused_ops": cfg.train.fused_ops,
                     "recompute": cfg.train.recompute}
    return picked


def fastest_stacks(results: list[dict], profiled: bool = False) -> dict[int, dict]:
    """The fastest transformers stack (the Liger ones: the baseline) that ran at each length; ``profiled``: among
    those with a profiled step."""
    best: dict[int, dict] = {}
    for r in results:
        if (r["system"].startswith("transformers-") and "error" not in r and "liger" in r["system"]
                and (not profiled or "profile" in r)):
            if r["seq_len"] not in best or r["step_s"] < best[r["seq_len"]]["step_s"]:
                best[r["seq_len"]] = r
    return best


def versus_baseline(results: list[dict]) -> list[dict]:
    """Each oomb row's step time and peak memory over the faster transformers stack's at its length."""
    best = fastest_stacks(results)
    rows = []
    for r in results:
        b = best.get(r["seq_len"])
        if r["system"].startswith("oomb") and "error" not in r and b is not None:
            rows.append({"system": r["system"], "seq_len": r["seq_len"], "baseline": b["system"],
                         "time_ratio": r["step_s"] / b["step_s"], "peak_ratio": r["peak_gpu_gib"] / b["peak_gpu_gib"]})
    return rows


def attention_seconds(profile: dict) -> float:
    """The GPU seconds of a profiled step's attention kernels (every ``attention ...`` group of benchmarks.timeline:
    FA4's and our Triton kernels)."""
    return sum(g["ms"] for name, g in profile["kernel_groups"].items() if name.startswith("attention")) / 1e3


def sparse_floor(results: list[dict]) -> list[dict]:
    """Each profiled page-sparse oomb row against its floor: the profiled transformers stack's
    step without its attention kernels (what the best dense stack spends outside attention), plus the attention
    kernels of the oomb row's own profiled step (attention over the chosen pages and the chunk). Measured on one
    machine in one run, so a floor taken on another GPU need not be rescaled. The stack is the faster profiled one
    at the row's length; timed steps, not profiled walls (the profiler slows the host, not the kernels). The SM
    clocks both ran at (median over their timed steps, benchmarks.common.GpuClocks; None where not sampled) say
    whether the floor's kernels ran faster for their clock alone."""
    stacks = fastest_stacks(results, profiled=True)
    rows = []
    for r in results:
        b = stacks.get(r["seq_len"])
        if r["system"].startswith("oomb-sparse") and "profile" in r and "error" not in r and b is not None:
            outside = b["step_s"] - attention_seconds(b["profile"])
            attention = attention_seconds(r["profile"])
            rows.append({"system": r["system"], "seq_len": r["seq_len"], "baseline": b["system"],
                         "baseline_step_s": b["step_s"], "baseline_outside_attention_s": outside,
                         "attention_s": attention, "floor_s": outside + attention, "step_s": r["step_s"],
                         "step_over_floor": r["step_s"] / (outside + attention),
                         "baseline_sm_mhz": (b.get("gpu_clocks") or {}).get("sm_mhz"),
                         "sm_mhz": (r.get("gpu_clocks") or {}).get("sm_mhz")})
    return rows


def expand_rows(runs: list[tuple], backends: list[str], modes: list[str], chunks: list[int]) -> list[tuple]:
    """Each (tokens, system, layer checkpointing, options) row once per backend, recompute mode and chunk size,
    named system[backend]{mode}@chunk where there are several (rows whose options fix their chunk, the
    `oomb train` choice, keep it; layer checkpointing only with whole-chunk recompute). Returns (tokens, name,
    layer checkpointing, options with recompute and chunk_size, backend) rows."""
    def name(system, b, m, c, fixed):
        return (system + ("" if len(backends) == 1 else f"[{b}]") + ("" if len(modes) == 1 else f"{{{m}}}")
                + ("" if len(chunks) == 1 or fixed else f"@{c}"))

    return [(n, name(system, b, m, c, "chunk_size" in options), layer_ckpt,
             {"recompute": m, "chunk_size": c, **options}, b)
            for n, system, layer_ckpt, options in runs for b in backends for m in modes
            for c in (chunks[:1] if "chunk_size" in options else chunks)
            if not (layer_ckpt and m != "chunk")]


def oomb_rows(args, auto: dict) -> list[tuple]:
    """oomb's (tokens, row name, layer checkpointing, chunked_backward options) rows before expand_rows: the
    `oomb train` choices of --auto-lengths, then one kind of row per length option, the sparse ones once per
    --chunk-pages entry (named +free / +capN where there are several)."""
    # One sparse row per cap on a chunk's pages (--chunk-pages; None: blocks choose among every past page)
    caps = args.chunk_pages
    sparse_rows = [("" if len(caps) == 1 else ("+free" if cap is None else f"+cap{cap}"),
                    {"selection": PageSelection(page_budget=args.budget, score=args.select_score, chunk_pages=cap)})
                   for cap in caps]
    return ([(n, "oomb-auto", False, {"chunk_size": a["chunk_size"], "page_size": a["page_size"],
                                      "cache_attention": a["cache_attention"], "recompute": a["recompute"]})
             for n, a in auto.items() if "refused" not in a]
            + [(n, "oomb", False, {}) for n in args.lengths]
            + [(n, "oomb+layer-ckpt", True, {}) for n in args.ckpt_lengths]
            + [(n, "oomb+cached-attn", False, {"cache_attention": True}) for n in args.cache_lengths]
            + [(n, "oomb+host-cached-attn", False, {"cache_attention": "host"}) for n in args.cache_host_lengths]
            + [(n, "oomb+offload", False, {"offload": True}) for n in args.offload_lengths]
            + [(n, "oomb+offload+host-cached-attn", False, {"offload": True, "cache_attention": "host"})
               for n in args.offload_cache_host_lengths]
            + [(n, f"oomb-sparse{tag}", False, sparse) for n in args.sparse_lengths for tag, sparse in sparse_rows]
            + [(n, f"oomb-sparse+cached-attn{tag}", False, {**sparse, "cache_attention": True})
               for n in args.sparse_cache_lengths for tag, sparse in sparse_rows])


def _caps(text: str) -> list[int | None]:
    """--chunk-pages: '64,128' or 'none,64'."""
    try:
        return [None if t.strip().lower() == "none" else int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of page counts or 'none'") from None


def run(args) -> dict:
    device = torch.device("cuda")
    ask_fa4_block_sparse(args.fa4_block_sparse)
    # oomb's rows run with the CUDA allocator `oomb train` sets up (expandable segments, unless the environment sets
    # the allocator); the stacks' processes get the environment as it was, as a user's script would.
    stack_env = dict(os.environ)
    prefer_expandable_segments()
    if args.auto_lengths and args.trainable not in TRAINED_BY_KEYS:
        raise SystemExit("--auto-lengths times what `oomb train` picks for a full fine-tune or LoRA: give "
                         f"--trainable {' or '.join(TRAINED_BY_KEYS)}")
    baseline = run_baselines(args, stack_env) if args.baseline_lengths else []
    if args.baseline_from:
        baseline += earlier_baselines(Path(args.baseline_from))
    auto = auto_settings(args) if args.auto_lengths else {}
    for a in auto.values():
        if "refused" in a:
            print(a["refused"], flush=True)
    model = build_model(args.preset, dtype=torch.bfloat16, device=device)
    model.train()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model, trained = set_trainable(model, args.trainable)  # LoRA's adapters first, as `oomb train` adds them
    plain_modules = dict(model.named_modules())
    fused = use_fused_ops(model, args.fused_ops)  # oomb's rows; transformers' rows get the plain modules back
    linears = use_bench_grad_accumulation(model, args)
    lora_fused = use_fused_lora(model, into_grad=bench_adds_into_grad(model, args)) if args.trainable == "lora" else []
    fused_record = {"fused_ops_modules": len(fused) - ("rope" in fused), "fused_rope": "rope" in fused,
                    "fused_grad_accumulation": len(linears), "fused_lora_layers": len(lora_fused)}
    tiles = dict(CANDIDATES)[args.tiles]
    if tiles:  # a tune_attention candidate instead of the default tiles, for oomb's rows
        default_tiles = kernel_tiles.choose_tiles
        kernel_tiles.choose_tiles = lambda *a: dataclasses.replace(default_tiles(*a), **tiles)  # noqa: E731
    cfg = model.config
    grad_bytes = sum(p.numel() * p.element_size() for p in trained)
    for p in trained:  # bf16 gradients, allocated up front as a trainer would hold them
        p.grad = torch.zeros_like(p)
    results = list(baseline)

    def report(complete: bool) -> dict:
        return _report(args, results, complete=complete, cfg=cfg, fused_record=fused_record,
                       param_bytes=param_bytes, auto=auto)

    def record(kind, n, times=None, error=None, extra=None):
        row = {"system": kind, "seq_len": n}
        if times:
            med = statistics.median(times)
            row.update(step_s=med, step_times_s=times, tokens_per_s=n / med,
                       model_tflops=model_flops(cfg, n) / med / 1e12)
        row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if error:
            row["error"] = error
        row.update(extra or {})
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("step_times_s", "profile")}), flush=True)
        if args.out:  # each row as it lands: a job stopped by its time limit keeps the rows it measured
            write_report(args.out, report(complete=False))

    vocab = cfg.vocab_size
    warmed = False
    runs = expand_rows(oomb_rows(args, auto), args.backend.split(","), args.recompute.split(","), args.chunk)
    for n, system, layer_ckpt, options, backend in runs:
        ids = torch.randint(0, vocab, (1, n), device=device)
        if layer_ckpt:  # transformers' per-layer checkpointing inside each chunk
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        options = {"page_size": args.page, **options}

        def step(ids=ids, options=options, backend=backend):
            oomb.chunked_backward(model, ids, backend=backend, **options)

        try:
            if not warmed or args.warm_each:
                step()
                warmed = True
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with GpuClocks() as clocks:
                times = time_steps(step, args.repeats)
            profile = {"profile": step_profile(step)} if n in args.profile_lengths else {}
            # No local name for the store: a live reference would keep its pools through the next length.
            record(system, n, times, extra={
                "chunk_size": options["chunk_size"], "page_size": options["page_size"],
                **({"chunk_pages": options["selection"].chunk_pages} if "selection" in options else {}),
                "backend": get_backend(backend, "cuda").name,
                "options": {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in options.items()},
                "store_gib": store_for_model(model).nbytes() / 2**30,
                "store_bytes_per_token": store_for_model(model).spec.bytes_per_token(),
                "pages_moved": pages_moved_by_kind(store_for_model(model), model.config),
                "params_plus_grads_gib": (param_bytes + grad_bytes) / 2**30,
                **fused_record, "tiles": args.tiles, "gpu_clocks": clocks.summary(), **profile,
            })
        except torch.OutOfMemoryError as e:
            record(system, n, error=f"out of memory: {str(e).splitlines()[0]}")
        model.gradient_checkpointing_disable()
        oomb.release_memory(model)
        torch.cuda.empty_cache()

    for name in fused:  # transformers' rows: its own modules and RoPE, as a user of plain transformers runs them
        if name != "rope":
            model.set_submodule(name, plain_modules[name])
    plain_rope()
    plain_linears(model)
    plain_lora(model)
    if args.hf_lengths:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for n in args.hf_lengths:
            ids = torch.randint(0, vocab, (1, n), device=device)
            try:
                _hf_step(model, ids)  # warm-up at this length
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                with GpuClocks() as clocks:
                    times = time_steps(lambda ids=ids: _hf_step(model, ids), args.repeats)
                record("transformers-sdpa-ckpt", n, times, extra={"gpu_clocks": clocks.summary()})
            except torch.OutOfMemoryError as e:
                record("transformers-sdpa-ckpt", n, error=f"out of memory: {str(e).splitlines()[0]}")
                break
            finally:
                torch.cuda.empty_cache()
        model.gradient_checkpointing_disable()

    return report(complete=True)


def _report(args, results: list[dict], *, complete: bool, cfg, fused_record: dict, param_bytes: int,
            auto: dict) -> dict:
    """The JSON record: the rows so far; ``complete`` once every row ran (the RoPE costs only then)."""
    summary = _memory_growth([r for r in results if r["system"] == "oomb" and "error" not in r])
    return {
        "bench": "core",
        "complete": complete,
        "command": command_line("benchmarks.core"),
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(),
        "gpu": torch.cuda.get_device_name(),
        "host": platform.node(),
        "versions": library_versions(),
        "preset": args.preset,
        "fused_ops": args.fused_ops, **fused_record, "tiles": args.tiles,
        "param_gib": param_bytes / 2**30,
        "trainable": args.trainable,
        "results": results,
        "versus_baseline": versus_baseline(results),
        "sparse_floor": sparse_floor(results),
        "auto_settings": auto,
        "oomb_allocator": allocator_setting(),
        # transformers' RoPE against liger's (the baseline's, and oomb's rows' with fused ops), per
        # chunk and for a step at each profiled length (measured after plain_rope() above: transformers' own)
        "rope": ({"chunk": args.chunk[0], "per_chunk": rope_cost(cfg, args.chunk[0]),
                  "calls_per_step": {n: rope_calls_per_step(cfg.num_hidden_layers, n, args.chunk[0])
                                     for n in args.profile_lengths}} if args.profile_lengths and complete else None),
        "memory_growth": summary,
    }


def _memory_growth(rows: list[dict]) -> dict:
    """Peak GPU memory per extra 10K tokens (measured) against the store's prediction."""
    if len(rows) < 2:
        return {}
    first, last = rows[0], rows[-1]
    extra_tokens = last["seq_len"] - first["seq_len"]
    measured = (last["peak_gpu_gib"] - first["peak_gpu_gib"]) / extra_tokens * 1e4
    predicted = first["store_bytes_per_token"] * 1e4 / 2**30
    non_store = [r["peak_gpu_gib"] - r["store_gib"] for r in rows]
    return {
        "gib_per_10k_tokens_measured": measured,
        "gib_per_10k_tokens_store_predicts": predicted,
        "peak_minus_store_gib": {r["seq_len"]: v for r, v in zip(rows, non_store, strict=True)},
    }


def _print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  {report['date']}  preset {report['preset']}")
    print(f"{'system':<24}{'tokens':>9}{'step s':>9}{'tok/s':>9}{'TFLOP/s':>9}{'peak GiB':>10}{'store GiB':>10}")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['system']:<24}{r['seq_len']:>9}  {r['error'][:60]}")
            continue
        print(f"{r['system']:<24}{r['seq_len']:>9}{r['step_s']:>9.2f}{r['tokens_per_s']:>9.0f}"
              f"{r['model_tflops']:>9.1f}{r['peak_gpu_gib']:>10.2f}{r.get('store_gib', 0):>10.2f}")
        if "profile" in r:
            print(f"{'':<24}{format_profile(r['profile'])}")
    for v in report.get("versus_baseline", []):
        print(f"{v['system']:<24}{v['seq_len']:>9}  {v['time_ratio']:.2f}x the time, {v['peak_ratio']:.2f}x the peak "
              f"memory of {v['baseline']}")
    for f in report.get("sparse_floor", []):
        print(f"{f['system']:<24}{f['seq_len']:>9}  floor {f['floor_s']:.2f} s ({f['baseline']} outside attention "
              f"{f['baseline_outside_attention_s']:.2f} s + its attention {f['attention_s']:.2f} s): "
              f"step {f['step_over_floor']:.3f}x the floor"
              + (f"; SM clock {f['sm_mhz']:.0f} MHz, the stack's {f['baseline_sm_mhz']:.0f} MHz"
                 if f.get("sm_mhz") and f.get("baseline_sm_mhz") else ""))
    if (rope := report.get("rope")) is not None:
        cost = rope["per_chunk"]
        for n, calls in rope["calls_per_step"].items():
            step = {name: calls["forward"] * c["forward_ms"] + calls["backward"] * (c["forward_backward_ms"]
                                                                                  - c["forward_ms"])
                    for name, c in cost.items()}
            print(f"RoPE in a {n}-token step (chunk {rope['chunk']}): transformers {step['transformers'] / 1e3:.2f} s, "
                  f"liger {step['liger'] / 1e3:.2f} s")
    g = report["memory_growth"]
    if g:
        print(f"GPU memory per extra 10K tokens: measured {g['gib_per_10k_tokens_measured']:.3f} GiB, "
              f"store predicts {g['gib_per_10k_tokens_store_predicts']:.3f} GiB; "
              f"peak minus store: {', '.join(f'{k}: {v:.2f}' for k, v in g['peak_minus_store_gib'].items())} GiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.core", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--lengths", type=int_list, default=[16384, 32768, 65536])
    p.add_argument("--trainable", choices=TRAINABLE, default="all",
                   help="parameters trained in every row, the stacks' too: all; the attention layers' only (a model "
                        "whose weights and gradients do not fit the card: GPT-OSS-20B); LoRA r=16 on every linear "
                        "layer, oomb's rows with fused LoRA (lora) or peft's own layers (lora-unfused)")
    p.add_argument("--ckpt-lengths", type=int_list, default=[],
                   help="also time oomb with per-layer checkpointing inside chunks at these lengths")
    p.add_argument("--cache-lengths", type=int_list, default=[],
                   help="also time oomb with cache_attention=True (stage 1 outputs reused) at these lengths")
    p.add_argument("--cache-host-lengths", type=int_list, default=[],
                   help="also time oomb with cache_attention='host' (stage 1 outputs in pinned host memory)")
    p.add_argument("--offload-lengths", type=int_list, default=[],
                   help="also time oomb with every page in host memory (offload; --recompute as given, no cache)")
    p.add_argument("--offload-cache-host-lengths", type=int_list, default=[],
                   help="also time oomb with every page and the attention cache in host memory (what `oomb train` "
                        "picks with train.offload where the host holds both)")
    p.add_argument("--sparse-lengths", type=int_list, default=[], help="also time page-sparse oomb (--budget)")
    p.add_argument("--sparse-cache-lengths", type=int_list, default=[],
                   help="also time page-sparse oomb with cache_attention=True")
    p.add_argument("--budget", type=int, default=64, help="pages per block of 128 queries for the sparse rows")
    p.add_argument("--chunk-pages", type=_caps, default=[None], metavar="N[,N...]",
                   help="sparse rows: the cap on the pages a chunk's blocks choose among (PageSelection.chunk_pages), "
                        "one row per entry; 'none' = no cap (default)")
    p.add_argument("--select-score", default=DEFAULT_SCORE, choices=SCORES,
                   help=f"page score of the sparse rows: bound or mean (the paper's); default {DEFAULT_SCORE}")
    p.add_argument("--hf-lengths", type=int_list, default=[],
                   help="also time plain transformers (SDPA, checkpointing, no Liger) at these lengths")
    p.add_argument("--baseline-lengths", type=int_list, default=[],
                   help="time the transformers stacks a user would pick (FA4 and SDPA, Liger, checkpointing) at "
                        "these lengths, each in its own process, and print oomb's ratios to the faster")
    p.add_argument("--baseline-from", default=None, metavar="RECORD",
                   help="take the transformers stacks' rows from this earlier core record of the same machine "
                        "(each row says which run timed it) instead of timing them again: at 256K the stack's "
                        "steps and oomb's do not fit one 10-minute device call together")
    p.add_argument("--baseline-stacks", type=lambda s: s.split(","), default=["fa4", "sdpa"],
                   help="which transformers stacks --baseline-lengths times (default fa4,sdpa; SDPA measured "
                        "slower than FA4 at 64K-256K, so fa4 alone where a device call is short of time)")
    p.add_argument("--auto-lengths", type=int_list, default=[],
                   help="time the configuration `oomb train` picks by itself at these lengths")
    p.add_argument("--profile-lengths", type=int_list, default=[],
                   help="at these lengths, one more step of every row (the baselines' too) under torch.profiler: "
                        "GPU time per kernel group, the top kernels and the GPU's idle time, in the row's profile")
    p.add_argument("--warm-each", action="store_true",
                   help="a warm-up step before every row, at its length (default: one, before the first row)")
    p.add_argument("--chunk", type=int_list, default=[4096],
                   help="tokens per chunk of oomb's rows; a comma list times each row once per chunk size")
    p.add_argument("--page", type=int, default=128)
    p.add_argument("--backend", default="auto",
                   help="attention backend of oomb's rows; a comma list times each row once per backend")
    p.add_argument("--fa4-block-sparse", action=argparse.BooleanOptionalAction, default=True,
                   help="page-sparse rows of the fa4 backend on FA4's block sparsity (kernels/flash4_sparse.py; oomb's "
                        "default on Hopper) or, with --no-fa4-block-sparse, on the Triton kernels "
                        "(OOMB_FA4_BLOCK_SPARSE=0)")
    p.add_argument("--recompute", default="chunk",
                   help="how stage 2 rebuilds a chunk in oomb's rows (chunk, layer, layer-host; "
                        "oomb.engine.layer_recompute); a comma list times each row once per mode")
    p.add_argument("--fused-ops", default="auto", choices=FUSED_OPS_MODES,
                   help="liger's fused RMSNorm/SwiGLU in oomb's rows (oomb.surgery.fused_ops); transformers' rows "
                        "never")
    add_grad_accumulation_argument(p)  # oomb's rows only: transformers' rows get nn.Linear back
    p.add_argument("--tiles", default="default", choices=[name for name, _ in CANDIDATES],
                   help="attention tiles for oomb's rows: a candidate of benchmarks.tune_attention")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None, help="write the JSON report here")
    return run_benchmark("core", p.parse_args(argv), run, _print_table)

if __name__ == "__main__":
    sys.exit(main())
