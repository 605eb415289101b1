"""The training loop behind `oomb train`: build, check, train, log.

    check config, paths, data, optimizer  ->  build model  ->  for each step:
        chunked_backward x grad_accum -> finite? -> clip -> optimizer step
        -> metrics.jsonl (+ TensorBoard), progress -> checkpoint
    -> export (with the tokenizer), training.png

Failures (signals, out of memory, non-finite numbers, a checkpoint that cannot be
written) stop the run through oomb.train.faults.RunStopped; docs/failures.md lists them.
"""

from __future__ import annotations

import datetime
import gc
import inspect
import json
import math
import os
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import oomb
from oomb.engine import StepOptions, release_memory, store_for_model
from oomb.engine.diagnose import locate_nonfinite
from oomb.engine.fused_ops import MODES as FUSED_OPS_MODES
from oomb.engine.fused_ops import liger_available, use_fused_ops
from oomb.offload import OffloadedKVStore
from oomb.train import distributed
from oomb.train.checkpoint import (
    CheckpointError,
    checkpoint_state,
    export_model,
    find_checkpoint,
    load_checkpoint,
    newest_good_checkpoint,
    rng_state,
    rotate_checkpoints,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
    write_text_atomic,
)
from oomb.train.config import (
    Config,
    ConfigError,
    config_to_dict,
    load_config,
    offload_selection_note,
    page_selection,
)
from oomb.train.faults import (
    EXIT_CHECKPOINT_WRITE,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_OUT_OF_MEMORY,
    RunStopped,
    StepAbandoned,
    StopRequest,
    first_nonfinite_grad,
    is_out_of_memory,
    measure_memory,
    memory_report,
    resume_command,
)
from oomb.train.inputs import build_inputs, model_config
from oomb.train.memory import check_memory, offload_gpu_allowance, offload_gpu_bytes
from oomb.train.monitor import TensorBoardLog, memory_fields, plot_run
from oomb.train.optim import MasterWeights, build_optimizer, check_optimizer, wants_master_weights
from oomb.train.presets import build_model, preset_names

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """``auto`` -> cuda when visible, else cpu; ``option`` names the setting in error messages."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"{option} {name!r} is not a device name (use auto, cpu, cuda or cuda:N)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        sep = "=" if option.startswith("train.") else " "
        raise ConfigError(f"{option} asks for CUDA but no CUDA device is visible; use {option}{sep}cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"model.dtype={name!r}: use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def check_config(cfg: Config) -> None:
    """Everything that can be checked before a model is built."""
    t, d = cfg.train, cfg.data
    for name, value in (("train.steps", t.steps), ("train.batch_size", t.batch_size),
                        ("train.grad_accum", t.grad_accum), ("train.chunk_size", t.chunk_size),
                        ("train.page_size", t.page_size), ("data.seq_len", d.seq_len),
                        ("train.tensor_parallel", t.tensor_parallel)):
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if t.chunk_size % t.page_size:
        raise ConfigError(f"train.chunk_size={t.chunk_size} must be a multiple of train.page_size={t.page_size}")
    if t.save_every < 0 or t.keep_last < 0:
        raise ConfigError(f"train.save_every and train.keep_last must be >= 0, got {t.save_every}, {t.keep_last}")
    if t.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(f"train.on_nonfinite={t.on_nonfinite!r}: use stop or skip")
    wants_master_weights(t.master_weights, torchrun=False)  # the value (torchrun's refusal: distributed.setup)
    if t.lr <= 0 or t.warmup_steps < 0 or t.grad_clip < 0 or not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("train.lr must be > 0, train.warmup_steps and train.grad_clip >= 0, "
                          "train.min_lr_ratio in [0, 1]")
    if cfg.model.path is None and cfg.model.preset not in preset_names():
        raise ConfigError(f"unknown model preset {cfg.model.preset!r}; built-in presets: {', '.join(preset_names())}")
    page_selection(cfg)  # page-sparse attention settings
    if not (t.cache_attention is True or t.cache_attention is False or t.cache_attention == "auto"):
        raise ConfigError(f"train.cache_attention={t.cache_attention!r}: use auto (on where the memory plan fits "
                          "with it), true or false")
    offload_gpu_bytes(t.offload_gpu_memory)  # a byte count or auto (ConfigError otherwise)
    if t.fused_ops not in FUSED_OPS_MODES:
        raise ConfigError(f"train.fused_ops={t.fused_ops!r}: use one of {', '.join(FUSED_OPS_MODES)}")
    if t.fused_ops == "liger":
        if t.tensor_parallel > 1:
            raise ConfigError("train.fused_ops=liger is not supported with train.tensor_parallel > 1 (not tested on "
                              "split layers): use train.fused_ops=auto, which leaves split models as they are")
        if not liger_available():
            raise ConfigError("train.fused_ops=liger needs liger-kernel: pip install liger-kernel, or "
                              "train.fused_ops=auto")
        if resolve_device(t.device).type != "cuda":
            raise ConfigError("train.fused_ops=liger runs liger's Triton kernels: it needs a CUDA device (they do not "
                              "run in Triton's CPU interpreter); use train.fused_ops=auto")
    if t.cache_attention is True and t.offload:
        raise ConfigError("train.cache_attention=true keeps attention outputs on the GPU and train.offload=true moves "
                          "pages off it: choose one")


def check_paths(cfg: Config) -> Path | None:
    """Every path in the config, before any work; returns the verified checkpoint to resume from."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not path.is_dir():
            state = "is a file" if path.exists() else "does not exist"
            raise ConfigError(f"model.path={cfg.model.path!r} {state}: give a Hugging Face model folder")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={cfg.model.path!r} has no config.json: not a Hugging Face model folder")
        _check_remote_code(path, cfg.model.trust_remote_code)
    if cfg.resume is not None:
        ckpt = _resume_checkpoint(cfg)
        run = run_dir_of(ckpt)
        if not os.access(run, os.W_OK | os.X_OK):
            raise ConfigError(f"resume={cfg.resume!r}: the run folder {run} is not writable; the resumed run "
                              "writes its metrics and checkpoints there")
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            good = newest_good_checkpoint(run, excluding=ckpt)
            offer = (f"The newest good checkpoint of this run is {good}; continue from it with:\n  "
                     f"{resume_command(good)}" if good is not None else "No other checkpoint of this run is intact.")
            raise ConfigError(f"cannot resume: {e}.\n{offer}") from e
        return ckpt
    out = Path(cfg.out_dir) if cfg.out_dir is not None else Path("runs")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir={str(out)!r} is a file, not a folder")
    if cfg.out_dir is not None and out.is_dir() and any(out.iterdir()):
        raise ConfigError(
            f"out_dir {out} already holds files; oomb never overwrites a run. Choose another out_dir=..."
        )
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"out_dir={str(out)!r}: {parent} is not a writable folder, so the run cannot be written")
    return None


def _check_remote_code(path: Path, trusted: bool) -> None:
    """Refuse a model folder that needs its own Python code unless model.trust_remote_code=true."""
    try:
        fields = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.path: {path / 'config.json'} is not readable JSON: {e}") from e
    auto_map = fields.get("auto_map") or {}
    if trusted or not auto_map:
        return
    from transformers import CONFIG_MAPPING

    if fields.get("model_type") not in CONFIG_MAPPING:  # a known type loads with transformers' own code
        code = ", ".join(sorted({str(v) for v in auto_map.values()}))
        raise ConfigError(
            f"model.path={str(path)!r} needs Python code shipped in the folder ({code}) for model_type "
            f"{fields.get('model_type')!r}, which transformers does not know. oomb never runs code from a model "
            "folder unless you set model.trust_remote_code=true: read that code first."
        )


def check_document_mask_support() -> None:
    """data.document_mask needs the engine's doc_ids argument (attention kept inside each document)."""
    if "doc_ids" not in inspect.signature(oomb.chunked_backward).parameters:
        raise ConfigError("data.document_mask=true needs oomb.chunked_backward(doc_ids=...), which this oomb "
                          "lacks; set data.document_mask=false (documents then attend to earlier ones)")


def load_run_config(config_path: str | None, overrides: list[str]) -> Config:
    """The run's config; with resume=... and no config file, the resumed run's config.json is the base."""
    cfg = load_config(config_path, overrides)
    if cfg.resume is not None and config_path is None:
        run_dir = run_dir_of(_resume_checkpoint(cfg))
        cfg = load_config(run_dir / "config.json", overrides)
    return cfg


def run_dir_of(ckpt: Path) -> Path:
    return ckpt.parent.parent  # <run>/checkpoints/step-N


def _resume_checkpoint(cfg: Config) -> Path:
    if not Path(cfg.resume).exists():
        raise ConfigError(f"resume={cfg.resume!r} does not exist: give a run folder or one of its checkpoints")
    try:
        ckpt = find_checkpoint(Path(cfg.resume))
    except CheckpointError as e:
        raise ConfigError(f"resume={cfg.resume!r}: {e}") from e
    if ckpt.parent.name != "checkpoints" or not (run_dir_of(ckpt) / "config.json").is_file():
        raise ConfigError(f"resume={cfg.resume!r}: {ckpt} is not inside an oomb run folder "
                          "(<run>/checkpoints/step-N beside <run>/config.json)")
    return ckpt


def prepare_out_dir(cfg: Config) -> Path:
    if cfg.resume is not None:
        return run_dir_of(_resume_checkpoint(cfg))
    if cfg.out_dir is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("runs") / stamp
    else:
        out = Path(cfg.out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(
            f"out_dir {out} already holds files; oomb never overwrites a run. Choose another out_dir=..."
        )
    out.mkdir(parents=True, exist_ok=True)
    return out


def lr_lambda(cfg: Config):
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build(cfg: Config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(cfg.train.seed)
    if cfg.model.path is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            cfg.model.path, dtype=dtype, local_files_only=True, trust_remote_code=cfg.model.trust_remote_code
        ).to(device)
    else:
        model = build_model(cfg.model.preset, dtype=dtype, device=device)
    if cfg.lora.r > 0:
        model = _add_lora(model, cfg)
    return model


def _add_lora(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """Wrap with peft LoRA adapters: only the adapters train (no dropout: chunks are recomputed)."""
    try:
        import peft
    except ImportError as e:
        raise ConfigError("lora.r > 0 needs the peft package: pip install peft") from e
    targets = [t.strip() for t in cfg.lora.targets.split(",") if t.strip()]
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    unknown = [t for t in targets if t not in names]
    if not targets or unknown:
        raise ConfigError(f"lora.targets names no layer of this model: {unknown or targets}; "
                          "e.g. q_proj,k_proj,v_proj,o_proj")
    lora = peft.LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=0.0, target_modules=targets)
    return peft.get_peft_model(model, lora)


def train(cfg: Config, console: Console | None = None) -> Path:
    """Run the configured training; returns the output folder (metrics.jsonl, config.json).

    Raises ConfigError before any work for bad settings or paths, and RunStopped for a
    failure it handled during the run (the message says what is on disk and how to resume).
    Under torchrun (WORLD_SIZE > 1) the ranks train data parallel, or tensor parallel with
    train.tensor_parallel > 1: oomb.train.distributed.
    """
    check_config(cfg)
    ctx = distributed.setup(cfg)  # None in a single process
    try:
        return _train(cfg, console, ctx)
    finally:
        distributed.teardown(ctx)


def _train(cfg: Config, console: Console | None, ctx: distributed.DistributedContext | None) -> Path:
    main_rank = ctx is None or ctx.is_main  # the rank that prints and writes the run's files
    console = (console or Console()) if main_rank else Console(quiet=True)
    resume_from = check_paths(cfg)
    if resume_from is not None:
        try:
            distributed.check_checkpoint_format(resume_from, ctx)
        except CheckpointError as e:
            raise ConfigError(f"cannot resume: {e}") from e
    device = ctx.device if ctx is not None else resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    check_optimizer(cfg.train.optimizer, device)
    if ctx is None:
        inputs = build_inputs(cfg, model_config(cfg))  # data, tokenizer, positions: checked before the model
    else:  # each rank (tensor parallel: each group of ranks) its own rows of the sequences drawn for all
        inputs = distributed.build_rank_inputs(cfg, model_config(cfg), ctx, build_inputs)
    if ctx is not None and ctx.tensor_parallel > 1:
        distributed.check_tensor_parallel(ctx, model_config(cfg))
    if cfg.data.document_mask:
        check_document_mask_support()
    master_setting = cfg.train.master_weights
    # The plan must fit before the model or a checkpoint is touched; it settles the `auto` settings.
    plan = check_memory(cfg, device, dtype)
    if master_setting != cfg.train.master_weights:  # auto, and only the run without fp32 copies fits
        console.print(
            "note: train.master_weights=auto: fp32 master weights do not fit beside this run, so the optimizer "
            f"steps the {dtype} weights directly (updates below half a {dtype} step are lost); "
            "train.optimizer=adamw8bit or lora.r=16 make room for them")
    model = build(cfg, device, dtype)
    out = prepare_out_dir(cfg) if ctx is None else distributed.prepare_out_dir(ctx, cfg, prepare_out_dir)
    model.train()
    if cfg.train.layer_checkpointing:  # transformers' own; exact inside oomb's chunks (tested)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused_mode = cfg.train.fused_ops if cfg.train.tensor_parallel == 1 else "none"
    fused = use_fused_ops(model, fused_mode)  # before a split and the optimizer (the same Parameters either way)
    if fused:
        console.print(f"fused ops: liger RMSNorm / SwiGLU in {len(fused)} modules")
    if ctx is not None and ctx.tensor_parallel > 1:
        model = distributed.split_model(model, ctx)  # before the optimizer: it holds the split parameters
    if ctx is not None and ctx.data_parallel > 1:  # over the groups of tensor parallel ranks, if any
        mesh = ctx.mesh["dp"] if ctx.mesh is not None else None
        model = distributed.shard_model(model, mesh)  # before the optimizer: its states are sharded too
    params = [p for p in model.parameters() if p.requires_grad]
    groups = distributed.param_groups(params) if ctx is not None and ctx.tensor_parallel > 1 else params
    optimizer = build_optimizer(cfg.train.optimizer, groups, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                master_weights=wants_master_weights(cfg.train.master_weights, torchrun=ctx is not None))
    masters = isinstance(optimizer, MasterWeights)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    start = 0
    if resume_from is not None:
        try:
            if ctx is None:
                start = load_checkpoint(resume_from, model, optimizer, scheduler, verify=False)  # verified above
            else:
                start = distributed.load_checkpoint(ctx, resume_from, model, optimizer, scheduler)
            inputs.load_state_dict(checkpoint_state(resume_from).get("data", {}))
        except CheckpointError as e:
            raise ConfigError(f"cannot resume from {resume_from}: {e}") from e
        if main_rank:
            _roll_back_metrics(out / "metrics.jsonl", start)
        console.print(f"resuming {out} after step {start} from {resume_from}")
        saved_lr = _apply_config_lr(scheduler, cfg.train.lr)
        if saved_lr is not None:
            console.print(f"note: train.lr={cfg.train.lr:g} replaces the checkpoint's {saved_lr:g}: the schedule "
                          f"continues from step {start} with the new peak rate")
        if main_rank:
            kept = _record_resumed_config(out, cfg, start)
            if kept is not None:
                console.print(f"note: the resumed run's settings differ from {out / 'config.json'}: it now holds "
                              f"them (the previous one is kept as {kept.name}), so a later resume continues them")
        if checkpoint_state(resume_from).get("master_weights", False) != masters:
            console.print(f"note: {resume_from} was written without fp32 master weights: they start from its "
                          f"{dtype} weights" if masters else
                          f"note: {resume_from} holds fp32 master weights, which this run does not use "
                          f"(train.master_weights={str(cfg.train.master_weights).lower()}): it steps the {dtype} "
                          "weights saved beside them (the masters rounded)")
    else:
        cfg.out_dir = str(out)
        if main_rank:
            (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    n_params = sum(p.numel() for p in params)
    console.print(
        f"[bold]oomb train[/]: {cfg.model.path or cfg.model.preset} ({n_params / 1e6:.2f}M params, {dtype}) on "
        f"{device}; {cfg.train.steps} steps x {cfg.train.grad_accum * cfg.train.batch_size} x {cfg.data.seq_len} "
        f"tokens ({cfg.data.task}), {cfg.train.optimizer} "
        f"{'on fp32 master weights' if masters else 'without master weights'}, "
        f"chunk {cfg.train.chunk_size}, page {cfg.train.page_size}; writing {out}/metrics.jsonl"
    )
    if plan is not None:
        console.print(plan.summary() + " (oomb plan prints the breakdown)")
    if (advice := offload_selection_note(cfg)) is not None:
        console.print(f"note: {advice}")
    run = _Run(cfg, out, model, optimizer, scheduler, inputs, device,
               saved_step=start if resume_from is not None else None, ctx=ctx)
    tokens_per_step = cfg.train.grad_accum * cfg.train.batch_size * cfg.data.seq_len * (ctx.data_parallel if ctx else 1)
    columns = [
        TextColumn("step {task.completed}/{task.total}"), BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TextColumn("{task.fields[memory]}"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
    ]
    tensorboard = (TensorBoardLog(out, resumed_after=start if cfg.resume is not None else None)
                   if cfg.train.tensorboard and main_rank else None)
    started = time.perf_counter()
    stop = StopRequest().install(model, at_chunks=ctx is None)  # under torchrun: at step ends, all ranks agreed
    skipped = 0
    try:
        metrics_path = out / "metrics.jsonl" if main_rank else os.devnull  # one rank writes the run's metrics
        with open(metrics_path, "a") as metrics, Progress(*columns, console=console) as progress:
            bar = progress.add_task("train", total=cfg.train.steps, completed=start, loss=float("nan"), tps=0.0,
                                    memory="")
            loss_value = float("nan")
            for step in range(start, cfg.train.steps):
                data_before = inputs.state_dict()  # a dropped step's sequences are drawn again after a resume
                batches = inputs.batches(step)
                t0 = time.perf_counter()
                rng_before = rng_state()
                abandoned, out_of_memory = False, None
                try:
                    loss, grad_norm = _forward_backward(model, params, batches, device, cfg, ctx)
                except StepAbandoned:
                    abandoned = True
                except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
                    if not is_out_of_memory(e):
                        raise
                    out_of_memory = (_first_line(e), measure_memory(model, optimizer))  # before anything is freed
                # Handled outside the except blocks: the traceback holds the step's activations.
                if abandoned:
                    optimizer.zero_grad(set_to_none=True)  # also the gradients of earlier grad_accum batches
                    set_rng_state(rng_before)  # as after step `step`, for an exact resume
                    run.stop_on_signal(stop, step, dropped=step + 1, data_state=data_before)
                if out_of_memory is not None:
                    run.stop_out_of_memory(step, "the forward/backward pass", *out_of_memory, data_state=data_before)
                nonfinite = None
                if not bool(torch.isfinite(loss) & torch.isfinite(grad_norm)):  # host sync, once per step
                    nonfinite = run.nonfinite(step, loss, grad_norm, batches)  # stops, or skip
                    skipped += 1
                else:
                    if cfg.train.grad_clip > 0 and ctx is not None:
                        distributed.clip_gradients(params, cfg.train.grad_clip, grad_norm)
                    elif cfg.train.grad_clip > 0:
                        torch.nn.utils.clip_grads_with_norm_(params, cfg.train.grad_clip, grad_norm)
                    try:
                        optimizer.step()
                    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
                        if not is_out_of_memory(e):
                            raise
                        out_of_memory = (_first_line(e), measure_memory(model, optimizer))
                    if out_of_memory is not None:
                        run.stop_out_of_memory(step, "the optimizer step", *out_of_memory, model_intact=False)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                loss_value = float(loss)  # host sync: the step is done
                seconds = time.perf_counter() - t0
                record = {
                    "step": step + 1,
                    "loss": loss_value if nonfinite is None else None,
                    "tokens": tokens_per_step * (step + 1),
                    "seconds": seconds,
                    "elapsed": time.perf_counter() - started,
                    "tokens_per_s": tokens_per_step / seconds,
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm) if nonfinite is None else None,
                }
                if nonfinite is not None:
                    record.update(skipped="non-finite", skipped_steps=skipped, **nonfinite)
                store = store_for_model(model)
                record.update(memory_fields(device, store.host_nbytes() if isinstance(store, OffloadedKVStore)
                                            else None))
                record["eta_s"] = (record["elapsed"] / (step + 1 - start)) * (cfg.train.steps - step - 1)
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                if tensorboard is not None:
                    tensorboard.log(record)
                memory = f"host {record['host_rss_gib']:.2f} GiB"
                if "pinned_host_gib" in record:
                    memory += f" ({record['pinned_host_gib']:.2f} pinned)"
                if "peak_gpu_gib" in record:
                    memory = f"GPU {record['peak_gpu_gib']:.2f} GiB, " + memory
                progress.update(bar, advance=1, loss=loss_value, tps=record["tokens_per_s"], memory=memory)
                if not console.is_terminal and (step + 1) % 10 == 0:
                    console.print(f"step {step + 1}: loss {loss_value:.4f}, {record['tokens_per_s']:,.0f} tok/s")
                last = step + 1 == cfg.train.steps
                if last or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
                    run.save(step + 1)
                if (stop.requested if ctx is None else distributed.any_rank(stop.requested)) and not last:
                    run.stop_on_signal(stop, step + 1)
    finally:
        stop.uninstall()
        if tensorboard is not None:
            tensorboard.close()
    if main_rank:
        plot_run(out)
    if cfg.train.export and ctx is not None:
        distributed.export_model(ctx, model, out, tokenizer=inputs.tokenizer)
    elif cfg.train.export:
        export_model(model, out, merge_lora=cfg.lora.merge_on_export, tokenizer=inputs.tokenizer)
    console.print(f"done: {cfg.train.steps} steps in {time.perf_counter() - started:.1f} s; "
                  f"final loss {loss_value:.4f}; "
                  f"{f'non-finite steps skipped: {skipped}; ' if skipped else ''}metrics, "
                  f"checkpoints{' and export' if cfg.train.export else ''} in {out}")
    return out


def _forward_backward(model, params, batches, device, cfg: Config, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's loss and the global gradient norm (not yet clipped); gradients land in ``.grad``."""
    if ctx is not None and ctx.data_parallel == 1:  # the same sequences on every rank, heads split
        loss = accumulate_gradients(model, params, batches, device, cfg)  # the engine reads the split off the model
        return loss, distributed.tensor_parallel_norm(params, ctx)
    if ctx is not None:  # sharded gradients, reduced once; loss and norm the same on every rank
        loss = distributed.accumulate_gradients(model, batches, ctx, cfg)
        split = ctx.tensor_parallel > 1
        norm = distributed.tensor_parallel_norm(params, ctx) if split else distributed.total_norm(params)
        return loss, norm
    loss = accumulate_gradients(model, params, batches, device, cfg)
    grads = [p.grad for p in params if p.grad is not None]
    return loss, torch.nn.utils.get_total_norm(grads)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:400] if text else ''}"


class _Run:
    """What the failure paths of one run need: its objects, and the newest step on disk."""

    def __init__(self, cfg, out, model, optimizer, scheduler, inputs, device, saved_step, ctx=None):
        self.cfg, self.out, self.model, self.optimizer, self.scheduler = cfg, out, model, optimizer, scheduler
        self.inputs, self.device, self.ctx = inputs, device, ctx
        self.saved_step: int | None = saved_step  # step of the newest checkpoint this run wrote or resumed

    def _newest_checkpoint(self) -> str:
        try:
            ckpt = find_checkpoint(self.out)
        except CheckpointError:
            return "the run has no checkpoint yet"
        return f"the newest checkpoint, {ckpt}, is intact"

    def save(self, step: int, data_state: dict | None = None) -> Path:
        """Write checkpoint ``step`` and rotate; a failed write stops the run (nothing on disk damaged).

        ``data_state``: the data position after step ``step`` (default: where the inputs stand now).
        """
        if data_state is None:
            data_state = self.inputs.state_dict()
        try:
            if self.ctx is None:
                ckpt = save_checkpoint(self.out, step, self.model, self.optimizer, self.scheduler,
                                       data_state=data_state)
            else:
                ckpt = distributed.save_checkpoint(self.ctx, self.out, step, self.model, self.optimizer,
                                                   self.scheduler, data_state=data_state)
        except OSError as e:
            raise RunStopped(
                f"could not write checkpoint step {step} in {self.out / 'checkpoints'}: {e}.\n"
                f"Nothing was damaged: no partial checkpoint was left and {self._newest_checkpoint()}. "
                "Free disk space or fix the folder's permissions, then continue with:\n"
                f"  {resume_command(self.out)}", EXIT_CHECKPOINT_WRITE) from None
        self.saved_step = step
        try:
            if self.ctx is None or self.ctx.is_main:
                rotate_checkpoints(self.out, self.cfg.train.keep_last)
        except OSError as e:  # the new checkpoint is complete; an old one stays for now
            Console(stderr=True).print(f"warning: could not delete an old checkpoint: {e}", highlight=False)
        return ckpt

    def stop_on_signal(self, stop: StopRequest, done: int, dropped: int | None = None, data_state: dict | None = None):
        ckpt = find_checkpoint(self.out) if self.saved_step == done else self.save(done, data_state)
        what = f"step {dropped} was in progress and is dropped; " if dropped is not None else ""
        by = stop.name or "a signal to another rank"  # under torchrun, every rank stops when one is signalled
        raise RunStopped(
            f"interrupted by {by} after step {done} of {self.cfg.train.steps} ({what}checkpoint {ckpt}).\n"
            f"Continue with:\n  {resume_command(self.out)}", EXIT_INTERRUPTED)

    def stop_out_of_memory(self, step: int, where: str, error: str, use, *, model_intact: bool = True,
                           data_state: dict | None = None):
        """Free what the step held, keep what is good, and say what used the memory."""
        self.optimizer.zero_grad(set_to_none=True)  # no optimizer step happened (or it failed)
        release_memory(self.model)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not model_intact:
            kept = ("The optimizer step itself ran out of memory, so the weights in memory may be partly updated: "
                    f"they are not saved; {self._newest_checkpoint()}.")
        elif self.saved_step == step:
            kept = f"The model and optimizer are as after step {step}; {self._newest_checkpoint()}."
        elif self.ctx is not None:  # a save needs every rank, and the others are inside the step's collectives
            kept = f"Step {step} is not saved (under torchrun one rank cannot save alone); {self._newest_checkpoint()}."
        else:
            try:
                kept = (f"The model and optimizer are as after step {step} and were saved to "
                        f"{self.save(step, data_state)}.")
            except Exception as e:  # noqa: BLE001 - still out of memory, or a CUDA error: report, keep the old one
                kept = f"Saving step {step} failed too ({str(e).splitlines()[0]}); {self._newest_checkpoint()}."
        t = self.cfg.train
        smaller = t.chunk_size // 2 // t.page_size * t.page_size
        change = f"train.chunk_size={smaller}" if smaller >= t.page_size else "train.layer_checkpointing=true"
        raise RunStopped(
            f"out of memory in {where} of step {step + 1}: {error}\n"
            f"Memory when it failed:\n{memory_report(use, self.cfg)}\n{kept}\n"
            f"Change a setting above and continue, e.g.:\n  {resume_command(self.out, change)}",
            EXIT_OUT_OF_MEMORY)

    def nonfinite(self, step: int, loss, grad_norm, batches) -> dict:
        """Locate the first non-finite value; stop (train.on_nonfinite=stop) or return what to log (skip)."""
        t = self.cfg.train
        site = None
        if self.ctx is not None:  # every rank gets here (global loss and norm); locating would need them in step
            parameter = "not located under torchrun (run one process from the last checkpoint to locate it)"
            self.optimizer.zero_grad(set_to_none=True)
            site, batches = "not located under torchrun", []
        else:
            parameter = first_nonfinite_grad(self.model)
            self.optimizer.zero_grad(set_to_none=True)
        try:
            for m, batch in enumerate(batches):  # the grad_accum batches in the order they ran
                doc_ids = batch.doc_ids.to(self.device) if self.cfg.data.document_mask else None
                site = locate_nonfinite(self.model, batch.input_ids.to(self.device), batch.labels.to(self.device),
                                        options=step_options(self.cfg), doc_ids=doc_ids)  # the step's options
                if site is not None:
                    if len(batches) > 1:
                        site = f"{site}, in batch {m + 1} of {len(batches)} (train.grad_accum)"
                    break
        except StepAbandoned:  # a signal during the diagnosis: report without it, then stop as asked
            site = "not located (interrupted)"
        where = (f"first non-finite value: {site}" if site is not None else
                 "the forward pass is finite in every chunk: the first non-finite value arose in the backward pass")
        text = (f"non-finite {'loss' if not bool(torch.isfinite(loss)) else 'gradient'} in step {step + 1} "
                f"(loss {float(loss)}, gradient norm {float(grad_norm)}); {where}; first parameter with a non-finite "
                f"gradient: {parameter or 'none'}")
        if t.on_nonfinite == "skip":
            Console(stderr=True).print(f"warning: {text}; step skipped (no update)", highlight=False, soft_wrap=True)
            return {"nonfinite_at": str(site) if site is not None else "backward pass", "nonfinite_grad": parameter}
        raise RunStopped(
            f"{text}.\nNo update was made and no checkpoint was written or changed; "
            f"{self._newest_checkpoint()}. Lower train.lr, or set train.on_nonfinite=skip, "
            f"then continue, e.g.:\n  {resume_command(self.out, f'train.lr={t.lr / 2:g}')}", EXIT_NONFINITE)


def accumulate_gradients(model, params, batches, device: torch.device, cfg: Config) -> torch.Tensor:
    """Gradients of the mean loss over every target token of ``batches`` (run one after another).

    chunked_backward adds the gradient of each batch's own mean loss. With n_m targets in
    batch m and T in all, the wanted gradient is sum_m (n_m / T) g_m: the running sum is kept
    as sum_{i<=m} (n_i / n_m) g_i (rescaled only when n_m changes) and scaled by n_last / T
    at the end, so equal batches cost no extra pass over the gradients until the last.
    """
    counts = [int((b.labels[:, 1:] != -100).sum()) for b in batches]  # the shifted targets
    batches, counts = [b for b, n in zip(batches, counts, strict=True) if n], [n for n in counts if n]
    if not batches:
        raise ValueError("no sequence of this step has a target token (every label is -100)")
    total = sum(counts)
    loss = torch.zeros((), dtype=torch.float32, device=device)
    options = step_options(cfg)
    for m, batch in enumerate(batches):
        if m and counts[m] != counts[m - 1]:
            _scale_gradients(params, counts[m - 1] / counts[m])
        doc_ids = batch.doc_ids.to(device) if cfg.data.document_mask else None
        loss += counts[m] / total * oomb.chunked_backward(
            model, batch.input_ids.to(device), batch.labels.to(device), doc_ids=doc_ids, options=options,
        )
    if counts[-1] != total:
        _scale_gradients(params, counts[-1] / total)
    return loss


def step_options(cfg: Config) -> StepOptions:
    """The engine's options of this run's steps, for chunked_backward and, after a non-finite step,
    locate_nonfinite: the diagnosis then runs the step's chunks, store and page selection."""
    t = cfg.train
    return StepOptions(chunk_size=t.chunk_size, page_size=t.page_size, selection=page_selection(cfg),
                       offload=t.offload, offload_gpu_bytes=offload_gpu_allowance(cfg),
                       cache_attention=t.cache_attention is True)  # "auto" not settled by a memory plan: off


def _record_resumed_config(out: Path, cfg: Config, step: int) -> Path | None:
    """Make <run>/config.json the config this resumed run uses, keeping the one it replaces.

    A later ``resume=<run>`` starts from config.json: without this it would go back to the
    settings of the first start and drop the ones given when resuming. Returns the kept file.
    """
    path = out / "config.json"
    new = config_to_dict(cfg)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = None
    if old is not None and {k: v for k, v in old.items() if k != "resume"} == {
            k: v for k, v in new.items() if k != "resume"}:
        return None
    kept = out / f"config.before-step-{step:08d}.json"
    n = 1
    while kept.exists():  # resumed at this step before: keep every earlier config
        kept, n = out / f"config.before-step-{step:08d}.{n}.json", n + 1
    if old is not None:
        write_text_atomic(kept, path.read_text())  # a copy first: config.json is never missing, even after a crash
    write_text_atomic(path, json.dumps(new, indent=2))
    return kept if old is not None else None


def _apply_config_lr(scheduler, lr: float) -> float | None:
    """After a resume: the schedule's peak rate becomes train.lr if the checkpoint's differs.

    A restored LambdaLR keeps the peak rates it was saved with, so without this a changed
    train.lr on resume would be silently ignored. Returns the replaced rate, or None.
    """
    saved = list(scheduler.base_lrs)
    if all(b == lr for b in saved):
        return None
    scheduler.base_lrs = [lr] * len(saved)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return saved[0]


def _scale_gradients(params, factor: float) -> None:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if grads:  # tensor parallel: split gradients are DTensors, which foreach kernels refuse beside plain ones
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], factor)


def _roll_back_metrics(path: Path, step: int) -> None:
    """Keep the metrics of steps <= ``step``; lines of steps that will run again move to a side file."""
    if not path.is_file():
        return
    keep, redo = [], []
    for line in path.read_text().splitlines():
        try:
            done = json.loads(line)["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a kill: kept aside
            done = False
        (keep if done else redo).append(line)
    if redo:
        with open(path.with_name("metrics.rolled-back.jsonl"), "a") as f:
            f.write("\n".join(redo) + "\n")
    write_text_atomic(path, "".join(line + "\n" for line in keep))
