"""The training loop behind `oomb train`: check, build, train, finish.

    train(cfg)
      check config, paths, data and memory            (oomb.train.config.checks, rundir, memory)
      open the run folder (locked), build the model, the optimizer, resume   (model, checkpoint)
      for each step: chunked_backward x grad_accum -> finite? -> clip -> optimizer step -> finite?
                     -> metrics.jsonl (+ TensorBoard), progress -> checkpoint
      export (with the tokenizer), training.png

Failures (signals, out of memory, non-finite numbers, a file that cannot be written) stop the
run through oomb.train.loop.faults.RunStopped; docs/failures.md lists them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from oomb.engine import store_for_model
from oomb.kernels import get_backend
from oomb.offload import OffloadedKVStore
from oomb.train.config.checks import check_config, check_model, resolve_dtype
from oomb.train.config.hub import make_paths_absolute
from oomb.train.config.settings import Config, ConfigError
from oomb.train.config.step import offload_selection_note
from oomb.train.data.identity import unwatch, watch
from oomb.train.data.inputs import build_inputs, model_config, pin_run_inputs, position_notes
from oomb.train.eval.retrieval_report import final_retrieval
from oomb.train.eval.validation import build_validation, validate_if_due
from oomb.train.loop import distributed
from oomb.train.loop.chunk_progress import ChunkProgress
from oomb.train.loop.distributed import DistributedContext
from oomb.train.loop.faults import (
    RunStopped,
    StepAbandoned,
    StopRequest,
    is_out_of_memory,
    measure_memory,
)
from oomb.train.loop.gradients import accumulate_gradients, clip_gradients, gradient_norm
from oomb.train.loop.host_memory import cap_gpu_allocator
from oomb.train.loop.memory import check_memory, describe_offload, describe_step_choice
from oomb.train.loop.memory_record import MemoryRecord, check_memory_snapshot
from oomb.train.loop.model import build, describe_size, prepare_for_training
from oomb.train.loop.monitor import memory_fields, plot_run
from oomb.train.loop.optim import MasterWeights, build_optimizer, check_optimizer, wants_master_weights
from oomb.train.loop.quantize import check_quantize_runs
from oomb.train.loop.reporting import Reports, first_line
from oomb.train.loop.run import Run
from oomb.train.loop.schedule import build_scheduler, continue_schedule, keep_started_steps, resolve_schedule
from oomb.train.runfolder.checkpoint import CheckpointError, checkpoint_state, load_checkpoint, rng_state, set_rng_state
from oomb.train.runfolder.inputs_record import InputsCheck, check_inputs
from oomb.train.runfolder.rundir import (
    CHUNKS,
    METRICS,
    MetricsLog,
    check_paths,
    crash_note,
    interrupted,
    nothing_trained,
    open_run_folder,
    prepare_out_dir,
    record_resumed_config,
    roll_back_metrics,
    run_dir_of,
)


def train(cfg: Config, console: Console | None = None, *,
          on_error: Callable[[Exception], None] | None = None) -> Path:
    """Run the configured training; returns the output folder (metrics.jsonl, config.json).

    Raises ConfigError before any work for bad settings or paths, and RunStopped for a
    failure it handled during the run (the message says what is on disk and how to resume).
    Under torchrun (WORLD_SIZE > 1) the ranks train data parallel, or tensor parallel with
    train.tensor_parallel > 1: oomb.train.loop.distributed.

    ``on_error`` gets such an error before the ranks' process group is left (then it is raised): where one rank
    fails alone, the others fail as soon as the group is gone, and torchrun stops every rank; a message printed
    after that may never be written (`oomb train` prints it here).
    """
    prefer_expandable_segments()  # before check_config, which may start CUDA (the attention kernels' check)
    check_config(cfg)
    ctx = distributed.setup(cfg)  # a single process: one rank
    try:
        return _train(cfg, console, ctx)
    except (ConfigError, RunStopped) as e:
        if on_error is not None:
            on_error(e)
        raise
    finally:
        unwatch()  # the run's data files (oomb.train.data.identity), watched from its start
        distributed.teardown(ctx)


ALLOC_CONF = "PYTORCH_ALLOC_CONF"  # PyTorch's caching allocator settings
ALLOC_CONF_NAMES = (ALLOC_CONF, "PYTORCH_CUDA_ALLOC_CONF")  # the older name still read


def allocator_setting() -> str | None:
    """The CUDA caching allocator's settings this process has in its environment (either name), or None."""
    return next((os.environ[name] for name in ALLOC_CONF_NAMES if name in os.environ), None)


def prefer_expandable_segments() -> None:
    """Let the CUDA caching allocator grow its segments instead of keeping freed blocks it cannot merge, unless the
    user set the allocator up (either variable). A long-context step allocates chunk-sized blocks of many sizes:
    Gemma-3-12B at 64K ran out of memory on an H100 with 8.9 GiB held free in fragments and 69.3 GiB allocated,
    under the memory plan's 74.7 GiB (benchmarks/results/core-gemma-3-12b-vs-transformers-64k.json). Unsloth sets
    the same. Set in the environment (read where CUDA starts later, and by child processes) and in the running
    allocator: where CUDA already started in this process (a check that asked for the GPU's capability), the
    environment alone would come too late."""
    if allocator_setting() is not None:
        return
    os.environ[ALLOC_CONF] = "expandable_segments:True"
    if torch.cuda.is_available():
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch.cuda.memory's is deprecated
        (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")


def _train(cfg: Config, console: Console | None, ctx: DistributedContext) -> Path:
    main_rank = ctx.is_main  # the rank that prints and writes the run's files
    console = (console or Console()) if main_rank else Console(quiet=True)
    resume_from, recorded = _check_before_work(cfg, ctx)
    device = ctx.device
    dtype = resolve_dtype(cfg.model.dtype, device)
    check_optimizer(cfg.train.optimizer, device)
    check_quantize_runs(cfg, device)  # model.quantize=nf4: bitsandbytes runs 4-bit layers on this device
    check_memory_snapshot(cfg, device)  # train.memory_snapshot: a CUDA run
    try:  # nothing written yet: Ctrl-C here leaves nothing to clean up
        inputs = _build_inputs(cfg, ctx, console)
        # After the data (train.epochs counts its sequences), before config.json is written: it holds the numbers
        # a resume keeps.
        schedule = resolve_schedule(cfg, inputs, ctx)
        validation = build_validation(cfg, inputs, ctx)  # the held-out batches, before the model is built
        plan, step_choice = _check_memory(cfg, device, dtype, console, ctx)
    except KeyboardInterrupt:
        raise interrupted(cfg, None, False, main_rank, None) from None
    out, created = distributed.prepare_out_dir(ctx, cfg, prepare_out_dir)
    if cfg.resume is None:
        cfg.out_dir = str(out)
    lock = open_run_folder(cfg, out, created, main_rank, recorded.record if recorded.write else None)
    reports = Reports(cfg, out, console, enabled=main_rank)
    failed, run, record = True, None, None
    try:
        _start_wandb(reports, ctx)
        record = MemoryRecord(cfg.train.memory_snapshot if main_rank else 0, out, device,
                              {item.name: item.gpu_bytes for item in plan.items} if plan is not None else None)
        record.start()  # before the model is built: the record holds every allocation of the run
        run = _start_run(cfg, out, inputs, device, dtype, ctx, resume_from, console, f"{schedule}, {step_choice}")
        run.validation, run.memory_record = validation, record
        for note in (*recorded.notes, *inputs.notes, *(validation.notes if validation else ())):  # e.g. chat samples
            console.print(note, highlight=False)
        if plan is not None:
            console.print(plan.summary() + " (oomb plan prints the breakdown)")
        if (advice := offload_selection_note(cfg)) is not None:
            console.print(f"note: {advice}")
        started = time.perf_counter()
        _train_steps(run, console, main_rank, reports)
        _finish(run, console, main_rank, started)
        failed = False
    except KeyboardInterrupt:  # Ctrl-C outside the loop, which catches signals itself (model build, resume, export)
        raise interrupted(cfg, out, created, main_rank, run) from None
    except ConfigError as e:  # refused once the folder was open (W&B, the model): a new run leaves nothing behind
        raise ConfigError(f"{e}{nothing_trained(cfg, out, created, main_rank)}") from None
    except Exception as e:  # an error oomb did not expect: its traceback, then what is on disk and how to go on
        if not isinstance(e, RunStopped) and main_rank:
            e.add_note(crash_note(out))
        raise
    finally:
        if record is not None:
            record.discard()  # a run that stopped before step N: the record ends with it, unwritten
        reports.close(failed)
        if lock is not None:
            lock.release()
    return out


def _start_wandb(reports: Reports, ctx: DistributedContext) -> None:
    """The W&B run starts before the model is built; where it cannot, nothing was trained and a new run leaves
    nothing behind (_train). Under torchrun the first rank starts it and every rank stops with it."""
    error = None
    try:
        reports.start_wandb()
    except ConfigError as e:
        error = e
    if distributed.any_rank(ctx, error is not None) and error is None:
        raise ConfigError("the W&B run could not start on the first rank (it says why)")
    if error is not None:
        raise error


def _check_before_work(cfg: Config, ctx: DistributedContext) -> tuple[Path | None, InputsCheck]:
    """Model folder, run folder, the checkpoint to resume from, and the run's data files and base model as they
    are (a resumed run's compared with its record); returns that checkpoint and what they are. The data files
    are watched from now on: one that changes stops the run (oomb.train.data.identity)."""
    make_paths_absolute(cfg)  # config.json records them so: a resume from another folder reads the same files
    check_model(cfg)  # its folder, and its architecture: a model oomb cannot train exactly is refused, naming why
    keep_started_steps(cfg)  # resumed with train.epochs: the steps the run counted, for check_paths
    resume_from = check_paths(cfg)
    if resume_from is None:  # a new run's hub commits and RoPE factor as they resolve now; config.json records them
        pin_run_inputs(cfg)
    else:
        try:
            distributed.check_checkpoint_format(resume_from, ctx)
        except CheckpointError as e:
            raise ConfigError(f"cannot resume: {e}") from e
    run = None if cfg.resume is None else run_dir_of(resume_from) if resume_from is not None else Path(cfg.resume)
    recorded = check_inputs(cfg, run, trained=resume_from is not None)
    watch(recorded.files)
    return resume_from, recorded


def _build_inputs(cfg: Config, ctx: DistributedContext, console: Console):
    """The run's data, checked (every source read once) before the model is built."""
    config = model_config(cfg)  # with model.rope applied
    for line in position_notes(cfg, config):
        console.print(line, highlight=False, soft_wrap=True)
    inputs = distributed.build_rank_inputs(cfg, config, ctx, build_inputs)  # each rank its own rows
    if ctx.tensor_parallel > 1:
        distributed.check_tensor_parallel(ctx, config)
    return inputs


def _check_memory(cfg: Config, device: torch.device, dtype: torch.dtype, console: Console, ctx: DistributedContext):
    """The plan must fit before the model or a checkpoint is touched; it settles the `auto` settings.

    Returns the plan (None without train.memory_check) and what the startup line says of the chunk and
    the attention cache.
    """
    master_setting = cfg.train.master_weights
    auto = frozenset(k for k in ("chunk_size", "cache_attention", "recompute") if getattr(cfg.train, k) == "auto")
    plan = check_memory(cfg, device, dtype, torchrun=ctx.torchrun)
    cap_gpu_allocator(cfg, device)  # train.gpu_memory, as planned
    if master_setting != cfg.train.master_weights:  # auto, and only the run without fp32 copies fits
        console.print(
            "note: train.master_weights=auto: fp32 master weights do not fit beside this run, so the optimizer "
            f"steps the {dtype} weights directly (updates below half a {dtype} step are lost); "
            "train.optimizer=adamw8bit or lora.r=16 make room for them")
    return plan, describe_step_choice(cfg, auto, planned=plan is not None) + describe_offload(cfg, plan)


def _kernels(cfg: Config, device: torch.device) -> str:
    """The attention kernels the steps run, e.g. "attention kernels fa4 (auto)"."""
    name = get_backend(cfg.train.attention, device.type).name
    return f"attention kernels {name}" + (" (auto)" if cfg.train.attention == "auto" else "")


def _start_run(cfg, out, inputs, device, dtype, ctx, resume_from, console, choices: str) -> Run:
    """Model, optimizer and schedule, restored from the checkpoint when resuming; the startup line
    (``choices``: the learning rate, warmup, chunk and attention cache, and what chose them)."""
    model = prepare_for_training(build(cfg, device, dtype), cfg, ctx, console)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = distributed.param_groups(params) if ctx.tensor_parallel > 1 else params
    optimizer = build_optimizer(cfg.train.optimizer, groups, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                master_weights=wants_master_weights(cfg.train.master_weights, torchrun=ctx.torchrun))
    scheduler = build_scheduler(cfg, optimizer)  # transformers.get_scheduler's train.lr_scheduler
    run = Run(cfg, out, model, optimizer, scheduler, inputs, device, saved_step=None, ctx=ctx)
    if cfg.resume is not None:
        _resume(run, resume_from, dtype, console)
    masters = isinstance(optimizer, MasterWeights)
    ranks = ctx.data_parallel  # each step trains every data parallel rank's sequences
    console.print(  # one line in a log too (soft_wrap: no line breaks of rich's), so it can be found with grep
        f"[bold]oomb train[/]: {cfg.model.path or cfg.model.preset} ({describe_size(model, cfg)}, {dtype}"
        f"{', base in NF4' if cfg.model.quantize == 'nf4' else ''}) on {device}"
        f"{f' x {ctx.world_size} ranks' if ctx.torchrun else ''}; {cfg.train.steps} steps x "
        f"{cfg.train.grad_accum * cfg.train.batch_size * ranks} x {cfg.data.seq_len} "
        f"tokens ({cfg.data.task}), {cfg.train.optimizer} "
        f"{'on fp32 master weights' if masters else 'without master weights'}, "
        f"{choices}, page {cfg.train.page_size}, {_kernels(cfg, device)}; writing {out}/{METRICS}", soft_wrap=True)
    return run


def _resume(run: Run, ckpt: Path | None, dtype: torch.dtype, console: Console) -> None:
    """Load the checkpoint into the run; the run folder's metrics and config follow it. Without a checkpoint (the
    run stopped before its first one) nothing is loaded: the run starts again from step 1."""
    cfg, out, main_rank = run.cfg, run.out, run.ctx.is_main
    try:
        if ckpt is None:
            start = 0
        elif not run.ctx.torchrun:  # one process: a plain checkpoint, verified by check_paths
            start = load_checkpoint(ckpt, run.model, run.optimizer, run.scheduler, verify=False)
        else:
            start = distributed.load_checkpoint(run.ctx, ckpt, run.model, run.optimizer, run.scheduler)
        if ckpt is not None:
            run.inputs.load_state_dict(checkpoint_state(ckpt).get("data", {}))
    except CheckpointError as e:
        raise ConfigError(f"cannot resume from {ckpt}: {e}") from e
    run.start, run.saved_step = start, (start if ckpt is not None else None)
    if main_rank:
        try:
            roll_back_metrics(out, start)
            kept = record_resumed_config(out, cfg, start)
        except OSError as e:
            run.write_failed(f"the metrics and config of {out}", start, e)
        if kept is not None:
            console.print(f"note: the resumed run's settings differ from {out / 'config.json'}: it now holds "
                          f"them (the previous one is kept as {kept.name}), so a later resume continues them")
    if ckpt is None:
        console.print(f"resuming {out}, which stopped before its first checkpoint: it starts again from step 1")
        return
    console.print(f"resuming {out} after step {start} from {ckpt}")
    saved_lr = continue_schedule(run.scheduler, cfg.train.lr)  # this run's schedule and peak from step `start`
    if saved_lr is not None:
        console.print(f"note: train.lr={cfg.train.lr:g} replaces the checkpoint's {saved_lr:g}: the schedule "
                      f"continues from step {start} with the new peak rate")
    masters = isinstance(run.optimizer, MasterWeights)
    if checkpoint_state(ckpt).get("master_weights", False) != masters:
        console.print(f"note: {ckpt} was written without fp32 master weights: they start from its "
                      f"{dtype} weights" if masters else
                      f"note: {ckpt} holds fp32 master weights, which this run does not use "
                      f"(train.master_weights={str(cfg.train.master_weights).lower()}): it steps the {dtype} "
                      "weights saved beside them (the masters rounded)")


def _train_steps(run: Run, console: Console, main_rank: bool, reports: Reports) -> None:
    """The loop: one optimizer step after another, each logged, saved when due, stopped on request."""
    cfg = run.cfg
    columns = [
        TextColumn("step {task.completed}/{task.total}"), BarColumn(),
        TextColumn("loss {task.fields[loss]}{task.fields[val]}"), TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("{task.fields[memory]}"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
        TextColumn("{task.fields[chunk]}"),  # where a long step is (oomb.train.loop.chunk_progress)
    ]
    metrics = MetricsLog(run.out / METRICS if main_rank else None)
    reports.start_tensorboard(resumed_after=run.start if cfg.resume is not None else None)
    stop = StopRequest().install(run.model, at_chunks=not run.ctx.torchrun)  # torchrun: at step ends, ranks agreed
    chunks = ChunkProgress(run.out / CHUNKS if cfg.train.log_chunks and main_rank else None, run.device)
    run.started = time.perf_counter()
    try:
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("train", total=cfg.train.steps, completed=run.start, loss="-", tps="-",
                                    memory="", val="", chunk="")  # "-" until a step has run here
            chunks.show = lambda text: progress.update(bar, chunk=text)
            for step in range(run.start, cfg.train.steps):
                record = _train_step(run, step, stop, chunks)
                if chunks.failed:
                    console.print(f"warning: {chunks.failed}; the chunk log stops, the run goes on", highlight=False)
                    chunks.failed = None
                validate_if_due(run, step + 1, record)  # val_loss into the record when due
                val = f", val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
                try:
                    metrics.append(record)
                except OSError as e:
                    run.write_failed(f"{run.out / METRICS} (step {step + 1})", step + 1, e)
                reports.log(record)  # TensorBoard, W&B: train.report_to
                progress.update(bar, advance=1, loss=f"{run.loss_value:.4f}", tps=f"{record['tokens_per_s']:,.0f}",
                                memory=_memory_text(record), chunk="", **({"val": val} if val else {}))
                if not console.is_terminal and ((step + 1) % 10 == 0 or val):
                    console.print(f"step {step + 1}: loss {run.loss_value:.4f}{val}, "
                                  f"{record['tokens_per_s']:,.0f} tok/s")
                last = step + 1 == cfg.train.steps
                if (recorded := run.memory_record.after_step(step + 1, last)) is not None:
                    console.print(recorded, highlight=False)
                if last or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
                    run.checkpoint(step + 1)  # the data files checked first: one changed stops the run
                if distributed.any_rank(run.ctx, stop.requested) and not last:
                    run.stop_on_signal(stop, step + 1)
    finally:
        stop.uninstall()
        metrics.close()
        chunks.close()


def _train_step(run: Run, step: int, stop: StopRequest, chunks: ChunkProgress) -> dict:
    """One optimizer step (or a skipped one); returns its metrics record. Failures stop the run."""
    cfg, inputs, optimizer = run.cfg, run.inputs, run.optimizer
    data_before = inputs.state_dict()  # a dropped step's sequences are drawn again after a resume
    batches = run.read_batches(step, data_before)
    loss_tokens = sum(int((b.labels[:, 1:] != -100).sum()) for b in batches)  # the shifted targets
    loss_tokens = distributed.sum_over_data_ranks(run.ctx, loss_tokens)  # every rank here, before the collectives
    t0 = time.perf_counter()
    rng_before = rng_state()
    abandoned, out_of_memory = False, None
    try:
        chunks.start(step + 1, len(batches))
        loss, grad_norm = _forward_backward(run, batches, chunks)
    except StepAbandoned:
        abandoned = True
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        out_of_memory = (first_line(e), measure_memory(run.model, optimizer))  # before anything is freed
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
        run.skipped += 1
    else:
        _optimizer_step(run, step, grad_norm)
    lr = run.scheduler.get_last_lr()[0]  # the rate this step used (transformers' Trainer logs it so)
    run.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    run.loss_value = float(loss)  # host sync: the step is done
    seconds = time.perf_counter() - t0
    tokens_per_step = cfg.train.grad_accum * cfg.train.batch_size * cfg.data.seq_len * run.ctx.data_parallel
    record = {
        "step": step + 1,
        "loss": run.loss_value if nonfinite is None else None,
        "tokens": tokens_per_step * (step + 1),
        "loss_tokens": loss_tokens,
        "seconds": seconds,
        "elapsed": time.perf_counter() - run.started,
        "tokens_per_s": tokens_per_step / seconds,
        "lr": lr,
        "grad_norm": float(grad_norm) if nonfinite is None else None,
    }
    if nonfinite is not None:
        record.update(skipped="non-finite", skipped_steps=run.skipped, **nonfinite)
    store = store_for_model(run.model)
    record.update(memory_fields(run.device, store.host_nbytes() if isinstance(store, OffloadedKVStore) else None))
    record["eta_s"] = (record["elapsed"] / (step + 1 - run.start)) * (cfg.train.steps - step - 1)
    return record


def _optimizer_step(run: Run, step: int, grad_norm: torch.Tensor) -> None:
    """Clip, step, and check that the update left every weight finite."""
    clip = run.cfg.train.grad_clip
    if clip > 0:
        clip_gradients(run.params, clip, grad_norm)
    out_of_memory = None
    try:
        run.optimizer.step()
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        out_of_memory = (first_line(e), measure_memory(run.model, run.optimizer))
    if out_of_memory is not None:
        run.stop_out_of_memory(step, "the optimizer step", *out_of_memory, model_intact=False)
    run.check_update(step)  # before anything is saved


def _finish(run: Run, console: Console, main_rank: bool, started: float) -> None:
    """The plot, the export, and the last line."""
    cfg, out = run.cfg, run.out
    if main_rank:
        try:
            plot_run(out)
        except Exception as e:  # noqa: BLE001 - a full disk, a matplotlib backend: the run's results stand
            console.print(f"warning: could not draw {out / 'training.png'}: {first_line(e)}", highlight=False)
    if cfg.train.export:
        run.export(run.inputs.tokenizer)
    ran = cfg.train.steps - run.start
    steps = (f"{cfg.train.steps} steps" if run.start == 0 else
             f"steps {run.start + 1}-{cfg.train.steps} of {cfg.train.steps} (resumed after step {run.start})"
             if ran else f"all {cfg.train.steps} steps were done before (resumed to finish)")
    loss = f"final loss {run.loss_value:.4f}; " if ran else ""
    if run.validation is not None and run.validation.last is not None:
        loss += f"validation loss {run.validation.last[1]:.4f} after step {run.validation.last[0]}; "
    console.print(f"done: {steps} in {time.perf_counter() - started:.1f} s; {loss}"
                  f"{f'non-finite steps skipped: {run.skipped}; ' if run.skipped else ''}metrics, "
                  f"checkpoints{' and export' if cfg.train.export else ''} in {out}")
    if not run.ctx.torchrun and (retrieval := final_retrieval(cfg, run.model, out, console)):  # one process
        console.print(retrieval, highlight=False)  # passkey/needle runs: held-out retrieval, the last line


def _memory_text(record: dict) -> str:
    memory = f"host {record['host_rss_gib']:.2f} GiB"
    if "pinned_host_gib" in record:
        memory += f" ({record['pinned_host_gib']:.2f} pinned)"
    if "peak_gpu_gib" in record:
        memory = f"GPU {record['peak_gpu_gib']:.2f} GiB, " + memory
    return memory


def _forward_backward(run: Run, batches, on_chunk=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's loss and the global gradient norm (not yet clipped); gradients land in ``.grad``."""
    loss = accumulate_gradients(run.model, batches, run.ctx, run.cfg, on_chunk)
    return loss, gradient_norm(run.params, run.ctx)


