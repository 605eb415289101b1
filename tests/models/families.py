"""The sweep's config of every model type in transformers' causal LM mapping.

    sweep_config(model_type)  ->  the family's default config with its optional features switched on
                                  (FEATURES), every dropout and jitter at 0 (the sweep tests exactness),
                                  shrunk by oomb.engine.twin.tiny_twin_config
    FAMILIES[model_type]()    ->  the same, as a callable per model type
    NOT_DECODERS              ->  model_type -> why it is not a decoder-only text causal LM

A feature listed here is one the family's config class has but its default leaves off: sliding windows,
logit scaling, attention biases, soft-capping, shared experts, qk-norm, partial rotary, and the like.
Where a default config cannot run at all in the installed transformers (a size left None, no attention
layer in a hybrid), the entry sets it as the family's published checkpoints do; the comment says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from oomb.engine.twin import TwinUnavailable, tiny_twin_config
from oomb.engine.twin_families import NOT_DECODERS

MODEL_TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

_GRANITE = dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                attention_bias=True)
_BERT = dict(is_decoder=True)
_QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=4096,
                 short_factor=[1.0 + 0.02 * i for i in range(48)], long_factor=[1.0 + 0.5 * i for i in range(48)])
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def _every(n: int, period: int, on: str, off: str) -> list[str]:
    """`off` layers with every `period`-th layer `on` (1-based): Gemma-3's 5 local : 1 global is _every(n, 6, ...)."""
    return [on if (i + 1) % period == 0 else off for i in range(n)]


# model_type -> constructor arguments that switch on what the default config leaves off.
FEATURES: dict[str, dict[str, Any]] = {
    "afmoe": dict(mup_enabled=True, attention_bias=True),
    "apertus": dict(attention_bias=True),
    "arcee": dict(attention_bias=True, mlp_bias=True),
    "aria_text": dict(attention_bias=True, mlp_bias=True),
    "axk1": dict(attention_bias=True),
    "axk2": dict(attention_bias=True, n_group=4, topk_group=2),
    # Default Bamba has no attention layer (its forward then fails); Bamba-9B's attention layers.
    "bamba": dict(attn_layer_indices=[9, 18, 27], attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
                  z_loss_coefficient=1e-3),
    "bart": dict(scale_embedding=True),
    "bert": _BERT, "bert-generation": _BERT, "camembert": _BERT, "data2vec-text": _BERT, "electra": _BERT,
    "megatron-bert": _BERT, "rembert": _BERT, "roberta": _BERT, "roberta-prelayernorm": _BERT,
    "xlm-roberta": _BERT, "xlm-roberta-xl": _BERT, "roc_bert": _BERT,
    "big_bird": dict(is_decoder=True, attention_type="original_full", rescale_embeddings=True),
    "bigbird_pegasus": dict(use_bias=True),
    "bitnet": dict(attention_bias=True),
    "blenderbot": dict(scale_embedding=True), "blenderbot-small": dict(scale_embedding=True),
    "bloom": dict(apply_residual_connection_post_layernorm=True),
    "cohere": dict(logit_scale=0.125, use_qk_norm=True, attention_bias=True),
    "cohere2": dict(logit_scale=0.125, attention_bias=True),
    "cohere2_moe": dict(logit_scale=0.125, attention_bias=True, num_shared_experts=1, first_k_dense_replace=2,
                        prefix_dense_intermediate_size=8192),
    "cohere_compass_text": dict(logit_scale=0.125, attention_bias=True, layer_types=_every(40, 4, "full_attention",
                                "sliding_attention"),
                                rope_parameters={t: dict(rope_type="default", rope_theta=10000.0,
                                                         mrope_section=[22, 22, 20])
                                                 for t in ("full_attention", "sliding_attention")}),
    # DbrxAttention reads attn_config.rope_theta, which the config class does not declare (DBRX's checkpoints have it).
    "dbrx": dict(attn_config=dict(kv_n_heads=8, clip_qkv=8.0, rope_theta=10000.0), ffn_config=dict(moe_top_k=2)),
    # The default leaves num_experts_per_tok None (its router then fails): DeepSeek-V2's routing.
    "deepseek_v2": dict(num_experts_per_tok=6, first_k_dense_replace=1, topk_method="group_limited_greedy",
                        n_group=8, topk_group=3, attention_bias=True),
    "deepseek_v3": dict(attention_bias=True, rope_parameters=_YARN),
    "deepseek_v32": dict(attention_bias=True, rope_parameters=_YARN),
    # is_moe=True does not run in transformers 5.17 (DogeDecoderLayer applies dropout to the MoE's output tuple).
    "doge": dict(sliding_window=4096, attention_bias=True),
    # The default leaves the experts None (its MoE then fails): dots.llm1's.
    "dots1": dict(n_routed_experts=128, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                  sliding_window=4096, max_window_layers=40, attention_bias=True),
    "ernie": dict(is_decoder=True, use_task_id=True),
    "ernie4_5": dict(use_bias=True),
    "ernie4_5_moe": dict(use_bias=True),
    # Falcon-40B/180B's architecture (the default is Falcon-7B's multi-query one).
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=8, num_ln_in_parallel_attn=2, bias=True),
    "falcon_h1": dict(embedding_multiplier=2.0, lm_head_multiplier=0.5, mlp_multipliers=[0.5, 1.5],
                      key_multiplier=0.8, attention_out_multiplier=0.9, attention_in_multiplier=1.1,
                      ssm_multipliers=[0.5, 0.6, 0.7, 0.8, 0.9], ssm_in_multiplier=1.2, ssm_out_multiplier=0.8,
                      attention_bias=True, mlp_bias=True, projectors_bias=True, mamba_rms_norm=True),
    "falcon_mamba": dict(use_bias=True),
    "flex_olmo": dict(attention_bias=True, norm_topk_prob=True),
    "gemma": dict(attention_bias=True),
    "gemma2": dict(attention_bias=True),
    "gemma3_text": dict(attention_bias=True, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma4_text": dict(attention_bias=True, final_logit_softcapping=30.0, attention_k_eq_v=True,
                        num_kv_shared_layers=10, enable_moe_block=True, num_experts=8, top_k_experts=2,
                        moe_intermediate_size=1024, use_double_wide_mlp=True),
    "gemma4_unified_text": dict(attention_bias=True, final_logit_softcapping=30.0, attention_k_eq_v=True,
                                num_kv_shared_layers=10, use_double_wide_mlp=True),
    "glm4_moe": dict(use_qk_norm=True, attention_bias=True),
    "glm4_moe_lite": dict(attention_bias=True),
    "gpt2": dict(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True),
    "gpt-sw3": dict(scale_attn_by_inverse_layer_idx=True),
    "granite": dict(_GRANITE, mlp_bias=True), "granite_swa": dict(_GRANITE, mlp_bias=True),
    "granitemoe": _GRANITE, "granitemoeshared": dict(_GRANITE, shared_intermediate_size=1024),
    "granitemoe_swa": dict(_GRANITE, shared_intermediate_size=1024),
    # Default GraniteMoeHybrid is all Mamba (its forward then fails): Granite-4's 1 attention : 9 Mamba.
    "granitemoehybrid": dict(_GRANITE, layer_types=_every(40, 10, "full_attention", "linear_attention"),
                             num_hidden_layers=40, position_embedding_type="rope"),
    "helium": dict(attention_bias=True, mlp_bias=True),
    # The defaults leave head_dim None (its attention then fails): Hunyuan's 128.
    "hunyuan_v1_dense": dict(head_dim=128, attention_bias=True),
    "hunyuan_v1_moe": dict(head_dim=128, attention_bias=True, num_experts=8, moe_topk=2),
    "hyperclovax": dict(embedding_multiplier=0.5, logits_scaling=0.25, residual_multiplier=0.8, attention_bias=True),
    "jais2": dict(),
    "kimi_linear": dict(q_lora_rank=768, attention_bias=True),
    "laguna": dict(layer_types=_every(40, 4, "full_attention", "sliding_attention"),
                   num_attention_heads_per_layer=[48 if (i + 1) % 4 == 0 else 64 for i in range(40)],
                   attention_bias=True),
    # Default LFM2 has attention in every layer (no conv layer): LFM2's own pattern.
    "lfm2": dict(full_attn_idxs=[2, 5, 8, 10, 12, 14, 18, 21, 24, 27, 30], conv_bias=True),
    # The default leaves layer_types None (its model then fails): LFM2-MoE's pattern.
    "lfm2_moe": dict(layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21, 24, 27, 30) else "conv"
                                  for i in range(32)], conv_bias=True),
    "llama": dict(attention_bias=True, mlp_bias=True,
                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "mellum": dict(layer_types=_every(28, 2, "full_attention", "sliding_attention"), attention_bias=True),
    "minimax_m3_vl_text": dict(mlp_layer_types=["dense"] + ["sparse"] * 59),
    # The default leaves head_dim None (its attention then fails): Ministral-8B's 128.
    "ministral": dict(head_dim=128),
    "ministral3": dict(sliding_window=4096),
    "mistral": dict(head_dim=128),
    "mixtral": dict(sliding_window=4096),
    "modernbert-decoder": dict(attention_bias=True, mlp_bias=True, norm_bias=True),
    "mpt": dict(attn_config=dict(qk_ln=True, clip_qkv=8.0), logit_scale=0.5, no_bias=False),
    "mvp": dict(use_prompt=True),
    # The default leaves num_key_value_heads None (its attention then fails): Nemotron-4's 8.
    "nemotron": dict(num_key_value_heads=8, attention_bias=True, mlp_bias=True),
    "nemotron_h": dict(attention_bias=True, mlp_bias=True),
    "olmo": dict(clip_qkv=8.0, attention_bias=True),
    "olmo2": dict(attention_bias=True), "olmo3": dict(attention_bias=True),
    "olmoe": dict(clip_qkv=8.0, norm_topk_prob=True, attention_bias=True),
    # OPT-350m: post-norm and a projection between the word embeddings and the decoder (and before the head).
    "opt": dict(do_layer_norm_before=False, word_embed_proj_dim=384),
    "pegasus": dict(scale_embedding=True), "plbart": dict(scale_embedding=True), "marian": dict(scale_embedding=True),
    "mbart": dict(scale_embedding=True), "trocr": dict(scale_embedding=True),
    "phi": dict(qk_layernorm=True),
    "phi3": dict(sliding_window=2047, rope_parameters=_LONGROPE, max_position_embeddings=131072),
    "phimoe": dict(attention_bias=True, lm_head_bias=True),
    "qwen2": _QWEN_WINDOW,
    "qwen2_moe": dict(_QWEN_WINDOW, sliding_window=4096, mlp_only_layers=[0], norm_topk_prob=True),
    "qwen3": dict(_QWEN_WINDOW, attention_bias=True),
    "qwen3_moe": dict(_QWEN_WINDOW, attention_bias=True, mlp_only_layers=[0], norm_topk_prob=True),
    "qwen3_next": dict(attention_bias=True, mlp_only_layers=[0]),
    "qwen3_5_text": dict(attention_bias=True), "qwen3_5_moe_text": dict(attention_bias=True),
    # The defaults leave the sparse-attention indexer's sizes None (its attention then fails).
    "qwen4_exp_text": dict(indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=2048,
                           indexer_compress_ratio=4, attention_bias=True, ple_layer_ids=[2, 3],
                           eos_token_id=248044),  # the n-gram embeddings restart after each EOS
    "reformer": dict(is_decoder=True),
    "roformer": dict(is_decoder=True, rotary_value=True),
    "seed_oss": dict(attention_out_bias=True),
    "smollm3": dict(use_sliding_window=True, sliding_window=4096, attention_bias=True, mlp_bias=True),
    "stablelm": dict(use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True),
    "starcoder2": dict(sliding_window=4096),
    "xlm": dict(causal=True),
    "xlnet": dict(attn_type="uni"),
    "xmod": dict(is_decoder=True, default_language="en_XX"),
    "zamba2": dict(use_shared_attention_adapter=True, use_mem_rope=True),
    "zaya": dict(sliding_window=4096, attention_bias=True),
}
# Composite (multimodal) configs: their features are those of their text model.
_TEXT_OF = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "gemma4_unified": "gemma4_unified_text",
            "got_ocr2": "qwen2", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
            "qwen4_exp": "qwen4_exp_text", "llama4": "llama4_text", "fuyu": "persimmon"}
_NOISE = ("dropout", "pdrop", "layerdrop", "jitter", "dropout_p", "drop_path")


def _without_noise(config: PretrainedConfig) -> PretrainedConfig:
    """Every dropout, layer-drop and router jitter at 0, nested configs included (in place)."""
    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _without_noise(value)
        elif isinstance(value, float) and value > 0 and any(word in key for word in _NOISE):
            setattr(config, key, 0.0)
    return config


def sweep_config(model_type: str) -> PretrainedConfig:
    """The family's default config with its features on and no dropout, as a tiny twin (TwinUnavailable: why not)."""
    if model_type in NOT_DECODERS:
        raise TwinUnavailable(f"{model_type}: {NOT_DECODERS[model_type]}.")
    cls = CONFIG_MAPPING[model_type]
    kwargs = dict(FEATURES.get(model_type, {}))
    if model_type in _TEXT_OF and FEATURES.get(_TEXT_OF[model_type]):
        kwargs["text_config"] = CONFIG_MAPPING[_TEXT_OF[model_type]](**FEATURES[_TEXT_OF[model_type]]).to_dict()
    twin = tiny_twin_config(_without_noise(cls(**kwargs)))
    for config in (twin, getattr(twin, "text_config", None)):
        if isinstance(config, PretrainedConfig) and getattr(config, "use_cache", None):
            config.use_cache = False  # a training step: xLSTM's cache path cannot backpropagate in transformers 5.17
    return twin


FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {mt: (lambda mt=mt: sweep_config(mt)) for mt in MODEL_TYPES}
