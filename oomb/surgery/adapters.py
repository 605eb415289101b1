"""LoRA adapters as peft makes them, in one place for the run that trains them and the plan that counts them.

    lora_config(model, r, alpha, targets)   the peft.LoraConfig of a run (no dropout: chunks are recomputed)
    lora_numels(model, r, targets)          the adapters' tensor sizes and the names of the adapted modules, peft
                                            applied to a meta-device copy

``targets`` is a list of module names or ``ALL_LINEAR`` ("all-linear", peft's name for every linear layer
but the LM head). Mixture-of-experts models whose experts are fused into 3-D weights (GPT-OSS's
``mlp.experts.gate_up_proj`` [E, hidden, 2 x inner] and ``down_proj``) have no Linear module per expert:
``ALL_LINEAR`` covers those weights too, through peft's ``target_parameters`` (an adapter of rank r per
expert), since they are linear maps like the rest.
"""

from __future__ import annotations

import torch

ALL_LINEAR = "all-linear"


class UnknownLoraTargets(ValueError):
    """LoRA targets that name no module of the model (a typo, or another family's names)."""


def check_targets(model: torch.nn.Module, targets: list[str] | str) -> None:
    """Refuse named targets that match no module's last name: peft's own error names neither the setting nor a fix."""
    if targets == ALL_LINEAR:
        return
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [t for t in targets if t not in names]
    if not targets or unknown:
        raise UnknownLoraTargets(f"lora.targets names no layer of this model: {unknown or targets}; "
                                 f"e.g. q_proj,k_proj,v_proj,o_proj, or {ALL_LINEAR}")


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
    check_targets(model, targets)
    experts = expert_weights(model) if targets == ALL_LINEAR else []
    return peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets,
                           target_parameters=experts or None)


def lora_numels(model: torch.nn.Module, r: int, targets: list[str] | str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """numel of each adapter tensor peft adds to ``model`` (a meta-device model: nothing is allocated), and the
    last names of the modules it adapts (``q_proj``, ``experts``, ...)."""
    import peft

    wrapped = peft.get_peft_model(model, lora_config(model, r, 2 * r, targets))
    numels = tuple(p.numel() for name, p in wrapped.named_parameters() if "lora_" in name)
    adapted = {name.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for name, _ in wrapped.named_parameters()
               if ".lora_A." in name}
    return numels, tuple(sorted(adapted))
