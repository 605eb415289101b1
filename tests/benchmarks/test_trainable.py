"""benchmarks.common.set_trainable: what each --trainable choice trains, and that oomb's step runs on the result."""

import pytest
import torch

import oomb
from benchmarks.common import LORA_RANK, TRAINABLE, set_trainable
from oomb.surgery.lora import use_fused_lora
from oomb.train.config.presets import build_model


def _model():
    torch.manual_seed(0)
    return build_model("tiny", dtype=torch.float32, device="cpu")


def test_all_and_attention():
    model, trained = set_trainable(_model(), "all")
    assert len(trained) == len(list(model.parameters()))
    model, trained = set_trainable(_model(), "attention")
    names = {id(p): n for n, p in model.named_parameters()}
    assert trained and all(".self_attn." in names[id(p)] for p in trained)


@pytest.mark.parametrize("which", ["lora", "lora-unfused"])
def test_lora_trains_the_adapters_only_and_steps(which):
    model, trained = set_trainable(_model(), which)
    names = {id(p): n for n, p in model.named_parameters()}
    assert trained and all("lora_" in names[id(p)] for p in trained)
    # every linear layer of the decoder adapted, at the bench's rank
    a = [p for p in trained if "lora_A" in names[id(p)]]
    assert {p.shape[0] for p in a} == {LORA_RANK}
    layers = model.config.num_hidden_layers
    assert len(a) == 7 * layers  # q, k, v, o, gate, up, down
    if which == "lora":
        assert len(use_fused_lora(model)) == 7 * layers
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    # B starts at zero, so only B's gradients are nonzero after the first step
    b = [p for p in trained if "lora_B" in names[id(p)]]
    assert len(b) == len(a) and all(p.grad is not None and p.grad.abs().sum() > 0 for p in b)


def test_unknown_choice_refused():
    with pytest.raises(ValueError, match="choose one of"):
        set_trainable(_model(), "experts")
    assert "lora" in TRAINABLE
