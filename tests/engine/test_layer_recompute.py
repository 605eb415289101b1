"""recompute="layer" / "layer-host": stage 2 one decoder layer at a time from the inputs stage 1 kept.

The same loss and gradients as recompute="chunk" and as full-sequence training (fp32, CPU), for every
family, with documents, page-sparse attention, the attention cache and LoRA; one layer's activations
alive at a time; the layers' own settings back after the step; refused where it cannot run.
"""

import pytest
import torch
from helpers import rel_err
from test_chunked_backward import _assert_same_training, _full_sequence_grads
from tiny_models import FAMILIES, VOCAB, tiny_model

import oomb
from oomb.engine import StepOptions
from oomb.engine.layer_recompute import LayerInputs, LayerRecompute, decoder_layers
from oomb.sparse import PageSelection

TOL = 1e-5


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recompute", ["layer", "layer-host"])
def test_every_family_equals_full_sequence(family, recompute):
    model = tiny_model(family)
    model.train()
    ids = torch.randint(0, VOCAB, (2, 150))  # 5 chunks of 32, ragged last chunk and page
    _assert_same_training(model, ids, chunk_size=32, page_size=16, recompute=recompute)


def test_same_gradients_as_chunk_recompute_with_documents_sparse_and_the_cache():
    # Every recompute mode with the attention cache off, on the device and in host memory: the loss and
    # gradients of recompute="chunk" without the cache.
    model = tiny_model("qwen2")  # a sliding-window layer, q/k/v biases
    model.train()
    ids = torch.randint(0, VOCAB, (2, 200))
    docs = torch.cat([torch.zeros(2, 70, dtype=torch.long), torch.ones(2, 130, dtype=torch.long)], dim=1)
    labels = ids.clone()
    labels[:, 70] = -100
    selection = PageSelection(page_budget=2, block=16, sink_pages=1, local_pages=1)
    results = {}
    for recompute in ("chunk", "layer", "layer-host"):
        for cache in (False, True, "host"):
            model.zero_grad(set_to_none=True)
            loss = oomb.chunked_backward(model, ids, labels, doc_ids=docs, chunk_size=32, page_size=16,
                                         selection=selection, cache_attention=cache, recompute=recompute)
            results[recompute, cache] = loss, _grads(model)
    loss, grads = results["chunk", False]
    for key, (other_loss, other) in results.items():
        assert rel_err(other_loss, loss) <= TOL, key
        assert other.keys() == grads.keys()
        assert max(rel_err(other[n], grads[n]) for n in grads) <= TOL, key


def test_the_host_cache_is_read_not_recomputed(monkeypatch):
    # With cache_attention="host" stage 2 attends no chunk again: every chunk's outputs come back from host
    # memory, so the attention forward runs once per chunk and layer (stage 1; by layer it runs the last
    # chunk too, whole-chunk recompute runs the last chunk in stage 2 only).
    from oomb.kernels import reference

    model = tiny_model("llama")
    model.train()
    ids = torch.randint(0, VOCAB, (1, 128))  # 4 chunks of 32
    layers = model.config.num_hidden_layers
    calls = []
    forward = reference.paged_attention_forward
    monkeypatch.setattr(reference, "paged_attention_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    for recompute in ("chunk", "layer-host"):
        calls.clear()
        oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, cache_attention="host", recompute=recompute,
                              backend="torch")
        assert len(calls) == 4 * layers, recompute
        calls.clear()
        oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, cache_attention=False, recompute=recompute,
                              backend="torch")
        assert len(calls) == (7 if recompute == "chunk" else 8) * layers, recompute  # stage 2 attends again


def test_one_chunk_only_and_the_shortest_sequence():
    model = tiny_model("llama")
    model.train()
    _assert_same_training(model, torch.randint(0, VOCAB, (1, 40)), chunk_size=64, page_size=16, recompute="layer")
    _assert_same_training(model, torch.randint(0, VOCAB, (1, 2)), chunk_size=16, page_size=16, recompute="layer")


def test_lora_with_a_frozen_embedding_trains_every_adapter():
    # Nothing before the first layer needs a gradient: the replayed layers' backward must still run.
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_model("qwen3"),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    )
    model.train()
    ids = torch.randint(0, VOCAB, (1, 100))
    ref_loss, ref_grads = _full_sequence_grads(model, ids, ids)
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, recompute="layer-host")
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert rel_err(loss, ref_loss) <= TOL
    assert grads.keys() == ref_grads.keys() and all("lora_" in n for n in grads)
    assert max(rel_err(grads[n], ref_grads[n]) for n in grads) <= TOL


def _saved_bytes_at_peak(model, ids, recompute: str) -> int:
    """Saved bytes alive at the peak of a step, counted by packing hooks that forget a tensor when autograd
    releases it."""
    live, peak = [0], [0]

    class Saved:
        def __init__(self, t):
            self.t, self.n = t, (0 if isinstance(t, torch.nn.Parameter) else t.numel() * t.element_size())
            live[0] += self.n
            peak[0] = max(peak[0], live[0])

        def __del__(self):
            live[0] -= self.n

    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda s: s.t):
        oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, recompute=recompute)
    return peak[0]


def test_activation_memory_is_one_layer():
    # "layer" keeps about one layer's saved tensors alive (1/4.2 of "chunk"'s with four layers).
    model = tiny_model("llama", num_hidden_layers=4)
    model.train()
    ids = torch.randint(0, VOCAB, (1, 64))
    chunk, layer = (_saved_bytes_at_peak(model, ids, r) for r in ("chunk", "layer"))
    assert layer < 0.45 * chunk, (layer, chunk)


def test_the_layers_settings_are_restored_also_after_an_error():
    model = tiny_model("llama")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    names = ("gradient_checkpointing", "_gradient_checkpointing_func")

    def settings():
        return [{n: layer.__dict__[n] for n in names if n in layer.__dict__} for layer in decoder_layers(model)]

    before = settings()
    ids = torch.randint(0, VOCAB, (1, 64))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, recompute="layer")
    assert settings() == before
    model.gradient_checkpointing_disable()
    before = settings()
    calls = []

    def fail_on_the_second_chunk(module, args, out):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a layer failed")

    decoder_layers(model)[1].register_forward_hook(fail_on_the_second_chunk)
    with pytest.raises(RuntimeError, match="a layer failed"):
        oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, recompute="layer")
    assert settings() == before


def test_refused_where_it_cannot_run():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 64))
    model.eval()
    with pytest.raises(ValueError, match=r"eval mode.*model\.train\(\)"):
        oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, recompute="layer")
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="recompute='sideways': use one of chunk, layer, layer-host"):
        StepOptions(recompute="sideways")
    # with offload: one layer rebuilt at a time and the cache in host memory (tests/offload/test_offload.py)
    assert StepOptions(recompute="layer-host", offload=True, cache_attention="host").offload
    with pytest.raises(TypeError, match="cache_attention must be True, False or 'host', got 'gpu'"):
        StepOptions(cache_attention="gpu")


def test_a_decoder_that_computes_between_layers_is_refused():
    # Stage 2 hands placeholders from layer to layer: only a decoder that passes each output straight on
    # may be replayed. An input that is not the previous layer's output is refused, in both stages.
    model = tiny_model("llama")
    model.train()
    replay = LayerRecompute(model, LayerInputs(), set())
    x = torch.randn(1, 32, 16)
    for stage in ("fill", "recompute"):
        replay.begin_chunk(stage, 0, 32)
        if stage == "recompute":
            replay.inputs.keep(2, 0, x)
        out = replay.call(0, lambda h: h + 1, x)
        with pytest.raises(RuntimeError, match="computes between its layers"):
            replay.call(1, lambda h: h + 1, out * 2.0)
    with pytest.raises(RuntimeError, match="hidden states as the one positional argument"):
        replay.call(0, lambda **kw: x)  # hidden states passed by keyword: nothing to keep
    with pytest.raises(ValueError, match="GradientCheckpointingLayers"):
        model.get_decoder().layers[0] = torch.nn.Identity()
        decoder_layers(model)


def test_the_host_buffer_is_kept_between_steps_and_freed_with_the_store():
    # Zeroing and pinning tens of GiB takes seconds: once per run, not once per step.
    from oomb.engine import host_stash

    model = tiny_model("llama")
    model.train()
    ids = torch.randint(0, VOCAB, (1, 64))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, recompute="layer-host")
    first, _ = host_stash._BUFFERS[model]["layer inputs"]
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    assert first.numel() == (layers + 1) * 2 * host_stash.region_bytes((1, 32, hidden), torch.float32)
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, recompute="layer-host")
    assert host_stash._BUFFERS[model]["layer inputs"][0] is first
    oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 96)), chunk_size=32, page_size=16, recompute="layer-host")
    assert host_stash._BUFFERS[model]["layer inputs"][0].numel() > first.numel()  # longer: a larger one
    oomb.release_memory(model)
    assert model not in host_stash._BUFFERS


def test_under_torchrun_the_config_is_refused_before_the_run(monkeypatch):
    # refused where the other settings torchrun does not support are: before the process group starts
    from oomb.train.config.settings import ConfigError, load_config
    from oomb.train.loop import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    class GroupStarted(Exception):
        pass

    def start(*args, **kwargs):
        raise GroupStarted

    monkeypatch.setattr(distributed.dist, "init_process_group", start)
    with pytest.raises(ConfigError, match="train.recompute=layer-host runs in one process only"):
        distributed.setup(load_config(None, ["train.recompute=layer-host", "train.device=cpu"]))
    with pytest.raises(GroupStarted):  # auto passes the checks (it never picks layer under torchrun)
        distributed.setup(load_config(None, ["train.recompute=auto", "train.device=cpu"]))


def test_which_decoders_a_plan_may_rebuild_layer_by_layer():
    # asked of a config before the model exists (train.recompute=auto): built on the meta device and checked
    from transformers import GPT2Config

    from oomb.engine.layer_recompute import layers_rebuildable
    from oomb.train.config.presets import preset_config

    assert layers_rebuildable(preset_config("qwen2.5-7b")) and layers_rebuildable(preset_config("tiny"))
    assert not layers_rebuildable(GPT2Config(n_layer=2, n_embd=64, n_head=2))  # its blocks are no
    # GradientCheckpointingLayers: recompute="layer" would refuse it at the first step
