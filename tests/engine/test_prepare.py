"""StepOptions: one object for the step, evaluation and the NaN locator, checked when made; the
keywords of chunked_backward and chunked_eval still work and mean the same."""

import dataclasses

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import oomb
from oomb.cache import PagedKVStore
from oomb.engine import StepOptions, chunked_eval, store_for_model
from oomb.engine.options import options_from_keywords
from oomb.engine.prepare import prepare_step
from oomb.sparse import PageSelection


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_options_give_the_same_step_as_the_keywords():
    model = tiny_model("qwen3")
    ids = torch.randint(0, VOCAB, (2, 150))
    doc_ids = (torch.arange(150) >= 70).long().expand(2, -1)
    kw = dict(chunk_size=32, page_size=16, selection=PageSelection(page_budget=4, block=16, sink_pages=1))
    loss = oomb.chunked_backward(model, ids, doc_ids=doc_ids, page_budget=2, **kw)
    by_keywords = _grads(model)
    model.zero_grad(set_to_none=True)
    options = StepOptions(chunk_size=32, page_size=16,
                          selection=PageSelection(page_budget=2, block=16, sink_pages=1))  # page_budget folded in
    assert options_from_keywords(None, dict(page_budget=2, **kw), caller="chunked_backward") == options
    assert torch.equal(oomb.chunked_backward(model, ids, doc_ids=doc_ids, options=options), loss)
    by_options = _grads(model)
    assert by_options.keys() == by_keywords.keys()
    for name, grad in by_keywords.items():
        assert torch.equal(by_options[name], grad), name


def test_a_keyword_that_is_no_step_setting_is_refused_naming_the_settings():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 64))
    with pytest.raises(TypeError, match="chunked_backward.. got unexpected keyword argument.s. chunk_sise; its step "
                                        "settings are backend, cache_attention, chunk_size"):
        oomb.chunked_backward(model, ids, chunk_sise=32)
    with pytest.raises(TypeError, match="chunked_eval.. got unexpected keyword argument.s. recompute"):
        chunked_eval(model, ids, recompute="layer")  # a backward's setting
    assert model.model.layers[0].self_attn.q_proj.weight.grad is None


def test_options_and_changed_keywords_together_are_refused():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 64))
    options = StepOptions(chunk_size=32, page_size=16)
    with pytest.raises(ValueError, match="options= was given together with chunk_size, page_budget"):
        oomb.chunked_backward(model, ids, options=options, chunk_size=64, page_budget=2)
    with pytest.raises(ValueError, match="together with offload"):
        chunked_eval(model, ids, options=options, offload=True)
    assert all(p.grad is None for p in model.parameters())
    # keywords left at their defaults beside options= are not a conflict
    oomb.chunked_backward(model, ids, options=options, chunk_size=4096, backend="auto")


def test_eval_with_the_steps_options_reuses_its_store():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 100))
    options = StepOptions(chunk_size=32, page_size=8, selection=PageSelection(page_budget=3, block=16),
                          offload=True, grad_dtype=torch.float16)
    oomb.chunked_backward(model, ids, options=options)
    store = store_for_model(model)
    result = chunked_eval(model, ids, options=options)
    assert store_for_model(model) is store  # same kind, same spec (gradient dtype, key summary)
    keywords = chunked_eval(model, ids, chunk_size=32, page_size=8, selection=options.selection, offload=True)
    assert torch.equal(result.nll.nan_to_num(), keywords.nll.nan_to_num())
    assert store_for_model(model) is not store  # the keywords' store has the model's gradient dtype


@pytest.mark.parametrize("change,error,match", [
    ({"chunk_size": 48}, ValueError, "chunk_size=48 is not a multiple of page_size=32.*try chunk_size=32"),
    ({"chunk_size": 0}, ValueError, "chunk_size must be positive"),
    ({"backend": "cuda"}, ValueError, "unknown attention backend 'cuda'"),
    ({"offload_gpu_bytes": -1}, ValueError, "offload_gpu_bytes must be >= 0"),
    ({"offload_gpu_bytes": 2**20}, ValueError, "it needs offload=True"),
    ({"cache_attention": True, "offload": True}, ValueError, "use cache_attention=.host. \\(in host memory\\)"),
    ({"selection": 64}, TypeError, "selection must be an oomb.sparse.PageSelection"),
])
def test_bad_options_are_refused_when_made(change, error, match):
    with pytest.raises(error, match=match):
        dataclasses.replace(StepOptions(chunk_size=64, page_size=32), **change)


def test_forward_only_passes_do_not_cache_attention_and_allow_no_targets():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 64))
    no_targets = torch.full_like(ids, -100)
    options = StepOptions(chunk_size=32, page_size=16, cache_attention=True)
    with pytest.raises(ValueError, match="no position has a target"):
        prepare_step(model, ids, no_targets, None, options)
    prepared = prepare_step(model, ids, no_targets, None, options, forward_only=True)
    assert not prepared.context.cache_attention and prepared.context.stage == "fill"
    assert prepared.bounds == [(0, 32), (32, 64)] and prepared.target_counts == [0, 0]
    assert isinstance(prepared.store, PagedKVStore) and prepared.store is store_for_model(model)
    assert prepare_step(model, ids, None, None, options).context.cache_attention
