"""The memory plan of a run config: `oomb plan`, and the check `oomb train` makes before any work.

    resolve_auto_settings(cfg, device, dtype, ...)  ->  settles train's `auto` settings together in cfg; the
                                                        MemoryPlan (oomb.planning.plan) and the longest context
    plan_for_config(cfg, device, dtype, ...)        ->  the same on a copy of cfg
    check_memory(cfg, device, dtype)                ->  raises ConfigError when the plan does not fit, saying why,
                                                        the longest context that fits and the settings that would
"""

from __future__ import annotations

import copy
import dataclasses
import json

import torch
from rich.console import Console
from rich.table import Table

from oomb.engine.layer_recompute import layers_rebuildable
from oomb.engine.options import MemoryLimits, RunShape, StepOptions, with_changes
from oomb.planning.plan import MemoryPlan, largest_context, plan_first_fitting, plan_memory, weights_lora_modules
from oomb.planning.plan import format_bytes as _gib
from oomb.planning.timing import H200_DENSE, PageSparsity, StepWork, adapter_bytes_per_token, predict_step_seconds
from oomb.surgery.adapters import UnknownLoraTargets
from oomb.surgery.fused_ops import run_mode as fused_ops_run_mode
from oomb.surgery.fused_ops import will_fuse
from oomb.train.config.settings import Config, ConfigError
from oomb.train.config.step import (
    capped_gpu_bytes,
    gpu_memory_source,
    gpu_room,
    offload_gpu_bytes,
    offload_selection_note,
    parse_bytes,
    settled_chunk_size,
    step_options,
)
from oomb.train.data.inputs import model_config, position_notes, positions_warning
from oomb.train.loop.auto_chunks import (
    CACHE_MIN_CHUNK,
    LAYER_AUTO_CHUNK_START,
    OFFLOAD_CHUNK_FLOOR,
    chunk_choices,
    computes_each_layer_once,
    whole_sequence_chunk,
)
from oomb.train.loop.distributed import smallest_over_ranks, under_torchrun
from oomb.train.loop.host_memory import available_memory, host_shortfall, memory_limits, process_bytes
from oomb.train.loop.model import lora_target_names
from oomb.train.loop.optim import wants_master_weights


def planned_step(cfg: Config, device_type: str, dtype: torch.dtype) -> tuple[StepOptions, RunShape, int | str]:
    """The run's step as planned: the StepOptions its steps run with (step_options), its RunShape, and the offload
    GPU allowance ("auto": each plan settles it). Offload is planned on a GPU only (on a CPU both are host memory).
    The attention backend auto plans FlashAttention-4's gathered keys on a GPU, whether or not it is installed."""
    t = cfg.train
    gpu = device_type == "cuda"
    options = dataclasses.replace(step_options(cfg), offload=t.offload and gpu, offload_gpu_bytes=0)
    shape = RunShape(seq_len=cfg.data.seq_len, batch_size=t.batch_size, dtype=dtype, device_type=device_type,
                     lora_r=cfg.lora.r, lora_targets=lora_target_names(cfg),  # the targets "lora.r=16" is offered with
                     lora_fused=cfg.lora.fused,
                     quantize=cfg.model.quantize, optimizer=t.optimizer,
                     master_weights=wants_master_weights(t.master_weights, torchrun=under_torchrun(cfg)),
                     tensor_parallel=t.tensor_parallel, layer_checkpointing=t.layer_checkpointing,
                     fused_ops=plans_fused_ops(cfg, device_type))
    return options, shape, offload_gpu_bytes(t.offload_gpu_memory) if options.offload else 0


def plans_fused_ops(cfg: Config, device_type: str) -> bool:
    """Whether the run will swap in liger's fused RMSNorm/SwiGLU (oomb.train.loop.model does it the same way)."""
    return will_fuse(fused_ops_run_mode(cfg.train.fused_ops, cfg.train.tensor_parallel), device_type)


def plan_for_config(cfg: Config, device_type: str, dtype: torch.dtype, *, gpu_bytes: int | None,
                    host_bytes: int | None) -> tuple[MemoryPlan, int]:
    """The run's plan against the given memory with its `auto` settings settled as `oomb train` settles them
    (resolve_auto_settings, on a copy: cfg is left as it is), and the longest data.seq_len that would fit."""
    return resolve_auto_settings(copy.deepcopy(cfg), device_type, dtype, gpu_bytes=gpu_bytes, host_bytes=host_bytes)


def _alternatives(cfg: Config, device_type: str, dtype: torch.dtype, limits: MemoryLimits) -> list[str]:
    """Single setting changes that make the plan fit, cheapest in speed or quality first."""
    config = model_config(cfg)
    options, shape, allowance = planned_step(cfg, device_type, dtype)
    t = cfg.train
    candidates: list[tuple[str, dict]] = []
    if t.cache_attention is True:  # costs only speed
        candidates.append(("train.cache_attention=false", {"cache_attention": False}))
    if t.recompute == "chunk" and layer_recompute_possible(cfg, device_type):
        candidates.append(("train.recompute=layer-host", {"recompute": "layer-host"}))
    if not t.layer_checkpointing:
        candidates.append(("train.layer_checkpointing=true", {"layer_checkpointing": True, "recompute": "chunk"}))
    chunk = t.chunk_size // 2
    while chunk >= t.page_size and chunk % t.page_size == 0:
        candidates.append((f"train.chunk_size={chunk}", {"chunk_size": chunk}))
        chunk //= 2
    if t.optimizer == "adamw":
        candidates.append(("train.optimizer=adamw8bit", {"optimizer": "adamw8bit"}))
    if shape.master_weights:  # a no-op for fp32 parameters: then it does not fit either and is not offered
        candidates.append(("train.master_weights=false", {"master_weights": False}))
    if cfg.lora.r == 0:
        candidates.append(("lora.r=16", {"lora_r": 16}))
    elif cfg.model.quantize == "none" and t.tensor_parallel == 1:  # the base in 4 bits: QLoRA
        candidates.append(("model.quantize=nf4", {"quantize": "nf4"}))
    if device_type == "cuda" and not t.offload:
        candidates.append(("train.offload=true" + (" train.cache_attention=false" if t.cache_attention is True else ""),
                           {"offload": True, "cache_attention": False, "recompute": "chunk"}))
    found, chunk_found = [], False
    for text, change in candidates:
        if "chunk_size" in change and chunk_found:
            continue
        plan = plan_memory(config, *with_changes(options, shape, change), limits, offload_gpu_bytes=allowance)
        if plan.fits:
            found.append(f"{text} ({_gib(plan.gpu_bytes if device_type == 'cuda' else plan.host_bytes)})")
            chunk_found = chunk_found or "chunk_size" in change
    return found


def auto_choices(cfg: Config, device_type: str, seq_len: int | None = None) -> list[dict]:
    """The settings the run's `auto` values may take, as plan_memory arguments, most preferred first.

    fp32 master weights first (train.master_weights=auto: precision), then speed and memory: on a GPU the whole
    sequence as one chunk computed once (whole_sequence_chunk), where its activations fit. Then, with
    train.recompute=auto, where the run trains in one process without layer checkpointing,
    recompute=layer-host comes next: every layer's input in host memory and one layer's activations on the
    GPU leave room for chunks twice as long (H200, Qwen2.5-7B, 64K, one run: chunks of 16384 with layer-host
    0.94x the best transformers stack's step time in 0.97x its memory, chunks of 8192 with whole-chunk
    recompute 0.95x in 1.53x; docs/benchmarks.md); its chunks start at LAYER_AUTO_CHUNK_START, each with the
    attention cache on the GPU, then in host memory; then the chunks without the cache. Then recompute=chunk:
    the largest chunk (train.chunk_size=auto) with the attention cache on the GPU (train.cache_attention=auto; with
    offload in host memory), then without it. Each choice names all four settings, fixed ones as set; the offload
    GPU allowance (train.offload_gpu_memory=auto) is settled by each choice's own plan. With offload, whole-chunk
    recompute keeps its chunks of OFFLOAD_CHUNK_FLOOR and more first (+0.5% over the pages on the GPU, Qwen2.5-7B
    at 64K, H100: docs/benchmarks.md), then layer-host, then its shorter chunks: each chunk brings every offloaded
    layer's past again, so halving the chunk doubles the page traffic, where layer-host brings a layer's pages
    once a chunk for its forward and backward and fits chunks twice as long (Llama-3-8B QLoRA at 64K held to 23.6
    GiB, H100: layer-host with chunks of 16384 ran, whole chunks of 2048 ran out of memory; docs/benchmarks.md).
    ``seq_len``: the chunks for that length (None: every chunk auto may take, for the longest context)."""
    t = cfg.train
    options, shape, _ = planned_step(cfg, device_type, torch.float32)  # the fixed values (master weights auto: on)
    wanted = shape.master_weights
    masters = [True, False] if t.master_weights == "auto" and wanted else [wanted]

    def speed(by_layer: bool) -> list[tuple[int, bool | str]]:
        if t.chunk_size != "auto":
            chunks = [t.chunk_size]
        else:
            chunks = chunk_choices(cfg, device_type, seq_len, LAYER_AUTO_CHUNK_START if by_layer else None)
        if t.cache_attention != "auto":
            return [(c, options.cache_attention) for c in chunks]
        floor = min(CACHE_MIN_CHUNK, chunks[0])
        if t.offload:  # the engine refuses the cache on the GPU with offload; in host memory it costs host memory
            return [(c, "host") for c in chunks if c >= floor] + [(c, False) for c in chunks]
        if not by_layer:
            return [(c, True) for c in chunks if c >= floor] + [(c, False) for c in chunks]
        # The cache in host memory too (stage 2 reads it, not the attention kernels), right after it on the GPU:
        # it cost no step time on the H200, where halving the chunk costs some.
        cached = [(c, where) for c in chunks if c >= floor for where in (True, "host")]
        return cached + [(c, False) for c in chunks]

    def choices(mode: str, keep=lambda chunk: True) -> list[tuple[str, int, bool | str]]:
        return [(mode, c, k) for c, k in speed(mode != "chunk") if keep(c)]

    by_layer = t.recompute == "auto" and layer_recompute_possible(cfg, device_type)
    if not by_layer:
        order = choices("chunk" if t.recompute == "auto" else t.recompute)
    elif t.offload:
        order = (choices("chunk", lambda c: c >= OFFLOAD_CHUNK_FLOOR) + choices("layer-host")
                 + choices("chunk", lambda c: c < OFFLOAD_CHUNK_FLOOR))
    else:
        order = choices("layer-host") + choices("chunk")
    whole = whole_sequence_chunk(cfg, device_type, seq_len)
    if whole is not None:  # with one chunk there is nothing for the attention cache to keep: off, unless set
        one = ("chunk", whole, False if t.cache_attention == "auto" else options.cache_attention)
        order = [one, *(o for o in order if o != one)]
    return [dict(master_weights=m, chunk_size=c, cache_attention=k, recompute=r) for m in masters for r, c, k in order]


def layer_recompute_possible(cfg: Config, device_type: str) -> bool:
    """Whether train.recompute=auto may choose layer-host: one process (FSDP under torchrun replays no layers),
    no transformers layer checkpointing, decoder layers it can rebuild (oomb.engine.layer_recompute)."""
    t = cfg.train  # (on a CPU the host is the same memory: nothing to gain)
    if under_torchrun(cfg) or t.layer_checkpointing or device_type != "cuda":
        return False
    # a decoder whose layers cannot be rebuilt one at a time (not transformers' GradientCheckpointingLayers)
    return layers_rebuildable(model_config(cfg), cfg.model.trust_remote_code)


def resolve_auto_settings(cfg: Config, device_type: str, dtype: torch.dtype, *, gpu_bytes: int | None,
                          host_bytes: int | None, process: int | None = None) -> tuple[MemoryPlan, int]:
    """Settle the `auto` settings that trade memory for speed or precision against the plan, in cfg.

    They are settled together for data.seq_len: the first of auto_choices whose plan fits (with the
    offload GPU allowance that plan leaves) is the run's; where none fits, the one that needs the least
    (its plan says by how much). The longest data.seq_len that fits is the longest over all the choices,
    so it depends neither on the order they are tried in nor on data.seq_len. train.master_weights=auto
    stays "auto" where the copies are kept and becomes false where they are dropped. Returns the plan and
    the longest data.seq_len. ``process``: this process's resident memory, measured (oomb.train.loop.host_memory).
    """
    config = model_config(cfg)
    options, shape, allowance = planned_step(cfg, device_type, dtype)
    limits = memory_limits(gpu_bytes, host_bytes, process)
    choices = auto_choices(cfg, device_type, cfg.data.seq_len)
    try:
        plan, index = plan_first_fitting(config, options, shape, limits, choices=choices, offload_gpu_bytes=allowance)
        longest = largest_context(config, options, shape, limits, choices=auto_choices(cfg, device_type),
                                  offload_gpu_bytes=allowance)
    except UnknownLoraTargets as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"memory plan: {e}; train.memory_check=false skips the plan") from e
    t = cfg.train
    if t.master_weights == "auto" and shape.master_weights and not choices[index]["master_weights"]:
        t.master_weights = False
    if t.cache_attention == "auto":
        t.cache_attention = plan.settings["cache_attention"]
    if t.chunk_size == "auto":
        t.chunk_size = plan.settings["chunk_size"]
    if t.recompute == "auto":
        t.recompute = plan.settings["recompute"]
    if offload_gpu_bytes(t.offload_gpu_memory) == "auto":
        t.offload_gpu_memory = str(plan.settings["offload_gpu_bytes"])  # what the chosen plan settled
    return plan, longest


def describe_step_choice(cfg: Config, auto: set[str] | frozenset[str], *, planned: bool) -> str:
    """The chunk and attention cache the run steps with, and what chose them, e.g. "chunk 8192, attention
    cache on (chosen by the memory plan)". ``auto``: the train keys that were "auto" before check_memory."""
    t = cfg.train
    why = "chosen by the memory plan" if planned else "train.memory_check=false: no memory plan"
    whole = computes_each_layer_once(t.recompute, t.chunk_size, cfg.data.seq_len)
    chunk = f"chunk {t.chunk_size}" + (" (the whole sequence: no layer computed twice)" if whole else "")
    cache = ("attention cache " + {True: "on", "host": "in host memory"}.get(t.cache_attention, "off")
             if isinstance(t.cache_attention, (bool, str)) else "attention cache off")
    by_layer = "" if t.recompute in ("chunk", "auto") else (
        f", recompute {t.recompute}" + (f" ({why})" if "recompute" in auto else ""))
    if {"chunk_size", "cache_attention"} <= auto:
        return f"{chunk}, {cache} ({why})" + by_layer
    return (chunk + (f" ({why})" if "chunk_size" in auto else "") + ", "
            + cache + (f" ({why})" if "cache_attention" in auto else "") + by_layer)


def describe_offload(cfg: Config, plan: MemoryPlan | None) -> str:
    """With train.offload and a plan, where the store keeps the pages, as the plan settled it (else "")."""
    if not cfg.train.offload or plan is None:
        return ""
    resident = plan.settings["offload_resident_layers"]
    if not resident:
        return ", offload: every layer's pages in host memory"
    return (f", offload: the pages of {resident} layer{'s' * (resident != 1)} kept on the GPU "
            f"(train.offload_gpu_memory={cfg.train.offload_gpu_memory} bytes)")


def check_memory(cfg: Config, device: torch.device, dtype: torch.dtype, *, torchrun: bool = False
                 ) -> MemoryPlan | None:
    """Refuse a run whose plan does not fit this machine (train.memory_check=false skips it). Settles the `auto`
    settings in cfg (resolve_auto_settings); without the check they are off (cache_attention), on (master_weights)
    and chunks of up to 1024 tokens (settled_chunk_size).
    ``torchrun``: every rank calls this, and all step the smallest chunk any rank's plan chose (a step's
    collectives run per chunk, and each rank plans against its own free memory).
    """
    if not cfg.train.memory_check:
        if cfg.train.cache_attention == "auto":
            cfg.train.cache_attention = False
        if cfg.train.recompute == "auto":
            cfg.train.recompute = "chunk"
        cfg.train.chunk_size = settled_chunk_size(cfg)
        if offload_gpu_bytes(cfg.train.offload_gpu_memory) == "auto":
            cfg.train.offload_gpu_memory = "0"  # no plan, no allowance
        return None
    available = available_memory(device)
    (gpu, host), process = available, process_bytes(available)  # the host check counts what this process holds
    gpu = capped_gpu_bytes(gpu, cfg)  # train.gpu_memory
    asked = copy.copy(cfg.train)
    plan, longest = resolve_auto_settings(cfg, device.type, dtype, gpu_bytes=gpu, host_bytes=host, process=process)
    if torchrun and asked.chunk_size == "auto":
        smallest = smallest_over_ranks(cfg.train.chunk_size)
        if smallest != cfg.train.chunk_size:  # settle again from the settings as asked, with that chunk
            vars(cfg.train).update(vars(asked), chunk_size=smallest)
            plan, longest = resolve_auto_settings(cfg, device.type, dtype, gpu_bytes=gpu, host_bytes=host,
                                                  process=process)
    if plan.fits:
        return plan
    where = []
    if not plan.gpu_fits:
        where.append(f"{_gib(plan.gpu_bytes)} of GPU memory but {gpu_room(device, gpu, cfg)}")
    if not plan.host_fits:
        where.append(host_shortfall(plan, host, process))
    biggest = sorted(plan.items, key=lambda i: -(i.gpu_bytes if device.type == "cuda" else i.host_bytes))[:4]
    parts = ", ".join(f"{i.name} {_gib(i.gpu_bytes if device.type == 'cuda' else i.host_bytes)}" for i in biggest)
    fixes = _alternatives(cfg, device.type, dtype, memory_limits(gpu, host, process))
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
                  + (", NF4 base (QLoRA)" if plan.settings.get("quantize", "none") != "none" else "")
                  + (", layer checkpointing" if plan.settings["layer_checkpointing"] else "")
                  + (f", recompute {plan.settings['recompute']}" if plan.settings.get("recompute", "chunk") != "chunk"
                     else "")
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


def plan_with_any_host(cfg: Config, device_type: str, dtype: torch.dtype, config, gpu_bytes: int | None
                       ) -> MemoryPlan:
    """The plan `oomb train` would settle for cfg's data.seq_len with train.offload=true on a GPU of ``gpu_bytes``
    and a host of any size: its `auto` settings (chunk, offload GPU allowance, master weights) chosen as for a
    run (auto_choices), so a length that does not fit here is planned at the chunk a bigger host would run, not
    at the smallest one tried here. The attention cache is off (the least host memory), and layer recompute."""
    c = copy.deepcopy(cfg)
    c.train.offload, c.train.cache_attention = True, False
    if c.train.recompute in ("layer", "layer-host"):
        c.train.recompute = "chunk"
    options, shape, allowance = planned_step(c, device_type, dtype)
    plan, _ = plan_first_fitting(config, options, shape, MemoryLimits(gpu_bytes=gpu_bytes),
                                 choices=auto_choices(c, device_type, c.data.seq_len), offload_gpu_bytes=allowance)
    return plan


def needs_and_time(cfg: Config, plan: MemoryPlan, device_type: str, dtype: torch.dtype, config) -> dict:
    """What the asked length needs where it does not fit (GPU alone, or GPU and host with offload), and the
    predicted seconds of a dense or page-sparse step on the GPU the step rates were measured on (None: not
    predicted).
    ``cfg``: the config as asked (its `auto` settings not settled); ``plan``: its plan on this machine.

    Where it does not fit, "needs" is planned as `oomb train` would run it on this GPU with a host of any size
    (plan_with_any_host: its chunk, and the pages of as many whole layers as the GPU holds besides the rest),
    and with the same settings and every page on the GPU; the prediction is for that offloaded run (no
    attention cache)."""
    n = cfg.data.seq_len
    result = {"needs": None, "predicted_dense_step_s": None, "predicted_sparse_step_s": None,
              "predicted_with_attention_cache": None,
              "predicted_on": H200_DENSE.gpu}
    if device_type != "cuda":
        return result
    cached = plan.settings.get("cache_attention") in (True, "host")
    chunk = plan.settings["chunk_size"]
    if not plan.fits:
        offloaded = plan_with_any_host(cfg, device_type, dtype, config, plan.device_total_bytes)
        same = {k: offloaded.settings[k] for k in ("chunk_size", "master_weights", "recompute", "cache_attention")}
        options, shape, _ = planned_step(cfg, device_type, dtype)
        on_gpu = plan_memory(config, *with_changes(options, shape, {**same, "offload": False}))
        cached, chunk = False, offloaded.settings["chunk_size"]
        result["needs"] = {"gpu_bytes_pages_on_gpu": on_gpu.gpu_bytes, "gpu_bytes_pages_on_host": offloaded.gpu_bytes,
                           "host_bytes_pages_on_host": offloaded.host_bytes,
                           "chunk_size": offloaded.settings["chunk_size"],
                           "layers_on_gpu": offloaded.settings["offload_resident_layers"],
                           "fits_gpu_offloaded": offloaded.gpu_fits}
    work = _step_work(cfg, plan.settings.get("recompute", cfg.train.recompute), chunk, config, device_type, dtype)
    result.update(predicted_forwards=work.forwards, predicted_lora=not work.weight_grads,
                  predicted_four_bit=cfg.model.quantize != "none", predicted_with_attention_cache=cached)
    if cfg.train.page_budget is None:
        result["predicted_dense_step_s"] = predict_step_seconds(config, n, cfg.train.batch_size, cache_attention=cached,
                                                                work=work)
    else:
        sparsity = PageSparsity(cfg.train.page_budget, cfg.train.page_size, chunk)
        result["predicted_sparse_step_s"] = predict_step_seconds(config, n, cfg.train.batch_size,
                                                                 cache_attention=cached, sparsity=sparsity, work=work)
    return result


def _step_work(cfg: Config, recompute: str, chunk: int, config, device_type: str, dtype: torch.dtype) -> StepWork:
    """What the planned step runs beside the time model's setting (oomb.planning.timing.StepWork): whole-chunk
    recompute over one chunk computes each layer once (layer checkpointing once more), LoRA forms no frozen weight
    gradient and streams its adapters' rows."""
    once = computes_each_layer_once(recompute, chunk, cfg.data.seq_len)
    forwards = (1 if once else 2) + (recompute in ("chunk", "auto") and cfg.train.layer_checkpointing)
    if cfg.lora.r == 0:
        return StepWork(forwards=forwards)
    _, shape, _ = planned_step(cfg, device_type, dtype)
    return StepWork(forwards=forwards, weight_grads=False,
                    adapter_bytes=adapter_bytes_per_token(config, weights_lora_modules(config, shape), forwards))


def _needs_and_time_lines(cfg: Config, found: dict) -> list[str]:
    lines = []
    if (needs := found["needs"]) is not None:
        layers = needs["layers_on_gpu"]
        kept = (f"the pages of {layers} layer{'s' * (layers != 1)} kept on the GPU" if layers
                else "every layer's pages in host memory")
        gpu = _gib(needs["gpu_bytes_pages_on_host"]) + ("" if needs["fits_gpu_offloaded"] else
                                                        " (more than this GPU has, with these settings)")
        lines.append(f"data.seq_len={cfg.data.seq_len:,} needs {_gib(needs['gpu_bytes_pages_on_gpu'])} of GPU memory "
                     f"with every page on the GPU, or with train.offload=true {gpu} of GPU memory and "
                     f"{_gib(needs['host_bytes_pages_on_host'])} of host memory (chunk {needs['chunk_size']}, "
                     f"{kept}; as `oomb train` would run it with this GPU and a host that large)")
    cache = "with" if found["predicted_with_attention_cache"] else "without"
    work = "".join((", each layer computed once (one chunk)" if found.get("predicted_forwards") == 1 else "",
                    ", LoRA: no frozen weight gradients, the adapters' products counted"
                    if found.get("predicted_lora") else "",
                    ", the 4-bit base's dequantization not counted (2-13% more measured)"
                    if found.get("predicted_four_bit") else ""))
    if (seconds := found["predicted_dense_step_s"]) is not None:
        lines.append(f"predicted dense step on an {found['predicted_on']} or H100: {_seconds(seconds)} s without the "
                     f"optimizer ({cache} the attention cache{work}; rates from measured 64K and 256K steps; "
                     "docs/memory.md)")
    if (seconds := found["predicted_sparse_step_s"]) is not None:
        lines.append(f"predicted page-sparse step on an {found['predicted_on']}: {_seconds(seconds)} s without the "
                     f"optimizer ({cache} the attention cache{work}; its attention rate from a measured 128K step, "
                     "within 5% of the measured 1M step; docs/memory.md)")
    return lines


def _seconds(seconds: float) -> str:
    return f"{seconds:,.0f}" if seconds >= 100 else f"{seconds:.1f}"


def run_plan(cfg: Config, console: Console, *, gpu_memory: str | None, host_memory: str | None,
             as_json: bool) -> int:
    """`oomb plan`: 0 when the run fits, 1 when it does not.

    Plans for CUDA when train.device asks for it, when it is auto and a GPU is visible, or when
    --gpu-memory names the GPU to plan for; else for a CPU run (host memory only).
    """
    from oomb.train.config.checks import check_config, check_model, resolve_dtype

    check_config(cfg)
    check_model(cfg)
    name = cfg.train.device
    if name not in ("auto", "cpu") and not name.startswith("cuda"):
        raise ConfigError(f"train.device={name!r}: use auto, cpu, cuda or cuda:N")
    if name == "cpu" and gpu_memory is not None:
        raise ConfigError(f"--gpu-memory {gpu_memory} plans for a GPU, but the config says train.device=cpu: "
                          "add train.device=cuda (or auto) to plan the GPU run, or drop --gpu-memory")
    cuda_here = torch.cuda.is_available()
    on_cuda = name.startswith("cuda") or (name == "auto" and (cuda_here or gpu_memory is not None))
    device = torch.device(name if name.startswith("cuda") else "cuda" if on_cuda else "cpu")
    dtype = resolve_dtype(cfg.model.dtype, device)
    if on_cuda and gpu_memory is None and not cuda_here:
        raise ConfigError("no CUDA device here: give the memory of the GPU to plan for, e.g. --gpu-memory 141GiB")
    here = available_memory(device if cuda_here else torch.device("cpu"))
    gpu = capped_gpu_bytes(parse_bytes(gpu_memory) if gpu_memory is not None else here[0] if on_cuda else None, cfg)
    host = parse_bytes(host_memory) if host_memory is not None else here[1]
    process = process_bytes(here) if host_memory is None else None  # --host-memory: another machine's, not measured
    auto = {k for k in ("chunk_size", "cache_attention", "recompute") if getattr(cfg.train, k) == "auto"}
    asked = copy.deepcopy(cfg)  # before its `auto` settings are settled: what a bigger machine would settle
    plan, longest = resolve_auto_settings(cfg, device.type, dtype, gpu_bytes=gpu, host_bytes=host, process=process)
    config = model_config(cfg)
    if as_json:
        warnings = [w for w in (positions_warning(cfg, config),) if w is not None]
        print(json.dumps({**plan.to_dict(), "largest_seq_len": longest, "warnings": warnings,
                          **needs_and_time(asked, plan, device.type, dtype, config)}, indent=2))
    else:
        print_plan(plan, longest, console,
                   gpu_source=gpu_memory_source(gpu_memory, device, cfg),
                   host_source="--host-memory" if host_memory is not None else "available on this machine")
        step = describe_step_choice(cfg, auto, planned=True)
        if not plan.fits:  # the plan shown is the choice that needs least: no step runs with it here
            step = f"none of the choices fits (the plan above is the one that needs least: {step})"
        console.print(f"step: {step}", highlight=False, soft_wrap=True)
        for line in _needs_and_time_lines(cfg, needs_and_time(asked, plan, device.type, dtype, config)):
            console.print(line, highlight=False, soft_wrap=True)
        if (advice := offload_selection_note(cfg)) is not None:
            console.print(f"note: {advice}", highlight=False, soft_wrap=True)
        for line in position_notes(cfg, config):
            console.print(line, highlight=False, soft_wrap=True)
    return 0 if plan.fits else 1
