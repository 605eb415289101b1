"""A run's RoPE settings (``model.rope.*``): the base and transformers' scaling types, applied to the model's config.

Context extension changes how positions become rotation angles, so that a model pretrained on
32K tokens can be fine-tuned at 256K. transformers computes the rotary frequencies from
``config.rope_parameters`` when it builds the model; oomb writes the settings there first, so the
rotary embedding, the export's config.json and a later ``from_pretrained`` all see the same RoPE:

    model.rope.type=yarn (factor null, original null), data.seq_len=262144, a model of 32768 positions
        rope_parameters = {rope_type: yarn, rope_theta: <the model's>, factor: 8.0,
                           original_max_position_embeddings: 32768}
        max_position_embeddings = 262144      (dynamic keeps 32768: it scales from that length)

This module imports nothing of oomb.train (config.py holds its section); its errors are ValueErrors
whose message names the key to change, which the callers raise as ConfigError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALINGS = ("linear", "dynamic", "yarn", "llama3")  # transformers' rope_type names
TYPES = ("default", *SCALINGS)  # "default": RoPE without scaling, as transformers calls it
# Llama 3.1's llama3 scaling (its config.json), used where the model has none of its own.
LLAMA3_FREQ_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


@dataclass
class RopeConfig:
    type: str | None = None
    """RoPE scaling for contexts past the model's: linear, dynamic, yarn or llama3 (transformers' rope_type); default
    = RoPE without scaling; null = the model's own (its config.json's)."""
    theta: float | None = None
    """RoPE base (rope_theta); null = the model's own."""
    factor: float | None = None
    """With model.rope.type: how many times the original context the scaled RoPE covers; null = data.seq_len / that
    context (at least 1)."""
    original_max_position_embeddings: int | None = None
    """With model.rope.type: the context the model was trained at; null = the model's (its rope_parameters' if set,
    else max_position_embeddings)."""
    low_freq_factor: float | None = None
    """model.rope.type=llama3: the low-frequency factor; null = the model's, else Llama 3.1's 1.0."""
    high_freq_factor: float | None = None
    """model.rope.type=llama3: the high-frequency factor; null = the model's, else Llama 3.1's 4.0."""


def check_rope(rope: RopeConfig) -> None:
    """The settings on their own (before any model is read); raises ValueError naming the key."""
    if rope.type is not None and rope.type not in TYPES:
        raise ValueError(f"model.rope.type={rope.type!r}: choose linear, dynamic, yarn or llama3 (context extension), "
                         "default (RoPE without scaling) or null (the model's own)")
    if rope.theta is not None and not rope.theta > 0:
        raise ValueError(f"model.rope.theta={rope.theta:g} must be > 0 (the RoPE base, e.g. 1000000.0)")
    scaled_only = [f"model.rope.{name}" for name in ("factor", "original_max_position_embeddings")
                   if getattr(rope, name) is not None]
    if scaled_only and rope.type not in SCALINGS:
        raise ValueError(f"{' and '.join(scaled_only)} {_apply_verb(scaled_only)} only to a RoPE scaling: set "
                         f"model.rope.type to linear, dynamic, yarn or llama3 (it is {rope.type or 'null'})")
    if rope.factor is not None and not rope.factor >= 1:
        raise ValueError(f"model.rope.factor={rope.factor:g} must be >= 1: it is how many times the original context "
                         "the scaled RoPE covers (8 extends a 32K model to 256K); null = data.seq_len / that context")
    original = rope.original_max_position_embeddings
    if original is not None and original <= 0:
        raise ValueError(f"model.rope.original_max_position_embeddings={original} must be positive (the context the "
                         "model was trained at, e.g. 32768)")
    freq = {name: getattr(rope, name) for name in LLAMA3_FREQ_FACTORS if getattr(rope, name) is not None}
    if freq and rope.type != "llama3":
        raise ValueError(f"model.rope.{' and model.rope.'.join(freq)} {_apply_verb(freq)} only to "
                         f"model.rope.type=llama3 (it is {rope.type or 'null'})")
    ordered = len(freq) < 2 or freq["low_freq_factor"] < freq["high_freq_factor"]
    if not ordered or any(not value > 0 for value in freq.values()):
        raise ValueError(f"model.rope: {_shown(freq)}: llama3 scaling needs 0 < low_freq_factor < high_freq_factor "
                         "(Llama 3.1: 1.0 and 4.0)")


def _apply_verb(keys) -> str:
    return "applies" if len(keys) == 1 else "apply"


def _shown(values: dict) -> str:
    return " and ".join(f"model.rope.{name}={value:g}" for name, value in values.items())


def rope_is_scaled(config) -> bool:
    """Whether the config sets a RoPE scaling (yarn, linear, dynamic, llama3, ...) for longer contexts."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return False
    # Some models keep one parameter set per layer type: {"full_attention": {...}, ...}.
    sets = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return any(s.get("rope_type", s.get("type", "default")) not in (None, "default") for s in sets)


def apply_rope(rope: RopeConfig, config, seq_len: int) -> None:
    """Write the settings into ``config`` (a transformers config, before the model is built from it).

    Unset settings leave the model's own RoPE as it is. A changed type starts from plain parameters
    (only partial_rotary_factor, a property of the model, is kept); the same type as the model's keeps
    its other parameters (YaRN's beta_fast, ...). Raises ValueError for a model whose RoPE cannot be set.
    """
    check_rope(rope)
    if all(value is None for value in vars(rope).values()):
        return
    current = getattr(config, "rope_parameters", None)
    model = getattr(config, "model_type", type(config).__name__)
    if isinstance(current, dict) and any(isinstance(v, dict) for v in current.values()):
        raise ValueError(f"model.rope: this {model!r} model keeps one RoPE per layer type ({', '.join(current)}); "
                         "oomb sets a single one only: leave model.rope.* at null and edit its config.json")
    if not isinstance(current, dict) or "rope_theta" not in current:
        raise ValueError(f"model.rope: this {model!r} model's config has no RoPE parameters (rope_parameters with "
                         "a rope_theta) to set; leave model.rope.* at null")
    kind = rope.type or current.get("rope_type", "default")
    same = kind == current.get("rope_type", "default")
    params = dict(current) if same else {k: current[k] for k in ("partial_rotary_factor",) if k in current}
    params.update(rope_type=kind, rope_theta=float(rope.theta if rope.theta is not None else current["rope_theta"]))
    positions = config.max_position_embeddings
    if rope.type is not None:
        original = (rope.original_max_position_embeddings or current.get("original_max_position_embeddings")
                    or config.max_position_embeddings)
        positions = original
        if kind in SCALINGS:
            factor = rope.factor if rope.factor is not None else max(1.0, seq_len / original)
            params["factor"] = float(factor)
            # dynamic NTK scales from max_position_embeddings at run time: it must stay the original length.
            positions = original if kind == "dynamic" else max(original, math.ceil(original * factor))
        if kind in ("yarn", "llama3"):
            params["original_max_position_embeddings"] = original
            if hasattr(config, "original_max_position_embeddings"):  # Phi-3 style: transformers prefers this one
                config.original_max_position_embeddings = original
        if kind == "llama3":
            for name, fallback in LLAMA3_FREQ_FACTORS.items():
                value = getattr(rope, name)
                params[name] = float(value if value is not None else params.get(name, fallback))
            freq = {name: params[name] for name in LLAMA3_FREQ_FACTORS}
            if not freq["low_freq_factor"] < freq["high_freq_factor"]:
                raise ValueError(f"model.rope: {_shown(freq)} (the model's where unset): llama3 scaling needs "
                                 "low_freq_factor < high_freq_factor")
    config.rope_parameters = params
    config.max_position_embeddings = int(positions)
    try:  # transformers' own checks (required keys for the type), where this version has them
        for step in ("standardize_rope_params", "validate_rope"):
            if callable(getattr(config, step, None)):
                getattr(config, step)()
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"model.rope: transformers refuses the RoPE parameters {params}: {e}") from e


def describe_rope(config) -> str:
    """One line on the RoPE a config sets, e.g. "yarn, factor 8 over 32768 positions; max_position_embeddings
    262144, rope_theta 1e+06"."""
    params = getattr(config, "rope_parameters", None) or {}
    kind, factor = params.get("rope_type", "default"), params.get("factor")
    original = params.get("original_max_position_embeddings")
    scaling = kind + (f", factor {factor:g}" if factor is not None and kind in SCALINGS else "")
    scaling += f" over {original} positions" if original is not None and kind in SCALINGS else ""
    theta = params.get("rope_theta")
    return f"{scaling}; max_position_embeddings {config.max_position_embeddings}" + (
        f", rope_theta {theta:g}" if theta is not None else "")


def pin_dynamic_rope(model: torch.nn.Module, seq_len: int) -> int:
    """Hold dynamic-NTK rotary frequencies at those of a ``seq_len``-token sequence; returns the modules pinned.

    transformers recomputes dynamic frequencies in each forward from the largest position it is given.
    oomb runs a sequence chunk by chunk, each with its own positions, so unpinned the chunks would rotate
    their keys with different frequencies, and stage 2's recompute would not match stage 1. Pinned, every
    chunk uses the frequencies a full forward of the sequence uses, as transformers computes them.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    pinned = 0
    for module in model.modules():
        if getattr(module, "rope_type", None) != "dynamic" or not isinstance(getattr(module, "inv_freq", None),
                                                                              torch.Tensor):
            continue
        inv_freq, module.attention_scaling = ROPE_INIT_FUNCTIONS["dynamic"](module.config, module.inv_freq.device,
                                                                            seq_len=seq_len)
        module.register_buffer("inv_freq", inv_freq, persistent=False)
        module.rope_type = "default"  # transformers' dynamic update runs for rope_type "dynamic" only
        _check_pinned(module, inv_freq, seq_len)
        pinned += 1
    return pinned


def _check_pinned(module: torch.nn.Module, inv_freq: torch.Tensor, seq_len: int) -> None:
    """The rotary module keeps the pinned frequencies through forwards at the first and last positions."""
    x = torch.zeros(1, 1, 1, dtype=torch.float32, device=inv_freq.device)
    for position in (0, seq_len - 1):
        module(x, torch.tensor([[position]], device=inv_freq.device))
        if not torch.equal(module.inv_freq, inv_freq):
            raise ValueError("model.rope.type=dynamic: this transformers version recomputes the rotary frequencies "
                             "per forward, so chunks would not share them; use model.rope.type=yarn or linear")
