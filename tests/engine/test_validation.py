"""Bad input is refused with a message that says what to change, before any work starts."""

import copy

import pytest
import torch
from tiny_models import VOCAB, tiny_config, tiny_model
from transformers import LlamaForCausalLM

import oomb
from oomb.engine import store_for_model


@pytest.fixture
def model():
    return tiny_model("llama")


def _untouched(model):
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "ids,match",
    [
        (torch.zeros(1, 1, dtype=torch.long), "at least 2 tokens"),
        (torch.zeros(1, 0, dtype=torch.long), "at least 2 tokens"),
        (torch.zeros(0, 8, dtype=torch.long), "at least 1 sequence"),
        (torch.zeros(8, dtype=torch.long), r"\[batch, seq_len\]"),
        (torch.zeros(1, 8), "integer tensor"),
        (torch.full((1, 8), VOCAB), r"\[0, 101\)"),
        (torch.full((1, 8), -1), r"\[0, 101\)"),
    ],
)
def test_bad_input_ids(model, ids, match):
    with pytest.raises((ValueError, TypeError), match=match):
        oomb.chunked_backward(model, ids)
    _untouched(model)


def test_chunk_not_multiple_of_page(model):
    with pytest.raises(ValueError, match="chunk_size=100 is not a multiple of page_size=64.*try chunk_size=64"):
        oomb.chunked_backward(model, torch.zeros(1, 8, dtype=torch.long), chunk_size=100, page_size=64)
    _untouched(model)


@pytest.mark.parametrize("chunk,page", [(0, 16), (16, 0), (-16, 16)])
def test_non_positive_sizes(model, chunk, page):
    with pytest.raises(ValueError, match="must be positive"):
        oomb.chunked_backward(model, torch.zeros(1, 8, dtype=torch.long), chunk_size=chunk, page_size=page)


def test_labels_of_another_shape(model):
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(1, 8\)"):
        oomb.chunked_backward(model, torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long))
    _untouched(model)


def test_labels_out_of_vocabulary(model):
    labels = torch.zeros(1, 8, dtype=torch.long)
    labels[0, 3] = 500
    with pytest.raises(ValueError, match="labels must be -100 or lie in"):
        oomb.chunked_backward(model, torch.zeros(1, 8, dtype=torch.long), labels)


def test_no_targets(model):
    with pytest.raises(ValueError, match="no position has a target"):
        oomb.chunked_backward(model, torch.zeros(1, 8, dtype=torch.long), torch.full((1, 8), -100))
    _untouched(model)


def test_model_without_attention_interface():
    class OpaqueLlama(LlamaForCausalLM):
        # What transformers concludes for a model whose attention class does not call
        # ALL_ATTENTION_FUNCTIONS (it inspects the modeling source).
        _can_set_attn_implementation_cached_value = False

    model = OpaqueLlama(tiny_config("llama"))
    with pytest.raises(ValueError, match="does not route its attention through transformers' AttentionInterface"):
        oomb.chunked_backward(model, torch.zeros(1, 8, dtype=torch.long))
    _untouched(model)


def test_layer_that_bypasses_oomb_is_caught(model):
    # Layer 1 keeps its own config object, so switching the model to oomb's attention misses it.
    model.model.layers[1].self_attn.config = copy.deepcopy(model.config)
    with pytest.raises(RuntimeError, match=r"attention layers \[1\] did not go through oomb"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 40)), chunk_size=16, page_size=16)
    _untouched(model)
    assert store_for_model(model).num_used_pages == 0  # the failed step left the store empty
    assert model.config._attn_implementation == "eager"


def test_not_a_transformers_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        oomb.chunked_backward(torch.nn.Linear(2, 2), torch.zeros(1, 8, dtype=torch.long))


def test_attention_dropout_refused():
    model = tiny_model("llama", attention_dropout=0.1)
    model.train()
    with pytest.raises(ValueError, match="attention_dropout"):
        oomb.chunked_backward(model, torch.zeros(1, 8, dtype=torch.long))


def test_oomb_attention_outside_a_step_raises(model):
    model.set_attn_implementation("oomb")
    with pytest.raises(RuntimeError, match="only runs inside oomb.chunked_backward"):
        model(torch.zeros(1, 4, dtype=torch.long))
