"""What tiny_twin_config (oomb/engine/twin.py) knows about config fields and model families.

Field tables name the config fields a twin resizes, by what they measure (the canonical names of a
config's to_dict(); the twin reads aliases through the class's attribute_map). Family knowledge that
field names cannot carry is in small tables and in `after`, each entry keyed by model_type with the
reason. A family absent from all of them (a trust_remote_code model with the usual field names) takes
the generic path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


class TwinUnavailable(ValueError):
    """No tiny twin can be made of this config; the message says why in one sentence."""


# --------------------------------------------------------------------------------------------- field tables

# The main sizes, in priority order (an encoder-decoder's decoder first: its ForCausalLM is the decoder).
HIDDEN = ("hidden_size", "d_model", "n_embd", "emb_dim", "dim")
HEADS = ("decoder_attention_heads", "num_decoder_attention_heads", "num_attention_heads", "n_head", "n_heads",
         "num_heads", "attention_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "num_query_groups", "swa_num_key_value_heads",
            "indexer_kv_heads")
BASE_HEAD_DIM = ("head_dim", "kv_channels", "attention_head_dim", "dim_head", "d_head", "attention_head_size")

# Scaled with the hidden size (hidden -> 64), to a multiple of 8.
WIDTHS = frozenset({
    "hidden_size", "d_model", "n_embd", "emb_dim", "embedding_size", "embedding_dim", "hidden_size_global",
    "lru_width", "attention_hidden_size", "word_embed_proj_dim", "input_embedding_size", "output_embedding_size",
    "hidden_size_per_layer_input", "ple_embed_dim", "mamba_d_ssm", "input_size", "pronunciation_embed_dim",
    "shape_embed_dim", "out_hidden_size", "projector_input_dim", "projector_output_dim", "vision_output_dim",
    "encoder_cross_output_size", "nemo_conv_channels", "ext_pw_out_channel",
    "depthwise_separable_out_channel",
})
INTERMEDIATES = frozenset({
    "intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_inner", "dff", "dim_ff",
    "ffn_hidden_size", "feed_forward_size", "intermediate_size_mlp", "moe_intermediate_size",
    "shared_intermediate_size", "dense_intermediate_size", "prefix_dense_intermediate_size",
    "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size", "mlp_dim",
    "prompt_mid_dim",
})
RANKS = frozenset({"kv_lora_rank", "q_lora_rank", "o_lora_rank", "laurel_rank", "adapter_rank", "gated_norm_rank",
                   "hc_lowrank", "router_hidden_size", "time_step_rank", "mamba_dt_rank"})
# Head counts besides the main query and key/value heads: scaled with the query heads.
OTHER_HEADS = frozenset({
    "encoder_attention_heads", "num_encoder_attention_heads", "swa_num_attention_heads", "index_n_heads",
    "indexer_n_heads", "linear_num_heads", "linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads",
    "mamba_num_heads", "n_mamba_heads", "heads_per_ngram", "conf_num_attention_heads",
})
# Query heads of other layer kinds (Laguna's per layer, Inkling's sliding layers): multiples of the kv heads.
QUERY_HEADS = frozenset({"num_attention_heads_per_layer", "swa_num_attention_heads"})
# Scaled with the base head size.
HEAD_DIMS = frozenset({
    "head_dim", "kv_channels", "attention_head_dim", "dim_head", "d_head", "attention_head_size", "qk_nope_head_dim",
    "qk_rope_head_dim", "qk_head_dim", "v_head_dim", "swa_head_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_head_dim", "index_head_dim", "indexer_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim",
    "rotary_dim", "global_head_dim",
})
# Token lengths: shrunk to the twin's window (a 96-token step goes past them); None or 0 (none) is kept.
WINDOWS = frozenset({
    "sliding_window", "attention_window_size", "sliding_window_size", "attention_chunk_size", "window_size",
    "keep_window_size", "index_topk", "indexer_budget", "rel_extent", "floor_scale", "log_scaling_n_floor",
    "local_attn_chunk_length", "lsh_attn_chunk_length",
})
STATE_SIZES = frozenset({"state_size", "mamba_d_state", "ssm_state_size"})  # SSM state: at most 16
SCAN_CHUNKS = frozenset({"chunk_size", "mamba_chunk_size"})  # SSM and mLSTM scan chunks: at most 32 (96 = 3 of them)
# Rounding granularities: 8, so they do not pad a toy size back up (LFM2 rounds its MLP up to 256).
MULTIPLES = frozenset({"block_multiple_of", "ffn_round_up_to_multiple_of", "make_ngram_vocab_size_divisible_by"})
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k", "top_k_experts", "num_experts_per_token")
EXPERT_GROUPS = ("n_group", "num_expert_group")
TOP_GROUPS = ("topk_group",)
SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
ZERO_EXPERTS = ("zero_expert_num",)  # LongCat's identity experts: kept, at most 2
SSM_GROUPS = ("n_groups", "mamba_n_groups", "mamba_ngroups")  # must divide the SSM heads: 1 stays 1, else 2
VOCABS = ("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size",
          "pronunciation_vocab_size", "shape_vocab_size", "encoder_hash_byte_group_vocab", "ngram_vocab_size_base")
TOKEN_ID_SUFFIXES = ("_token_id", "_token_index")

# Lists whose entries are layer indices (remapped to the twin's layers) -> the index of the first layer.
INDEX_LISTS = {"mlp_only_layers": 0, "full_attn_idxs": 0, "moe_layers": 0, "cross_attention_layers": 0,
               "hybrid_layer_ids": 0, "attn_layer_indices": 0, "local_layer_ids": 0,
               "ple_layer_ids": 1}  # Qwen4-Exp counts its per-layer-embedding layers from 1
# Lists that are not per layer even where their length happens to equal the number of layers.
NOT_PER_LAYER = frozenset({
    "eos_token_id", "begin_suppress_tokens", "suppress_tokens", "time_step_limit", "mlp_multipliers",
    "ssm_multipliers", "encoder_hash_byte_group_size", "architectures", "block_types", "attention_types",
    "axial_pos_shape", "axial_pos_embds_dim", "L_bp_cycles", "mtp_layers_block_type", "languages",
})


def _below(i: int, v: int, n: int) -> bool:
    return i < v


def _period(i: int, v: int, n: int) -> int:
    return i % v


# Layer-index rules: (layer index, the field's value, number of layers) -> the layer's kind under that field.
LAYER_RULES: dict[str, Callable[[int, Any, int], Any]] = {
    "first_k_dense_replace": _below,  # DeepSeek-style: dense MLPs before the MoE layers
    "num_dense_layers": _below,
    "max_window_layers": _below,  # Qwen2: layers from this index on use the window
    "moe_layer_start_index": _below,
    "moe_layer_end_index": lambda i, v, n: i <= v,
    "num_kv_shared_layers": lambda i, v, n: i >= n - v,  # Gemma-3n/4: the last layers reuse earlier K/V
    "block_types": lambda i, v, n: v[i % len(v)],  # RecurrentGemma: the block pattern repeats
    "decoder_sparse_step": _period, "moe_layer_interval": _period, "interleave_moe_layer_step": _period,
    "no_rope_layer_interval": _period, "global_attn_every_n_layers": _period, "sliding_window_pattern": _period,
    "_sliding_window_pattern": _period, "attn_layer_period": _period, "expert_layer_period": _period,
    "prefix_dense_sliding_window_pattern": _period,
}
# Rule fields a family's model does not read (they only seed a per-layer list the config already has).
UNREAD_RULES: dict[str, tuple[str, ...]] = {
    "zamba": ("attn_layer_period",),  # seeds layers_block_type, which ZambaModel reads
    "qwen3_moe": ("max_window_layers",),  # Qwen3-MoE windows every layer when use_sliding_window is on
}
# Families whose layers share weights across the stack: the twin keeps each kind of layer twice.
TWICE = {
    "zamba": "its hybrid layers share one transformer block (tied by name across layers)",
    "zamba2": "its hybrid layers share num_mem_blocks transformer blocks",
}
# How the count rules above are recounted for the kept layers (original indices `keep` of `n`).
LAYER_COUNTS: dict[str, Callable[[list[int], int, int], int]] = {
    "first_k_dense_replace": lambda keep, v, n: sum(k < v for k in keep),
    "num_dense_layers": lambda keep, v, n: sum(k < v for k in keep),
    "max_window_layers": lambda keep, v, n: sum(k < v for k in keep),
    "moe_layer_start_index": lambda keep, v, n: sum(k < v for k in keep),
    "moe_layer_end_index": lambda keep, v, n: sum(k <= v for k in keep) - 1,
    "num_kv_shared_layers": lambda keep, v, n: sum(k >= n - v for k in keep),
}


# ---------------------------------------------------------------------------------------------- families

# model_type -> why it is not a decoder-only text causal LM (no twin is made).
NOT_DECODERS: dict[str, str] = {
    "gemma4_assistant": "Gemma-4's assistant is a speculative-decoding drafter that reads the main model's hidden "
                        "states, not a standalone text causal LM",
    "gemma4_unified_assistant": "Gemma-4's assistant is a speculative-decoding drafter that reads the main model's "
                                "hidden states, not a standalone text causal LM",
    "git": "GIT is an image-to-text model: its loss always skips the logits of the image tokens it expects before "
           "the text (GitForCausalLM.forward), so it cannot train on text alone",
    "musicgen": "MusicGen's decoder predicts audio codebooks conditioned on a text encoder's hidden states",
    "musicgen_melody": "MusicGen-Melody's decoder predicts audio codebooks conditioned on a text encoder and audio",
}
# Families whose causal LM attends causally only with config.is_decoder=True (an encoder otherwise).
DECODER_FLAG = frozenset({
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod",
    "reformer",
})
_ENC_DEC = ("decoder_layers", "encoder_layers")
# The fields holding the layer count, first the one per-layer lists follow (default: num_hidden_layers).
LAYER_KEYS: dict[str, tuple[str, ...]] = {
    # Encoder-decoder families whose ForCausalLM is the decoder alone.
    "bart": _ENC_DEC, "bigbird_pegasus": _ENC_DEC, "blenderbot": _ENC_DEC, "blenderbot-small": _ENC_DEC,
    "marian": _ENC_DEC, "mbart": _ENC_DEC, "mvp": _ENC_DEC, "pegasus": _ENC_DEC, "plbart": _ENC_DEC,
    "whisper": _ENC_DEC, "trocr": ("decoder_layers",), "prophetnet": ("num_decoder_layers", "num_encoder_layers"),
    "hrm_text": ("num_layers_per_stack",),  # num_hidden_layers counts the recurrence's cache slots (after())
    "longcat_flash": ("num_layers",),  # each layer has two attention sublayers: num_hidden_layers = 2 x this
    "xlstm": ("num_hidden_layers", "num_blocks"),
    "phi4_multimodal_audio": ("num_blocks",),  # Phi-4-multimodal's audio conformer
}
# Sub-configs built as parts of the causal LM (shrunk with the parent's scales).
PARTS = {"dbrx": ("attn_config", "ffn_config"), "mpt": ("attn_config",)}
# Sub-configs built as separate models inside the causal LM (shrunk as models of their own), and the
# sub-config whose hidden size sets the width scale they share (None: each its own).
SUB_MODELS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "phi4_multimodal": (("vision_config", "audio_config"), None),  # the embedding builds both encoders
    "blt": (("patcher_config", "encoder_config", "decoder_config", "global_config"), "global_config"),
}


def text_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config whose twin is made: the text model of a composite (multimodal) config."""
    mt = config.model_type
    if mt in NOT_DECODERS:
        raise TwinUnavailable(f"{mt}: {NOT_DECODERS[mt]}.")
    text = config.__dict__.get("text_config")
    if "text_config" not in type(config).sub_configs or not isinstance(text, PretrainedConfig):
        return config
    if text.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return text
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mt, "")
    if not causal_lm.endswith("ForConditionalGeneration"):
        return config  # AutoModelForCausalLM builds the text model from text_config (Emu3, Mllama)
    raise TwinUnavailable(f"{mt}: transformers has no text-only causal LM for its text model ({text.model_type}).")


def check_decoder(config: PretrainedConfig) -> None:
    """Raise TwinUnavailable where the config is not a decoder-only causal LM over text."""
    mt = config.model_type
    auto_map = getattr(config, "auto_map", None) or {}
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and "AutoModelForCausalLM" not in auto_map:
        raise TwinUnavailable(f"{mt}: transformers has no causal LM for this model type (AutoModelForCausalLM does "
                              "not map it), so it is not a decoder-only text model.")
    if config.is_encoder_decoder and mt not in LAYER_KEYS:
        raise TwinUnavailable(f"{mt}: an encoder-decoder model, not a decoder-only causal LM.")
    if mt in DECODER_FLAG and not config.is_decoder:
        raise TwinUnavailable(f"{mt}: with is_decoder=False this model attends bidirectionally (an encoder); set "
                              "is_decoder=True in its config to train it as a causal LM.")
    if mt == "xlm" and not config.causal:
        raise TwinUnavailable("xlm: with causal=False XLM attends bidirectionally (a masked LM); set causal=True.")
    if mt == "xlnet" and config.attn_type != "uni":
        raise TwinUnavailable("xlnet: with attn_type='bi' XLNet attends bidirectionally; set attn_type='uni'.")


def layer_count(f) -> tuple[int, list[str]]:
    """The number of layers and the config keys that hold it."""
    if f.model_type == "nemotron_h":  # no count field: len(layers_block_type) is the count
        return len(f.d["layers_block_type"]), []
    keys = [f.key(n) for n in LAYER_KEYS.get(f.model_type, ("num_hidden_layers",)) if isinstance(f.get(n), int)]
    return (f.d[keys[0]], keys) if keys else (0, [])


def is_multi_query(f) -> bool:
    if f.model_type == "falcon":  # Falcon-7B's multi_query applies only to the old (non-"new") architecture
        return bool(f.get("multi_query")) and not f.get("new_decoder_architecture")
    return bool(f.get("multi_query"))


def is_latent_attention(f) -> bool:
    return isinstance(f.get("kv_lora_rank"), int)


def fit_head_dim(f, target: int) -> int:
    """The smallest even head size from `target` up whose rotary part (each partial factor) is even."""
    factors = [f.get("partial_rotary_factor")]
    rope = f.get("rope_parameters")
    if isinstance(rope, dict):
        factors += [rope.get("partial_rotary_factor")]
        factors += [r.get("partial_rotary_factor") for r in rope.values() if isinstance(r, dict)]
    factors = [x for x in factors if isinstance(x, float) and 0 < x < 1]
    return next((h for h in range(target, target + 64, 2) if all(int(h * x) >= 2 and int(h * x) % 2 == 0
                                                                  for x in factors)), target)


def after(f, scales, *, window: int, vocab: int) -> None:
    """Family fixes after the generic shrink (only fields the config has are written)."""
    d, mt = f.d, f.model_type
    _fit_ssm_heads(f)
    if mt == "minicpm3":  # residual branches scale by scale_depth / sqrt(layers), the head by hidden / dim_model_base
        f.set("scale_depth", d["scale_depth"] * math.sqrt(d["num_hidden_layers"] / f.layers_before))
        f.set("dim_model_base", max(1, round(d["dim_model_base"] * scales.width)))
    if mt == "hrm_text":  # one cache slot per attention call of the H/L recurrence
        f.set("num_hidden_layers", d["num_layers_per_stack"] * d["H_cycles"] * (d["L_cycles"] + 1))
    if mt == "longcat_flash":  # two attention sublayers per layer, one cache slot each
        f.set("num_hidden_layers", 2 * d["num_layers"])
    if mt == "gpt_neo":  # attention_types is the compact form of attention_layers: [[pattern, repeats]]
        pattern = d["attention_types"][0][0]
        d["attention_types"] = [[pattern, len(d["attention_layers"]) // len(pattern)]]
    if mt == "modernbert-decoder":  # its window is local_attention // 2 (sliding_window is derived)
        f.set("local_attention", 2 * d["sliding_window"])
    if mt == "cohere_compass_text":  # rotary sections default to [22, 22, 20] (a 128 head): size them to the twin
        half = d["head_dim"] // 2
        for r in (d.get("rope_parameters") or {}).values():
            if isinstance(r, dict) and "mrope_section" not in r:
                r["mrope_section"] = [half * 11 // 32, half * 11 // 32, half - 2 * (half * 11 // 32)]
    if mt == "deepseek_v4":  # compression rates are token counts; output groups must divide the heads
        d["compress_rates"] = {k: min(v, 8) for k, v in (d.get("compress_rates") or {}).items()}
        f.set("o_groups", min(d["o_groups"], d["num_attention_heads"] // 2 or 1))
    if mt == "minimax_m3_vl_text":  # sparse attention over blocks of keys: 96 tokens = 12 blocks, keep 2 + local
        f.set("index_block_size", min(d["index_block_size"], 8))
        f.set("index_topk_blocks", min(d["index_topk_blocks"], 2))
    if mt == "qwen4_exp_text" and isinstance(d.get("indexer_compress_ratio"), int):  # budget / ratio blocks
        f.set("indexer_compress_ratio", min(d["indexer_compress_ratio"], 4))
        f.set("split_ngram_parts", min(d["split_ngram_parts"], 4))
    if mt == "reformer":  # axial positions must multiply to the training length (96 in a twin's step)
        f.set("axial_pos_shape", [8, 12])
        f.set("axial_pos_embds_dim", [d["hidden_size"] // 4, d["hidden_size"] - d["hidden_size"] // 4])
        f.set("max_position_embeddings", 96)
    for key in MULTIPLES:
        if isinstance(d.get(key), int):
            d[key] = min(d[key], 8)


def _expand(d: dict, key: str) -> int | None:
    """The SSM inner width expand x hidden, where the config has both."""
    expand, hidden = d.get(key), d.get("hidden_size")
    return expand * hidden if isinstance(expand, int) and isinstance(hidden, int) else None


# SSM heads: (heads field, head size field, the inner width they split).
_SSM = (
    ("mamba_n_heads", "mamba_d_head", lambda d: d.get("mamba_d_ssm") or _expand(d, "mamba_expand")),
    ("mamba_num_heads", "mamba_head_dim", lambda d: _expand(d, "expand")),
    ("n_mamba_heads", "mamba_headdim", lambda d: _expand(d, "mamba_expand")),
    ("num_heads", "head_dim", lambda d: _expand(d, "expand") if "state_size" in d else None),  # Mamba-2
)


def _fit_ssm_heads(f) -> None:
    """SSM heads x head size = the SSM inner width (Mamba-2 style): at most 4 heads, the head size follows."""
    d = f.d
    for heads, size, inner in _SSM:
        width = inner(d)
        if isinstance(d.get(heads), int) and isinstance(d.get(size), int) and width:
            groups = next((d[g] for g in SSM_GROUPS if isinstance(d.get(g), int)), 1)
            d[heads] = max(groups, min(d[heads], 4))
            d[size] = width // d[heads]


def clean(f) -> dict[str, Any]:
    """The dict the config class is rebuilt from."""
    if f.model_type == "dbrx":  # its sub-config classes take no base-class keys
        for key in ("attn_config", "ffn_config"):
            for k in ("_name_or_path", "output_attentions", "transformers_version", "model_type"):
                f.d[key].pop(k, None)
    return f.d
