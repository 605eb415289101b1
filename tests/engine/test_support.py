"""The check of a model before any work (oomb.engine.support): what it finds, what it refuses, and where.

The sweep (tests/models/) runs every family; these tests pin the mechanisms on small hand-made cases: the store
shaped by the model's own calls, the logit transform the loss applies, a window only in the mask seen on the tiny
copy, randomness, RoPE held at the sequence's length, and the refusal at each entry point (chunked_backward,
oomb plan, oomb train, OombTrainer) before anything is built, written or trained.
"""

import pytest
import torch
from helpers import rel_err
from tiny_models import VOCAB, tiny_model
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, LlamaConfig, Qwen2MoeConfig

import oomb
from oomb.cache import PageShape
from oomb.cli import main
from oomb.engine.step import check_architecture
from oomb.engine.support import UnsupportedModel, model_support

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, attention_dropout=0.0)


def _model(config, **kw):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", **kw).float().train()


def _same_training(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    ref_loss = model(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, **kw)
    assert rel_err(loss, ref_loss) <= 1e-5
    for n, p in model.named_parameters():
        if n in ref:
            assert rel_err(p.grad, ref[n]) <= 1e-5, n


def test_the_store_takes_its_shape_from_the_calls_not_the_config():
    model = tiny_model("qwen3")  # head_dim 16 set apart from hidden / heads
    support = model_support(model)
    assert support.page_shapes == (PageShape(kv_heads=2, key_dim=16, value_dim=16),) * 2
    assert [s.layer for s in support.sites] == [0, 1] and support.transform.is_identity


def test_logit_scaling_is_applied_by_the_fused_loss():
    model = _model(CohereConfig(**SMALL, logit_scale=0.125))
    assert model_support(model).transform.logit_scale == pytest.approx(0.125)
    _same_training(model, torch.randint(0, VOCAB, (1, 70)))


def test_final_soft_capping_is_applied_by_the_fused_loss():
    # Gemma 2 soft-caps attention too (refused); the final cap alone, on a model that attends plainly:
    config = Gemma2Config(**SMALL, head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=3.0,
                          sliding_window=20)
    model = _model(config)
    assert model_support(model).transform.softcap == 3.0
    _same_training(model, torch.randint(0, VOCAB, (1, 70)))


def test_attention_soft_capping_is_refused_naming_it():
    model = _model(Gemma2Config(**SMALL, head_dim=16))
    with pytest.raises(UnsupportedModel, match=r"attention logit soft-capping \(50.0\)"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 40)))
    assert all(p.grad is None for p in model.parameters())


def test_a_window_only_in_the_mask_is_seen_on_the_tiny_copy():
    # Qwen2-MoE builds its sliding-window mask but never passes the window to the attention call.
    config = Qwen2MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, use_sliding_window=True, sliding_window=4096,
                            max_window_layers=2)
    with pytest.raises(UnsupportedModel, match="a window or chunks applied only through the attention mask"):
        check_architecture(config)


def test_a_forward_that_is_random_in_training_is_refused_naming_the_field():
    model = tiny_model("llama")
    model.config.attention_dropout = 0.0
    for layer in model.model.layers:  # dropout on the MLP output: stage 2 would recompute other masks
        layer.mlp.down_proj = torch.nn.Sequential(layer.mlp.down_proj, torch.nn.Dropout(0.1))
    with pytest.raises(UnsupportedModel, match="random in training mode"):
        model_support(model.train())
    model.eval()
    assert model_support(model) is not None  # in eval mode the same model is deterministic


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 4.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                                   "original_max_position_embeddings": 48}])
def test_rope_that_depends_on_the_length_is_held_at_the_sequence_s(rope):
    # Chunks of 32 of a 100-token sequence: unheld, the first chunks would rotate with the short frequencies.
    config = LlamaConfig(**{**SMALL, "max_position_embeddings": 48}, rope_parameters={"rope_theta": 10000.0, **rope})
    _same_training(_model(config), torch.randint(0, VOCAB, (1, 100)))


def test_a_config_oomb_cannot_train_is_refused_by_plan_and_train_before_work(tmp_path, capsys):
    folder = tmp_path / "gemma2"
    _model(Gemma2Config(**SMALL, head_dim=16)).save_pretrained(folder)
    assert main(["plan", f"model.path={folder}", "data.seq_len=256"]) == 2
    assert "attention logit soft-capping" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", f"model.path={folder}", f"out_dir={run}", "data.seq_len=256", "train.steps=1"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "attention logit soft-capping" in out and "docs/models.md" in out
    assert not run.exists()  # nothing written


def test_the_trainer_refuses_it_when_constructed(tmp_path):
    from transformers import TrainingArguments

    from oomb.integrations import OombTrainer

    with pytest.raises(UnsupportedModel, match="attention logit soft-capping"):
        OombTrainer(model=_model(Gemma2Config(**SMALL, head_dim=16)),
                    args=TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True))


def test_a_model_is_checked_once():
    model = tiny_model("llama")
    first = model_support(model)
    assert model_support(model) is first
    model.config.tie_word_embeddings = not model.config.tie_word_embeddings  # another config: checked again
    assert model_support(model) is not first
