"""The memory plan of a run config: `oomb plan`, and the check `oomb train` makes before any work.

    plan_for_config(cfg, device, dtype)   ->  MemoryPlan (oomb.engine.plan) with this machine's memory
    check_memory(cfg, device, dtype)      ->  raises ConfigError when the plan does not fit, saying the
                                              estimate, the memory available, the longest context that
                                              fits and which settings would make this one fit
"""

from __future__ import annotations

import dataclasses
import json
import os

import psutil
import torch
from rich.console import Console
from rich.table import Table

from oomb.engine.plan import MemoryPlan, largest_context, plan_memory
from oomb.engine.plan import format_bytes as _gib
from oomb.train.config import Config, ConfigError, offload_gpu_bytes, offload_selection_note, parse_bytes
from oomb.train.inputs import model_config
from oomb.train.optim import wants_master_weights


def available_memory(device: torch.device) -> tuple[int | None, int]:
    """(GPU bytes free for this run or None off CUDA, host bytes available to this process)."""
    host = psutil.virtual_memory().available + psutil.Process(os.getpid()).memory_info().rss
    if device.type != "cuda":
        return None, host
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device), host


def _settings(cfg: Config, device_type: str, dtype: torch.dtype) -> dict:
    t = cfg.train
    torchrun = t.tensor_parallel > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1
    return dict(
        batch_size=t.batch_size, chunk_size=t.chunk_size, page_size=t.page_size, dtype=dtype,
        lora_r=cfg.lora.r, lora_targets=tuple(x.strip() for x in cfg.lora.targets.split(",") if x.strip()),
        optimizer=t.optimizer, master_weights=wants_master_weights(t.master_weights, torchrun=torchrun),
        layer_checkpointing=t.layer_checkpointing, device_type=device_type,
        page_budget=t.page_budget, select_block=t.select_block, per_head_selection=t.select_per_head,
        select_score=t.select_score,
        offload=t.offload and device_type == "cuda", cache_attention=t.cache_attention is True,
        offload_gpu_bytes=offload_gpu_bytes(t.offload_gpu_memory),
        tensor_parallel=t.tensor_parallel,
    )


def plan_for_config(cfg: Config, device_type: str, dtype: torch.dtype, *, gpu_bytes: int | None,
                    host_bytes: int | None) -> tuple[MemoryPlan, int]:
    """The run's plan against the given memory, and the longest data.seq_len that would fit."""
    config = model_config(cfg)
    settings = _settings(cfg, device_type, dtype)
    limits = dict(device_total_bytes=gpu_bytes, host_total_bytes=host_bytes)
    try:
        plan = plan_memory(config, seq_len=cfg.data.seq_len, **settings, **limits)
        return plan, largest_context(config, **settings, **limits)
    except ValueError as e:
        raise ConfigError(f"memory plan: {e}; train.memory_check=false skips the plan") from e


def _alternatives(cfg: Config, device_type: str, dtype: torch.dtype, limits: dict) -> list[str]:
    """Single setting changes that make the plan fit, cheapest in speed or quality first."""
    config = model_config(cfg)
    base = _settings(cfg, device_type, dtype)
    t = cfg.train
    candidates: list[tuple[str, dict]] = []
    if t.cache_attention is True:  # costs only speed
        candidates.append(("train.cache_attention=false", {"cache_attention": False}))
    if not t.layer_checkpointing:
        candidates.append(("train.layer_checkpointing=true", {"layer_checkpointing": True}))
    chunk = t.chunk_size // 2
    while chunk >= t.page_size and chunk % t.page_size == 0:
        candidates.append((f"train.chunk_size={chunk}", {"chunk_size": chunk}))
        chunk //= 2
    if t.optimizer == "adamw":
        candidates.append(("train.optimizer=adamw8bit", {"optimizer": "adamw8bit"}))
    if base["master_weights"]:  # a no-op for fp32 parameters: then it does not fit either and is not offered
        candidates.append(("train.master_weights=false", {"master_weights": False}))
    if cfg.lora.r == 0:
        candidates.append(("lora.r=16", {"lora_r": 16}))
    if device_type == "cuda" and not t.offload:
        candidates.append(("train.offload=true" + (" train.cache_attention=false" if t.cache_attention is True else ""),
                           {"offload": True, "cache_attention": False}))
    found, chunk_found = [], False
    for text, change in candidates:
        if "chunk_size" in change and chunk_found:
            continue
        plan = plan_memory(config, seq_len=cfg.data.seq_len, **{**base, **change}, **limits)
        if plan.fits:
            found.append(f"{text} ({_gib(plan.gpu_bytes if device_type == 'cuda' else plan.host_bytes)})")
            chunk_found = chunk_found or "chunk_size" in change
    return found


def _with(cfg: Config, **train) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def resolve_auto_settings(cfg: Config, device_type: str, dtype: torch.dtype, *, gpu_bytes: int | None,
                          host_bytes: int | None) -> tuple[MemoryPlan, int]:
    """Settle the `auto` settings that trade memory for speed or precision against the plan, in cfg.

    train.cache_attention=auto is on where the plan fits with it (it costs only memory; never with
    offload). train.master_weights=auto drops the fp32 copies where only the run without them fits
    (e.g. 7B full fine-tuning on one H200); the cache goes first. Returns the resolved run's plan.
    """
    auto_cache = cfg.train.cache_attention == "auto"
    if auto_cache:
        cfg.train.cache_attention = False
    plan, longest = plan_for_config(cfg, device_type, dtype, gpu_bytes=gpu_bytes, host_bytes=host_bytes)
    if offload_gpu_bytes(cfg.train.offload_gpu_memory) == "auto":
        cfg.train.offload_gpu_memory = str(plan.settings["offload_gpu_bytes"])  # what the plan settled
    if plan.fits and auto_cache and not cfg.train.offload:
        cached, cached_longest = plan_for_config(_with(cfg, cache_attention=True), device_type, dtype,
                                                 gpu_bytes=gpu_bytes, host_bytes=host_bytes)
        if cached.fits:
            cfg.train.cache_attention = True
            return cached, cached_longest
    if not plan.fits and cfg.train.master_weights == "auto" and plan.settings.get("master_weights"):
        # fp32 copies cost 4 bytes per parameter, and AdamW's moments 4 more in fp32.
        without, without_longest = plan_for_config(_with(cfg, master_weights=False), device_type, dtype,
                                                   gpu_bytes=gpu_bytes, host_bytes=host_bytes)
        if without.fits:
            cfg.train.master_weights = False
            return without, without_longest
    return plan, longest


def check_memory(cfg: Config, device: torch.device, dtype: torch.dtype) -> MemoryPlan | None:
    """Refuse a run whose plan does not fit this machine (train.memory_check=false skips it).

    Settles the `auto` settings in cfg (resolve_auto_settings); without the check they are off
    (cache_attention) and on (master_weights).
    """
    if not cfg.train.memory_check:
        if cfg.train.cache_attention == "auto":
            cfg.train.cache_attention = False
        if offload_gpu_bytes(cfg.train.offload_gpu_memory) == "auto":
            cfg.train.offload_gpu_memory = "0"  # no plan, no allowance
        return None
    gpu, host = available_memory(device)
    plan, longest = resolve_auto_settings(cfg, device.type, dtype, gpu_bytes=gpu, host_bytes=host)
    if plan.fits:
        return plan
    where = []
    if not plan.gpu_fits:
        where.append(f"{_gib(plan.gpu_bytes)} of GPU memory but {device} has {_gib(gpu)} free")
    if not plan.host_fits:
        where.append(f"{_gib(plan.host_bytes)} of host memory but {_gib(host)} is available")
    biggest = sorted(plan.items, key=lambda i: -(i.gpu_bytes if device.type == "cuda" else i.host_bytes))[:4]
    parts = ", ".join(f"{i.name} {_gib(i.gpu_bytes if device.type == 'cuda' else i.host_bytes)}" for i in biggest)
    limits = dict(device_total_bytes=gpu, host_total_bytes=host)
    fixes = _alternatives(cfg, device.type, dtype, limits)
    message = (
        f"this run needs {' and '.join(where)} (largest items: {parts}). "
        + (f"The longest data.seq_len that fits with these settings is {longest:,}. " if longest
           else "No data.seq_len fits with these settings. ")
        + (f"Or keep data.seq_len={cfg.data.seq_len:,} and set {'; or '.join(fixes)}. " if fixes else "")
        + "`oomb plan` with the same config prints the full breakdown; "
        "train.memory_check=false skips this check."
    )
    raise ConfigError(message)


def print_plan(plan: MemoryPlan, longest: int, console: Console, *, gpu_source: str, host_source: str) -> None:
    """The breakdown table, the totals against the memory available and the longest context."""
    gpu = plan.device_type == "cuda"
    table = Table(title=f"oomb plan: {plan.settings['family']}, {plan.settings['seq_len']:,} tokens "
                  f"x {plan.settings['batch_size']}, chunk {plan.settings['chunk_size']}, "
                  f"{plan.settings['dtype']}, {plan.settings['optimizer']}"
                  + (" on fp32 master weights" if plan.settings.get("master_weights") else "")
                  + (", layer checkpointing" if plan.settings["layer_checkpointing"] else "")
                  + (f", one of {plan.settings['tensor_parallel']} tensor parallel ranks"
                     if plan.settings.get("tensor_parallel", 1) > 1 else ""))
    table.add_column("item")
    if gpu:
        table.add_column("GPU", justify="right")
    table.add_column("host", justify="right")
    table.add_column("what", overflow="fold")
    for i in plan.items:
        row = [i.name] + ([_gib(i.gpu_bytes)] if gpu else []) + [_gib(i.host_bytes), i.note]
        table.add_row(*row)
    table.add_section()
    table.add_row("total", *([_gib(plan.gpu_bytes)] if gpu else []), _gib(plan.host_bytes), "")
    console.print(table)
    if gpu:
        verdict = "fits" if plan.gpu_fits else "does NOT fit"
        console.print(f"GPU: {_gib(plan.gpu_bytes)} of {_gib(plan.device_total_bytes)} ({gpu_source}): {verdict}")
    verdict = "fits" if plan.host_fits else "does NOT fit"
    console.print(f"host: {_gib(plan.host_bytes)} of {_gib(plan.host_total_bytes)} ({host_source}): {verdict}")
    console.print(f"longest data.seq_len that fits with these settings: {longest:,} tokens")
    for note in plan.notes:
        console.print(f"note: {note}")


def run_plan(cfg: Config, console: Console, *, gpu_memory: str | None, host_memory: str | None,
             as_json: bool) -> int:
    """`oomb plan`: 0 when the run fits, 1 when it does not.

    Plans for CUDA when train.device asks for it, when it is auto and a GPU is visible, or when
    --gpu-memory names the GPU to plan for; else for a CPU run (host memory only).
    """
    from oomb.train.checks import check_config, resolve_dtype

    check_config(cfg)
    name = cfg.train.device
    if name not in ("auto", "cpu") and not name.startswith("cuda"):
        raise ConfigError(f"train.device={name!r}: use auto, cpu, cuda or cuda:N")
    cuda_here = torch.cuda.is_available()
    on_cuda = name.startswith("cuda") or (name == "auto" and (cuda_here or gpu_memory is not None))
    device = torch.device(name if name.startswith("cuda") else "cuda" if on_cuda else "cpu")
    dtype = resolve_dtype(cfg.model.dtype, device)
    if on_cuda and gpu_memory is None and not cuda_here:
        raise ConfigError("no CUDA device here: give the memory of the GPU to plan for, e.g. --gpu-memory 141GiB")
    gpu_here, host_here = available_memory(device if cuda_here else torch.device("cpu"))
    gpu = parse_bytes(gpu_memory) if gpu_memory is not None else gpu_here if on_cuda else None
    host = parse_bytes(host_memory) if host_memory is not None else host_here
    plan, longest = resolve_auto_settings(cfg, device.type, dtype, gpu_bytes=gpu, host_bytes=host)
    if as_json:
        print(json.dumps({**plan.to_dict(), "largest_seq_len": longest}, indent=2))
    else:
        print_plan(plan, longest, console,
                   gpu_source="--gpu-memory" if gpu_memory is not None else f"free on {device}",
                   host_source="--host-memory" if host_memory is not None else "available on this machine")
        if (advice := offload_selection_note(cfg)) is not None:
            console.print(f"note: {advice}", highlight=False, soft_wrap=True)
    return 0 if plan.fits else 1
