"""Built-in model architectures (config JSON shipped with oomb; weights are random init)."""

from __future__ import annotations

import json
from importlib import resources

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig


def preset_names() -> list[str]:
    files = resources.files("oomb.train") / "presets"
    return sorted(p.name.removesuffix(".json") for p in files.iterdir() if p.name.endswith(".json"))


def preset_config(name: str) -> PretrainedConfig:
    path = resources.files("oomb.train") / "presets" / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; built-in presets: {', '.join(preset_names())}")
    fields = json.loads(path.read_text())
    fields.pop("_comment", None)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_model(
    name: str, *, dtype: torch.dtype, device: torch.device | str, attn_implementation: str = "sdpa",
    config: PretrainedConfig | None = None,
) -> torch.nn.Module:
    """A preset architecture with random weights, created directly on ``device`` in ``dtype``; ``config``: the
    preset's config as changed by the caller (e.g. its RoPE), else the preset's own."""
    config = config if config is not None else preset_config(name)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
