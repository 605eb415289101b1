"""Bad input is refused with a message that says what to change, before any work starts."""

import copy

import pytest
import torch
from planning import plan_of
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
    # Layer 1 keeps its own config object, so switching the model to oomb's attention (or the check's) misses it.
    model.model.layers[1].self_attn.config = copy.deepcopy(model.config)
    with pytest.raises(ValueError, match=r"decoder layers \[1\] make no attention call through AttentionInterface"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 40)), chunk_size=16, page_size=16)
    _untouched(model)
    assert store_for_model(model) is None  # refused before the store was made
    assert model.config._attn_implementation == "eager"


def test_not_a_transformers_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        oomb.chunked_backward(torch.nn.Linear(2, 2), torch.zeros(1, 8, dtype=torch.long))


def test_attention_dropout_refused():
    model = tiny_model("llama", attention_dropout=0.1)
    model.train()
    with pytest.raises(ValueError, match=r"attention dropout 0.1 \(set attention_dropout=0 in the config\) in "
                                         r"model.layers.0.self_attn, model.layers.1.self_attn"):
        oomb.chunked_backward(model, torch.zeros(1, 8, dtype=torch.long))


def test_oomb_attention_outside_a_step_raises(model):
    model.set_attn_implementation("oomb")
    with pytest.raises(RuntimeError, match="only runs inside oomb.chunked_backward"):
        model(torch.zeros(1, 4, dtype=torch.long))


def _nothing_allocated(model):
    _untouched(model)
    assert store_for_model(model) is None  # refused before the store was built


@pytest.mark.parametrize("labels", [
    torch.ones(1, 8, dtype=torch.bool),
    torch.full((1, 8), 3.0),
    torch.full((1, 8), 3.0, dtype=torch.bfloat16),
], ids=["bool", "float32", "bfloat16"])
def test_labels_that_are_not_integers_are_refused(model, labels):
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(TypeError, match=f"labels must be an integer tensor of token ids.*got {labels.dtype}"):
        oomb.chunked_backward(model, ids, labels)
    _nothing_allocated(model)
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        oomb.engine.chunked_eval(model, ids, labels)


@pytest.mark.parametrize("grad_dtype", [torch.int8, torch.int32, torch.bool, "float32"])
def test_grad_dtype_must_be_floating(model, grad_dtype):
    with pytest.raises(TypeError, match="grad_dtype must be a floating-point torch dtype"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 64)), chunk_size=32, page_size=16,
                              grad_dtype=grad_dtype)
    _nothing_allocated(model)


@pytest.mark.parametrize("option,value", [
    ("chunk_size", True), ("page_size", True), ("chunk_size", 32.0), ("page_size", "16"),
    ("offload_gpu_bytes", True), ("page_budget", True), ("page_budget", 2.5),
])
def test_integer_options_refuse_bools_and_non_integers(model, option, value):
    kw = {"chunk_size": 32, "page_size": 16, "offload": option == "offload_gpu_bytes", option: value}
    with pytest.raises(TypeError, match=f"{option} must be an integer, got {value!r}"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 64)), **kw)
    _nothing_allocated(model)


def test_selection_fields_refuse_bools(model):
    from oomb.sparse import PageSelection

    with pytest.raises(TypeError, match="selection.block must be an integer, got True"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 64)), chunk_size=32, page_size=16,
                              selection=PageSelection(page_budget=2, block=True))
    _nothing_allocated(model)


def test_flags_must_be_bools(model):
    with pytest.raises(TypeError, match="offload must be True or False"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 64)), chunk_size=32, page_size=16, offload="yes")
    _nothing_allocated(model)


def test_unknown_loss_impl_refused_before_the_step(model):
    # Before, the name was checked by the first chunk's loss, after stage 1 had run.
    with pytest.raises(ValueError, match="unknown cross-entropy implementation loss_impl='fast'"):
        oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 64)), chunk_size=32, page_size=16,
                              loss_impl="fast")
    _nothing_allocated(model)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=0,
                     eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96,
                    max_position_embeddings=256, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
    return OPTForCausalLM(cfg)


@pytest.mark.parametrize("build,mlp", [(_gpt2, 4 * 64), (_opt, 96)])
def test_configs_that_name_their_sizes_otherwise_train_and_are_planned(build, mlp):
    # GPT-2 names its MLP width n_inner (None: 4 x hidden), OPT ffn_dim; the store is shaped by the calls.
    from oomb.engine.sizes import ModelShape

    model = build()
    loss = oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 64)), chunk_size=32, page_size=16)
    assert torch.isfinite(loss)
    assert ModelShape.from_config(model.config).intermediate == mlp
    assert plan_of(model.config, seq_len=1024, device_type="cpu").host_bytes > 0


def test_a_config_without_the_sizes_the_planner_reads_is_refused_by_it():
    from transformers import MambaConfig


    with pytest.raises(ValueError, match=r"cannot plan the memory of 'mamba' models.*has no num_attention_heads.*"
                                         r"train.memory_check=false"):
        plan_of(MambaConfig(), seq_len=1024)
