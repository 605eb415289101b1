"""tiny_twin_config keeps every feature of a config at toy sizes (oomb/engine/twin.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    CohereConfig,
    DeepseekV3Config,
    Gemma3Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTBigCodeConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    T5Config,
)

from oomb.engine.twin import TwinUnavailable, tiny_twin_config
from tests.models.families import sweep_config

S, F = "sliding_attention", "full_attention"


def _params(config) -> int:
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return sum(p.numel() for p in model.parameters())


def test_gemma3_keeps_five_local_to_one_global():
    twin = tiny_twin_config(Gemma3TextConfig())
    assert twin.layer_types == [S] * 5 + [F]
    assert twin.num_hidden_layers == 6 and twin.sliding_window == 24
    assert twin.num_key_value_heads < twin.num_attention_heads  # GQA as in the original
    assert twin.rope_parameters[S]["rope_theta"] != twin.rope_parameters[F]["rope_theta"]


def test_gpt_oss_keeps_alternating_windows_yarn_and_experts():
    config = GptOssConfig()
    twin = tiny_twin_config(config)
    assert twin.layer_types == [S, F] and twin.sliding_window == 24
    assert twin.num_local_experts > twin.num_experts_per_tok > 1
    assert twin.rope_parameters["rope_type"] == "yarn"
    assert twin.rope_parameters["factor"] == config.rope_parameters["factor"]
    assert twin.rope_parameters["original_max_position_embeddings"] == 64  # a 96-token step goes past it
    assert twin.attention_bias


def test_qwen2_windows_from_max_window_layers():
    twin = tiny_twin_config(Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=28))
    assert twin.layer_types == [F, S]
    assert twin.max_window_layers == 1 and twin.sliding_window == 24


def test_first_k_dense_and_latent_attention_of_deepseek_v3():
    config = DeepseekV3Config()
    twin = tiny_twin_config(config)
    assert twin.first_k_dense_replace == 1 and twin.num_hidden_layers == 2  # one dense layer, one MoE layer
    assert twin.qk_head_dim == twin.qk_nope_head_dim + twin.qk_rope_head_dim
    assert twin.qk_head_dim != twin.v_head_dim  # key and value heads of different sizes, as in the original
    assert twin.q_lora_rank != twin.kv_lora_rank and twin.kv_lora_rank < twin.hidden_size
    assert twin.n_routed_experts % twin.n_group == 0 and twin.topk_group < twin.n_group
    assert twin.n_routed_experts > twin.num_experts_per_tok and twin.n_shared_experts == 1


@pytest.mark.parametrize(
    "config, kv",
    [(LlamaConfig(), "mha"), (Qwen3Config(num_key_value_heads=8), "gqa"), (GPTBigCodeConfig(), "mqa")],
    ids=["mha", "gqa", "mqa"],
)
def test_key_value_heads_keep_their_kind(config, kv):
    twin = tiny_twin_config(config)
    heads = twin.num_attention_heads
    kv_heads = 1 if getattr(twin, "multi_query", False) else twin.num_key_value_heads
    assert {"mha": kv_heads == heads, "gqa": 1 < kv_heads < heads, "mqa": kv_heads == 1}[kv]


def test_multipliers_scales_and_dropouts_are_kept():
    granite = GraniteConfig(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                            attention_multiplier=0.0078125, attention_dropout=0.1)
    twin = tiny_twin_config(granite)
    for key in ("embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier",
                "attention_dropout"):
        assert getattr(twin, key) == getattr(granite, key), key
    assert tiny_twin_config(CohereConfig(logit_scale=0.125)).logit_scale == 0.125
    gpt2 = tiny_twin_config(GPT2Config())
    assert (gpt2.resid_pdrop, gpt2.embd_pdrop, gpt2.attn_pdrop) == (0.1, 0.1, 0.1)
    assert gpt2.tie_word_embeddings and not tiny_twin_config(LlamaConfig()).tie_word_embeddings


def test_only_fields_the_config_has_and_the_original_untouched():
    config = OlmoeConfig()
    before = config.to_dict()
    twin = tiny_twin_config(config)
    assert config.to_dict() == before
    assert set(twin.to_dict()) == set(before)  # nothing added: OLMoE has no sliding_window, the twin neither
    assert not hasattr(twin, "sliding_window")


def test_token_ids_inside_the_vocabulary():
    twin = tiny_twin_config(Gemma3TextConfig(bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0), vocab=128)
    assert twin.vocab_size == 128
    assert twin.bos_token_id == 2 and twin.pad_token_id == 0
    assert all(0 <= t < 128 for t in twin.eos_token_id) and len(set(twin.eos_token_id)) == 2
    gpt2 = tiny_twin_config(GPT2Config())  # bos = eos = 50256: one id in the twin too
    assert gpt2.bos_token_id == gpt2.eos_token_id < 128


def test_partial_rotary_factor_fits_the_head():
    from transformers import GlmConfig
    twin = tiny_twin_config(GlmConfig())
    factor = twin.rope_parameters["partial_rotary_factor"]
    assert factor == 0.5 and int(twin.head_dim * factor) % 2 == 0


def test_composite_gives_its_text_model():
    twin = tiny_twin_config(Gemma3Config())
    assert type(twin) is Gemma3TextConfig and twin.layer_types == [S] * 5 + [F]


class _RemoteCodeConfig(PretrainedConfig):
    """A trust_remote_code decoder's config: its own class, the usual field names, its own window pattern."""

    model_type = "my_decoder"

    def __init__(self, vocab_size=50000, hidden_size=3072, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=24, num_key_value_heads=8, sliding_window=2048, layer_types=None,
                 qk_layernorm=True, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.sliding_window = num_key_value_heads, sliding_window
        self.qk_layernorm = qk_layernorm
        self.layer_types = layer_types or [F if (i + 1) % 3 == 0 else S for i in range(num_hidden_layers)]
        super().__init__(**kwargs)


def test_a_remote_code_config_takes_the_generic_path():
    config = _RemoteCodeConfig(auto_map={"AutoModelForCausalLM": "modeling_my.MyForCausalLM"}, eos_token_id=49999)
    twin = tiny_twin_config(config)
    assert type(twin) is _RemoteCodeConfig
    assert twin.layer_types == [S, S, F] and twin.num_hidden_layers == 3 and twin.sliding_window == 24
    assert (twin.hidden_size, twin.num_attention_heads, twin.num_key_value_heads) == (64, 4, 2)
    assert twin.intermediate_size < 256 and twin.qk_layernorm and twin.eos_token_id < twin.vocab_size == 128


def test_kv_sharing_layers_are_recounted():
    from transformers import Gemma3nTextConfig
    twin = tiny_twin_config(Gemma3nTextConfig())
    shared = twin.layer_types[twin.num_hidden_layers - twin.num_kv_shared_layers:]
    assert 0 < twin.num_kv_shared_layers < twin.num_hidden_layers and set(shared) == {S, F}


def test_not_a_decoder_is_refused_with_a_reason():
    with pytest.raises(TwinUnavailable, match="t5: transformers has no causal LM"):
        tiny_twin_config(T5Config())
    with pytest.raises(TwinUnavailable, match="is_decoder=True"):
        tiny_twin_config(BertConfig())
    with pytest.raises(TwinUnavailable, match="musicgen"):
        sweep_config("musicgen")


@pytest.mark.parametrize("config", [LlamaConfig(), Gemma3TextConfig(), DeepseekV3Config(), GptOssConfig(),
                                    OlmoeConfig()], ids=lambda c: c.model_type)
def test_twins_are_small(config):
    assert _params(tiny_twin_config(config)) < 2_000_000


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text", "gpt_oss", "deepseek_v3", "granite", "bart"])
def test_sweep_twin_trains_one_step(model_type):
    config = sweep_config(model_type)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = torch.randint(3, config.vocab_size, (2, 96))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0
