"""oomb's attention as a transformers attention implementation.

``import oomb`` registers the name ``"oomb"`` with ``transformers.AttentionInterface``.
The engine switches a model to it for the duration of a step with
``model.set_attn_implementation`` and back afterwards, so models load and evaluate
with their usual implementation and train through this one; no forward method is
patched. The name is not registered with ``AttentionMaskInterface``: models build no
mask for it, and oomb applies causality, the window a call names and document
boundaries itself (``oomb.engine.support`` checks, before a model's first step, that
its masks say nothing else).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface, PreTrainedModel

from oomb.attention.context import StepContext
from oomb.attention.function import paged_attention

ATTENTION_NAME = "oomb"

# Attention module -> the step it runs in, while one runs (``oomb_attention``).
_ACTIVE: weakref.WeakKeyDictionary[torch.nn.Module, StepContext] = weakref.WeakKeyDictionary()


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
    step = _ACTIVE.get(module)
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

    site = step.site_of(module)
    scale = scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5)
    out = paged_attention(
        query, key, value, step, site,
        scale=scale, sliding_window=sliding_window, sinks=s_aux,
    )
    # transformers expects [B, C, H, D], and some models .view() it: contiguous (free where the kernel wrote
    # that layout already, as FlashAttention-4 does)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, oomb_attention_forward)


def check_attention_support(model: PreTrainedModel) -> None:
    """Raise if oomb cannot attach to the model at all: its class, its attention's routing, its layer types.
    (What its forward does around attention is checked by running it: oomb.engine.support.)"""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"oomb needs a transformers PreTrainedModel (e.g. AutoModelForCausalLM), got {type(model).__name__}"
        )
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
def oomb_attention(model: PreTrainedModel, step: StepContext):
    """Route the model's attention through oomb, in ``step``, for the duration of the block."""
    busy = [module for module in step.sites if module in _ACTIVE]
    if busy:
        raise RuntimeError(f"{type(model).__name__} is already inside an oomb step: steps of one model do not nest")
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    for module in step.sites:
        _ACTIVE[module] = step
    try:
        yield
    finally:
        for module in step.sites:
            _ACTIVE.pop(module, None)
        model.set_attn_implementation(previous)
