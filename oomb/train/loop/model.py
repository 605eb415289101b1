"""The model a run trains: built from a folder or a preset, LoRA adapters, fused ops, parallel wrapping."""

from __future__ import annotations

from pathlib import Path

import torch

from oomb.surgery.adapters import ALL_LINEAR, UnknownLoraTargets, lora_config
from oomb.surgery.fused_ops import run_mode as fused_ops_run_mode
from oomb.surgery.fused_ops import use_fused_ops
from oomb.surgery.grad_accumulation import fused_grad_accumulation_applies, use_fused_grad_accumulation
from oomb.surgery.lora import use_fused_lora
from oomb.train.config.hub import model_folder
from oomb.train.config.presets import build_model
from oomb.train.config.rope import pin_dynamic_rope
from oomb.train.config.settings import Config, ConfigError
from oomb.train.data.inputs import model_config
from oomb.train.loop import distributed
from oomb.train.loop.quantize import bnb_config, finish_quantized, quantize_linears


def build(cfg: Config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The configured model (model.rope applied; its linear layers in NF4 with model.quantize=nf4; LoRA adapters
    when lora.r > 0), seeded by train.seed."""
    torch.manual_seed(cfg.train.seed)
    config = model_config(cfg)
    four_bit = cfg.model.quantize == "nf4"  # QLoRA: oomb.train.loop.quantize
    if cfg.model.path is not None:
        from transformers import AutoModelForCausalLM

        folder = model_folder(cfg.model.path, weights=True)  # a hub id's weights are fetched now, into the cache
        # A 4-bit load quantizes each weight as it is read, on the device (a bitsandbytes model cannot be moved).
        placed = dict(quantization_config=bnb_config(dtype), device_map={"": _indexed(device)}) if four_bit else {}
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=dtype, local_files_only=True,
            trust_remote_code=cfg.model.trust_remote_code, **placed,
        )
        model = model if four_bit else model.to(device)
    else:
        model = build_model(cfg.model.preset, dtype=dtype, device=device, config=config)
        if four_bit:
            quantize_linears(model, dtype)
    if four_bit:
        finish_quantized(model)
    try:
        pin_dynamic_rope(model, cfg.data.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.lora.r > 0:
        model = add_lora(model, cfg)
    return model


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` of the current device (a device map names one device); others as they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def base_model_name(cfg: Config) -> str | None:
    """The base model as an adapter export records it: model.path as an absolute path where it is a folder here
    (the adapter then loads from any working directory), else as given (a hub id); None for a random-init preset."""
    if cfg.model.path is None:
        return None
    path = Path(cfg.model.path).expanduser()
    return str(path.resolve()) if path.is_dir() else cfg.model.path


def lora_targets(cfg: Config) -> list[str] | str:
    """lora.targets as peft takes them: a list of module names, or "all-linear"."""
    if cfg.lora.targets.strip().lower() == ALL_LINEAR:
        return ALL_LINEAR
    return [t.strip() for t in cfg.lora.targets.split(",") if t.strip()]


def lora_target_names(cfg: Config) -> tuple[str, ...]:
    """lora.targets as the memory plan takes them: the module names, or ("all-linear",) (oomb.surgery.adapters)."""
    targets = lora_targets(cfg)
    return (ALL_LINEAR,) if targets == ALL_LINEAR else tuple(targets)


def add_lora(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """Wrap with peft LoRA adapters: only the adapters train (no dropout: chunks are recomputed); all-linear covers
    fused experts' weights too (oomb.surgery.adapters)."""
    try:
        import peft
    except ImportError as e:
        raise ConfigError("lora.r > 0 needs the peft package: pip install peft") from e
    try:
        config = lora_config(model, cfg.lora.r, cfg.lora.alpha, lora_targets(cfg))
    except UnknownLoraTargets as e:
        raise ConfigError(str(e)) from None
    return peft.get_peft_model(model, config)


def prepare_for_training(model: torch.nn.Module, cfg: Config, ctx, console) -> torch.nn.Module:
    """Training mode, layer checkpointing, fused ops, then the tensor/data parallel split (in that order:
    each later one wraps the Parameters the earlier ones placed, and the optimizer is built after)."""
    model.train()
    if cfg.train.layer_checkpointing:  # transformers' own; exact inside oomb's chunks (tested)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused = use_fused_ops(model, fused_ops_run_mode(cfg.train.fused_ops, cfg.train.tensor_parallel))
    if fused:
        modules = [name for name in fused if name != "rope"]
        console.print(f"fused ops: liger RMSNorm / gated MLP in {len(modules)} modules"
                      + (", liger RoPE" if "rope" in fused else ""))
    if fuses_grad_accumulation(model, cfg, ctx):
        linears = use_fused_grad_accumulation(model)
        if linears:
            console.print(f"weight gradients added into .grad by their matmuls in {len(linears)} linear layers")
    if cfg.lora.r > 0 and cfg.lora.fused:  # peft's layers, the adapter added in the frozen matmul (oomb.surgery.lora)
        adapted = use_fused_lora(model, into_grad=fuses_grad_accumulation(model, cfg, ctx))
        console.print(f"LoRA adapters fused into their base layers' matmuls in {len(adapted)} layers")
    if ctx.tensor_parallel > 1:
        model = distributed.split_model(model, ctx)
    if ctx.data_parallel > 1:  # over the groups of tensor parallel ranks, if any
        model = distributed.shard_model(model, ctx.mesh["dp"] if ctx.mesh is not None else None)
    return model


def fuses_grad_accumulation(model: torch.nn.Module, cfg: Config, ctx) -> bool:
    """Whether the run adds weight gradients inside their matmuls: train.fused_grad_accumulation on, where
    ``fused_grad_accumulation_applies``."""
    return cfg.train.fused_grad_accumulation and fused_grad_accumulation_applies(
        model, cfg.train.fused_ops, ctx.world_size)


def describe_size(model: torch.nn.Module, cfg: Config) -> str:
    """The startup line's parameter count: all of them, or (LoRA, a frozen embedding) how many of them train."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    if trained == total:
        return f"{trained / 1e6:.2f}M params"
    lora = f", LoRA r={cfg.lora.r}" if cfg.lora.r > 0 else ""
    return f"{trained / 1e6:.2f}M of {total / 1e6:.2f}M params trained{lora}"
