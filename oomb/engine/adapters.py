"""LoRA adapters as peft makes them, in one place for the run that trains them and the plan that counts them.

    lora_config(model, r, alpha, targets)   the peft.LoraConfig of a run (no dropout: chunks are recomputed)
    lora_numels(model, r, targets)          the adapters' tensor sizes, peft applied to a meta-device copy

``targets`` is a list of module names or ``ALL_LINEAR`` ("all-linear", peft's name for every linear layer
but the LM head). Mixture-of-experts models whose experts are fused into 3-D weights (GPT-OSS's
``mlp.experts.gate_up_proj`` [E, hidden, 2 x inner] and ``down_proj``) have no Linear module per expert:
``ALL_LINEAR`` covers those weights too, through peft's ``target_parameters`` (an adapter of rank r per
expert), since they are linear maps like the rest.
"""

from __future__ import annotations

import torch

ALL_LINEAR = "all-linear"


def expert_weights(model: torch.nn.Module) -> list[str]:
    """The names, from their module on (``mlp.experts.gate_up_proj``), of fused experts' 3-D weights."""
    found = []
    for module_name, module in model.named_modules():
        if "experts" not in module_name.rsplit(".", 1)[-1] or isinstance(module, torch.nn.Linear):
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.dim() == 3:
                found.append(".".join(module_name.split(".")[-2:] + [name]))
    return sorted(set(found))


def lora_config(model: torch.nn.Module, r: int, alpha: float, targets: list[str] | str):
    """The peft.LoraConfig of LoRA rank ``r`` on ``targets`` of ``model`` (ALL_LINEAR: with fused experts)."""
    try:
        import peft
    except ImportError as e:
        raise ValueError("LoRA adapters need the peft package: pip install peft") from e
    experts = expert_weights(model) if targets == ALL_LINEAR else []
    return peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets,
                           target_parameters=experts or None)


def lora_numels(model: torch.nn.Module, r: int, targets: list[str] | str) -> tuple[int, ...]:
    """numel of each adapter tensor peft adds to ``model`` (a meta-device model: nothing is allocated)."""
    import peft

    wrapped = peft.get_peft_model(model, lora_config(model, r, 2 * r, targets))
    return tuple(p.numel() for name, p in wrapped.named_parameters() if "lora_" in name)
