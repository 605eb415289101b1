"""The model a run trains: built from a folder or a preset, LoRA adapters, fused ops, parallel wrapping."""

from __future__ import annotations

import torch

from oomb.engine.fused_ops import use_fused_ops
from oomb.train import distributed
from oomb.train.config import Config, ConfigError
from oomb.train.presets import build_model


def build(cfg: Config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The configured model (with LoRA adapters when lora.r > 0), seeded by train.seed."""
    torch.manual_seed(cfg.train.seed)
    if cfg.model.path is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            cfg.model.path, dtype=dtype, local_files_only=True, trust_remote_code=cfg.model.trust_remote_code
        ).to(device)
    else:
        model = build_model(cfg.model.preset, dtype=dtype, device=device)
    if cfg.lora.r > 0:
        model = add_lora(model, cfg)
    return model


def add_lora(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
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


def prepare_for_training(model: torch.nn.Module, cfg: Config, ctx, console) -> torch.nn.Module:
    """Training mode, layer checkpointing, fused ops, then the tensor/data parallel split (in that order:
    each later one wraps the Parameters the earlier ones placed, and the optimizer is built after)."""
    model.train()
    if cfg.train.layer_checkpointing:  # transformers' own; exact inside oomb's chunks (tested)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused = use_fused_ops(model, cfg.train.fused_ops if cfg.train.tensor_parallel == 1 else "none")
    if fused:
        console.print(f"fused ops: liger RMSNorm / SwiGLU in {len(fused)} modules")
    if ctx is not None and ctx.tensor_parallel > 1:
        model = distributed.split_model(model, ctx)
    if ctx is not None and ctx.data_parallel > 1:  # over the groups of tensor parallel ranks, if any
        model = distributed.shard_model(model, ctx.mesh["dp"] if ctx.mesh is not None else None)
    return model
