"""The training loop behind `oomb train`: build, check, train, log.

    check config, data, optimizer  ->  build model  ->  for each step:
        chunked_backward x grad_accum -> clip -> optimizer step -> metrics.jsonl (+ TensorBoard), progress
    -> checkpoint, export (with the tokenizer), training.png
"""

from __future__ import annotations

import datetime
import inspect
import json
import math
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import oomb
from oomb.train.checkpoint import (
    CheckpointError,
    checkpoint_state,
    export_model,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    write_text_atomic,
)
from oomb.train.config import Config, ConfigError, config_to_dict, load_config
from oomb.train.inputs import build_inputs, model_config
from oomb.train.memory import check_memory
from oomb.train.monitor import TensorBoardLog, memory_fields, plot_run
from oomb.train.optim import build_optimizer, check_optimizer
from oomb.train.presets import build_model, preset_names

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"train.device={name!r} is not a device name (use auto, cpu, cuda or cuda:N)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device asks for CUDA but no CUDA device is visible; use train.device=cpu")
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
                        ("train.page_size", t.page_size), ("data.seq_len", d.seq_len)):
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if t.chunk_size % t.page_size:
        raise ConfigError(f"train.chunk_size={t.chunk_size} must be a multiple of train.page_size={t.page_size}")
    if t.save_every < 0:
        raise ConfigError(f"train.save_every must be >= 0, got {t.save_every}")
    if t.lr <= 0 or t.warmup_steps < 0 or t.grad_clip < 0 or not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("train.lr must be > 0, train.warmup_steps and train.grad_clip >= 0, "
                          "train.min_lr_ratio in [0, 1]")
    if cfg.model.path is not None and not Path(cfg.model.path).is_dir():
        raise ConfigError(f"model.path={cfg.model.path!r} is not a directory")
    if cfg.model.path is None and cfg.model.preset not in preset_names():
        raise ConfigError(f"unknown model preset {cfg.model.preset!r}; built-in presets: {', '.join(preset_names())}")


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
    try:
        return find_checkpoint(Path(cfg.resume))
    except CheckpointError as e:
        raise ConfigError(f"resume={cfg.resume!r}: {e}") from e


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
            cfg.model.path, dtype=dtype, local_files_only=True, trust_remote_code=False
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
    """Run the configured training; returns the output folder (metrics.jsonl, config.json)."""
    console = console or Console()
    check_config(cfg)
    device = resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    check_optimizer(cfg.train.optimizer, device)
    inputs = build_inputs(cfg, model_config(cfg))  # data, tokenizer, positions: checked before the model
    if cfg.data.document_mask:
        check_document_mask_support()
    plan = check_memory(cfg, device, dtype)  # the plan must fit before the model or a checkpoint is touched
    model = build(cfg, device, dtype)
    out = prepare_out_dir(cfg)
    model.train()
    if cfg.train.layer_checkpointing:  # transformers' own; exact inside oomb's chunks (tested)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg.train.optimizer, params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    start = 0
    if cfg.resume is not None:
        ckpt = _resume_checkpoint(cfg)
        try:
            start = load_checkpoint(ckpt, model, optimizer, scheduler)
            inputs.load_state_dict(checkpoint_state(ckpt).get("data", {}))
        except CheckpointError as e:
            raise ConfigError(f"cannot resume from {ckpt}: {e}") from e
        _roll_back_metrics(out / "metrics.jsonl", start)
        console.print(f"resuming {out} after step {start} from {ckpt}")
    else:
        cfg.out_dir = str(out)
        (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    n_params = sum(p.numel() for p in params)
    console.print(
        f"[bold]oomb train[/]: {cfg.model.path or cfg.model.preset} ({n_params / 1e6:.2f}M params, {dtype}) on "
        f"{device}; {cfg.train.steps} steps x {cfg.train.grad_accum * cfg.train.batch_size} x {cfg.data.seq_len} "
        f"tokens ({cfg.data.task}), {cfg.train.optimizer}, "
        f"chunk {cfg.train.chunk_size}, page {cfg.train.page_size}; writing {out}/metrics.jsonl"
    )
    if plan is not None:
        console.print(plan.summary() + " (oomb plan prints the breakdown)")
    tokens_per_step = cfg.train.grad_accum * cfg.train.batch_size * cfg.data.seq_len
    columns = [
        TextColumn("step {task.completed}/{task.total}"), BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TextColumn("{task.fields[memory]}"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
    ]
    tensorboard = (TensorBoardLog(out, resumed_after=start if cfg.resume is not None else None)
                   if cfg.train.tensorboard else None)
    started = time.perf_counter()
    with open(out / "metrics.jsonl", "a") as metrics, Progress(*columns, console=console) as progress:
        bar = progress.add_task("train", total=cfg.train.steps, completed=start, loss=float("nan"), tps=0.0,
                                memory="")
        loss_value = float("nan")
        for step in range(start, cfg.train.steps):
            batches = inputs.batches(step)
            t0 = time.perf_counter()
            loss = accumulate_gradients(model, params, batches, device, cfg)
            grad_norm = (torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
                         if cfg.train.grad_clip > 0 else None)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = float(loss)  # host sync: the step is done
            seconds = time.perf_counter() - t0
            record = {
                "step": step + 1,
                "loss": loss_value,
                "tokens": tokens_per_step * (step + 1),
                "seconds": seconds,
                "elapsed": time.perf_counter() - started,
                "tokens_per_s": tokens_per_step / seconds,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
            }
            record.update(memory_fields(device))
            record["eta_s"] = (record["elapsed"] / (step + 1 - start)) * (cfg.train.steps - step - 1)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if tensorboard is not None:
                tensorboard.log(record)
            memory = f"host {record['host_rss_gib']:.2f} GiB"
            if "peak_gpu_gib" in record:
                memory = f"GPU {record['peak_gpu_gib']:.2f} GiB, " + memory
            progress.update(bar, advance=1, loss=loss_value, tps=record["tokens_per_s"], memory=memory)
            if not console.is_terminal and (step + 1) % 10 == 0:
                console.print(f"step {step + 1}: loss {loss_value:.4f}, {record['tokens_per_s']:,.0f} tok/s")
            last = step + 1 == cfg.train.steps
            if last or (cfg.train.save_every and (step + 1) % cfg.train.save_every == 0):
                save_checkpoint(out, step + 1, model, optimizer, scheduler, data_state=inputs.state_dict())
    if tensorboard is not None:
        tensorboard.close()
    plot_run(out)
    if cfg.train.export:
        export_model(model, out, merge_lora=cfg.lora.merge_on_export, tokenizer=inputs.tokenizer)
    console.print(f"done: {cfg.train.steps} steps in {time.perf_counter() - started:.1f} s; "
                  f"final loss {loss_value:.4f}; metrics, checkpoints{' and export' if cfg.train.export else ''} "
                  f"in {out}")
    return out


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
    for m, batch in enumerate(batches):
        if m and counts[m] != counts[m - 1]:
            _scale_gradients(params, counts[m - 1] / counts[m])
        extra = {"doc_ids": batch.doc_ids.to(device)} if cfg.data.document_mask else {}
        loss += counts[m] / total * oomb.chunked_backward(
            model, batch.input_ids.to(device), batch.labels.to(device),
            chunk_size=cfg.train.chunk_size, page_size=cfg.train.page_size, **extra,
        )
    if counts[-1] != total:
        _scale_gradients(params, counts[-1] / total)
    return loss


def _scale_gradients(params, factor: float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def _roll_back_metrics(path: Path, step: int) -> None:
    """Keep the metrics of steps <= ``step``; lines of steps that will run again move to a side file."""
    if not path.is_file():
        return
    keep, redo = [], []
    for line in path.read_text().splitlines():
        (keep if json.loads(line)["step"] <= step else redo).append(line)
    if redo:
        with open(path.with_name("metrics.rolled-back.jsonl"), "a") as f:
            f.write("\n".join(redo) + "\n")
    write_text_atomic(path, "".join(line + "\n" for line in keep))
