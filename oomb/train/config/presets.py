"""Built-in model architectures (config JSON shipped with oomb; weights are random init)."""

from __future__ import annotations

import json
from importlib import resources

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING


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
    name: str, *, dtype: torch.dtype, device: torch.device | str, attn_implementation: str | None = None,
    config: PretrainedConfig | None = None,
) -> torch.nn.Module:
    """A preset architecture with random weights, created directly on ``device`` in ``dtype``; ``config``: the
    preset's config as changed by the caller (e.g. its RoPE), else the preset's own. ``attn_implementation``:
    the model's own attention outside oomb's steps (None: SDPA where the model class takes it, else eager: GPT-OSS
    has no SDPA path in transformers)."""
    config = config if config is not None else preset_config(name)
    if attn_implementation is None:
        attn_implementation = "sdpa" if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa else "eager"
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
