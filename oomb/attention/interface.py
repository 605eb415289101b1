"""oomb's attention as a transformers attention implementation.

``import oomb`` registers the name ``"oomb"`` with ``transformers.AttentionInterface``.
The engine switches a model to it for the duration of a step with
``model.set_attn_implementation`` and back afterwards, so models load and evaluate
with their usual implementation and train through this one; no forward method is
patched.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface, PreTrainedModel

from oomb.attention.context import STEP_KWARG, StepContext
from oomb.attention.function import paged_attention

ATTENTION_NAME = "oomb"


def oomb_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, C, D]
    key: torch.Tensor,  # [B, H_kv, C, D]
    value: torch.Tensor,  # [B, H_kv, C, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    step: StepContext | None = kwargs.pop(STEP_KWARG, None)
    if step is None:
        raise RuntimeError(
            "the 'oomb' attention implementation only runs inside oomb.chunked_backward(); "
            "load the model with attn_implementation='sdpa' (or 'eager') for other uses"
        )
    if attention_mask is not None:
        raise ValueError(
            "oomb attention got an attention mask; oomb applies causal and sliding-window masking itself "
            "and does not take padding masks (mark padded positions with label -100 instead)"
        )
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported: the recomputed forward must equal the first one. "
            "Set the model config's attention_dropout to 0"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit soft-capping (Gemma 2 style) is not supported by oomb")
    # Other keyword arguments (position_ids, use_cache, ...) carry nothing the paged path needs.

    if isinstance(s_aux, DTensor):  # GPT-OSS sinks split over tensor parallel ranks: this rank's heads
        s_aux = s_aux.to_local()

    layer_idx = module.layer_idx
    step.layers_seen.add(layer_idx)
    scale = scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5)
    out = paged_attention(
        query, key, value, step, layer_idx,
        scale=scale, sliding_window=sliding_window, sinks=s_aux,
    )
    return out.transpose(1, 2), None  # transformers expects [B, C, H, D]


AttentionInterface.register(ATTENTION_NAME, oomb_attention_forward)


# The config fields oomb reads a decoder's sizes from, to size its paged store and memory plan, in
# transformers' common names. Configs that name them otherwise (GPT-2's n_inner, OPT's ffn_dim) are refused.
MODEL_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def check_model_config(config) -> None:
    """Raise ValueError, naming the model type and the fields, where a config lacks a size oomb needs."""
    missing = [name for name in MODEL_SIZE_FIELDS if getattr(config, name, None) is None]
    if missing:
        raise ValueError(
            f"oomb does not support {getattr(config, 'model_type', None)!r} models ({type(config).__name__}): "
            f"oomb sizes its paged store and memory plan from a decoder config with the fields "
            f"{', '.join(MODEL_SIZE_FIELDS)}, and this one has no {', '.join(missing)}. Use a supported decoder "
            "(Llama, Qwen2/2.5, Qwen3, Mistral, GPT-OSS, or another whose config has these fields)"
        )


def check_attention_support(model: PreTrainedModel) -> None:
    """Raise if oomb cannot run the model: its config's sizes or its attention's routing."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"oomb needs a transformers PreTrainedModel (e.g. AutoModelForCausalLM), got {type(model).__name__}"
        )
    check_model_config(model.config)
    if not model._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface, "
            "so oomb cannot attach its paged attention to it. Use a model class that supports "
            "attn_implementation (Llama, Qwen2/2.5, Qwen3, Mistral, GPT-OSS, ...)"
        )
    layer_types = getattr(model.config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if odd:
        raise ValueError(
            f"{type(model).__name__} has layers of type {odd}; oomb handles full and sliding-window "
            "attention layers only (recurrent or linear-attention layers carry state across chunks)"
        )


@contextlib.contextmanager
def oomb_attention(model: PreTrainedModel):
    """Route the model's attention through oomb for the duration of the block."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
