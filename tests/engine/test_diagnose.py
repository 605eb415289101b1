"""The NaN locator runs with the failing step's options: its chunks, its store (offloaded or on the
device, the same object and spec: nothing new is allocated) and its page selection."""

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import oomb
import oomb.attention.function as attention_function
from oomb.cache import PagedKVStore
from oomb.engine import StepOptions, store_for_model
from oomb.engine.diagnose import locate_nonfinite
from oomb.offload import OffloadedKVStore
from oomb.sparse import PageSelection

POISONED_CHUNK_START = 96  # chunk 3 of 7 (chunks of 32 tokens over 200)


def _poison_layer_1(model):
    """NaN in the output of decoder layer 1 for the chunk that starts at POISONED_CHUNK_START."""
    def poison(module, args, kwargs, output):
        if int(kwargs["position_ids"][0, 0]) == POISONED_CHUNK_START:
            output = output.clone()
            output[:, 3] = float("nan")
        return output

    return model.model.layers[1].register_forward_hook(poison, with_kwargs=True)


@pytest.fixture
def store_builds(monkeypatch):
    """Every store constructed while the test runs, by kind."""
    built = []
    for kind in (PagedKVStore, OffloadedKVStore):
        original = kind.__init__

        def init(self, *args, _original=original, _kind=kind, **kwargs):
            built.append(_kind.__name__)
            _original(self, *args, **kwargs)

        monkeypatch.setattr(kind, "__init__", init)
    return built


@pytest.fixture
def selections(monkeypatch):
    """How many page selections ran (sparse attention past the budget)."""
    calls = []
    original = attention_function.select_pages
    monkeypatch.setattr(attention_function, "select_pages", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("offload", [True, False], ids=["offloaded-sparse", "device-sparse"])
def test_locator_runs_the_failing_steps_store_and_selection(offload, store_builds, selections):
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 200))
    doc_ids = (torch.arange(200) >= 150).long().expand(2, -1)  # packed documents travel with the batch
    options = StepOptions(chunk_size=32, page_size=8, selection=PageSelection(page_budget=3, block=16),
                          offload=offload)
    handle = _poison_layer_1(model)
    loss = oomb.chunked_backward(model, ids, doc_ids=doc_ids, options=options)
    assert not torch.isfinite(loss)
    store = store_for_model(model)
    assert type(store) is (OffloadedKVStore if offload else PagedKVStore)
    spec, built_by_step = store.spec, len(store_builds)
    assert built_by_step == 1 and selections

    selections.clear()
    site = locate_nonfinite(model, ids, options=options, doc_ids=doc_ids)
    handle.remove()
    assert (site.chunk, site.num_chunks, site.start, site.end) == (3, 7, 96, 128)
    assert (site.layer, site.module) == (1, "model.layers.1")
    assert len(store_builds) == built_by_step  # no store built: the locator used the step's
    assert store_for_model(model) is store and store.spec == spec
    assert store.num_tokens == 0 and not store.chunks  # and left it empty
    assert selections  # attention was sparse, as in the step


def test_locator_finds_nothing_in_a_finite_offloaded_step(store_builds):
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (1, 100))
    options = StepOptions(chunk_size=32, page_size=8, selection=PageSelection(page_budget=2, block=32),
                          offload=True)
    assert torch.isfinite(oomb.chunked_backward(model, ids, options=options))
    assert locate_nonfinite(model, ids, options=options) is None
    assert store_builds == ["OffloadedKVStore"]


def test_locator_needs_options():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 64))
    with pytest.raises(TypeError, match="options"):
        locate_nonfinite(model, ids)
    with pytest.raises(TypeError, match="options must be an oomb.engine.StepOptions"):
        locate_nonfinite(model, ids, options={"chunk_size": 32})
