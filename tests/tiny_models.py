"""Tiny random-init decoder models of every family oomb supports, in fp32 on CPU."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 101
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    attention_dropout=0.0,
)


def tiny_config(family: str):
    if family == "llama":
        return LlamaConfig(**_COMMON)
    if family == "qwen2":
        # Qwen2 has q/k/v biases; one sliding-window layer exercises the window path.
        return Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=37, max_window_layers=1,
                           layer_types=["full_attention", "sliding_attention"])
    if family == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=16)
    if family == "mistral":
        return MistralConfig(**_COMMON, sliding_window=45)
    if family == "gpt_oss":
        cfg = dict(_COMMON, intermediate_size=32)
        return GptOssConfig(**cfg, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=29,
                            layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    if family == "granite":
        # Granite's multipliers on the embedding, residuals, attention scores and logits; biased MLP projections.
        return GraniteConfig(**_COMMON, embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                             attention_multiplier=0.25, mlp_bias=True)
    if family == "gemma3_text":
        # Gemma-3's sandwich norms, q/k norms, GEGLU MLP; one sliding-window layer with its own RoPE base.
        return Gemma3TextConfig(**_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=29,
                                layer_types=["sliding_attention", "full_attention"])
    if family == "phi":
        # LayerNorms, a non-gated MLP and partial RoPE: nothing liger's fused ops compute (test_fused_ops).
        return PhiConfig(**_COMMON)
    raise ValueError(family)


# The families every engine test sweeps; tiny_config also builds granite, gemma3_text and phi (fused-ops tests).
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt_oss")


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "eager", **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model = model.float()
    if family == "gpt_oss":
        # Random sinks so the sink path matters (they start at zero).
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    if family == "gemma3_text":
        # Random norm weights so the (1 + weight) scale matters (they start at zero).
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.5)
    return model
