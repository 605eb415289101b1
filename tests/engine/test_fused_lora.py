"""peft LoRA layers with the adapter fused into the frozen matmul (oomb.surgery.lora): the same loss and adapter
gradients as peft's own forward and backward, full-sequence and through chunked_backward, fp32 and fp64, 4-bit
bases too; no gradient for the frozen weights; layers it cannot take left to peft; merge, save and state-dict
names as peft's."""

import copy

import pytest
import torch
from helpers import rel_err
from tiny_models import VOCAB, tiny_model

import oomb
from oomb.surgery.lora import fusion_refusal, plain_lora, use_fused_lora

peft = pytest.importorskip("peft")

# fp32: the fused and peft's orders of rounding differ (5e-7 to 7e-7 at most here); both are 4e-6 to 1e-5 from
# the fp64 result. fp64: the same arithmetic.
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def _lora(model, **kw):
    kw = dict(r=4, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False) | kw
    return peft.get_peft_model(model, peft.LoraConfig(**kw))  # init_lora_weights=False: B nonzero, all grads count


def _step(model, ids, chunked):
    """(loss, {name: .grad}) of one step: transformers' full-sequence loss and backward, or chunked_backward."""
    model.zero_grad(set_to_none=True)
    if chunked:
        loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    else:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        loss = out.loss.detach()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(fused, ref, ids, chunked, tol):
    ref_loss, ref_grads = _step(ref, ids, chunked)
    loss, grads = _step(fused, ids, chunked)
    assert ref_grads and all("lora_" in n for n in ref_grads)  # only the adapters train in peft's step
    assert grads.keys() == ref_grads.keys()  # ... and in the fused one: no frozen weight got a .grad
    assert rel_err(loss, ref_loss) <= tol
    errors = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: relative gradient error {errors[worst]:.2e}"
    assert all(p.grad is None for n, p in fused.named_parameters() if "lora_" not in n)


def _fused_copy(ref):
    fused = copy.deepcopy(ref)
    names = use_fused_lora(fused)
    assert len(names) == 7 * fused.config.num_hidden_layers  # q, k, v, o, gate, up, down per layer
    assert all(type(fused.get_submodule(n)).__name__.startswith("Fused") for n in names)
    return fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunked", [False, True])
def test_loss_and_adapter_gradients_equal_peft(dtype, chunked):
    ref = _lora(tiny_model("llama").to(dtype))
    fused = _fused_copy(ref)
    ids = torch.randint(0, VOCAB, (2, 150))  # 5 chunks of 32, the last ragged
    _assert_same_step(fused, ref, ids, chunked, TOL[dtype])
    # the fused path ran: its autograd node, not peft's add
    layer = fused.base_model.model.model.layers[1].mlp.down_proj
    assert "LoraLinear" in type(layer(torch.randn(3, 96, dtype=dtype, requires_grad=True)).grad_fn).__name__


@pytest.mark.parametrize("recompute,checkpointing", [("layer-host", False), ("layer", False), ("chunk", True)])
def test_layer_recompute_and_layer_checkpointing_run_the_fused_layers_exactly(recompute, checkpointing):
    # oomb train's one-GPU default rebuilds one layer at a time; transformers' checkpointing re-runs each layer
    ref = _lora(tiny_model("llama").double())
    fused = _fused_copy(ref)
    for model in (ref, fused):
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, VOCAB, (2, 100))
    results = []
    for model in (ref, fused):
        model.zero_grad(set_to_none=True)
        loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, recompute=recompute)
        results.append((loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ref_loss, want), (loss, got) = results
    assert rel_err(loss, ref_loss) <= 1e-12 and want.keys() == got.keys()
    assert max(rel_err(got[n], want[n]) for n in want) <= 1e-12


def test_a_scaling_that_is_no_power_of_two_and_q_k_v_biases():
    # qwen2's q/k/v have (frozen) biases; alpha / r = 3 is not exact in binary scaling: the same in fp64
    ref = _lora(tiny_model("qwen2").double(), r=4, lora_alpha=12)
    fused = _fused_copy(ref)
    ids = torch.randint(0, VOCAB, (1, 100))
    _assert_same_step(fused, ref, ids, True, 1e-12)


@pytest.mark.parametrize("chunked,alpha,tol", [
    (False, 16, 1e-6), (True, 16, 1e-6),
    # alpha / r = 3: s (xa B^T) rounded in another order than peft's; both are 2e-6 to 5e-6 from the fp64 step
    # of the dequantized weights, and 2.4e-6 from each other
    (True, 12, 1e-5)])
def test_a_4bit_base_runs_its_own_matmul_and_the_adapter_fused(chunked, alpha, tol):
    pytest.importorskip("bitsandbytes")
    from oomb.train.loop.quantize import finish_quantized, quantize_linears

    model = tiny_model("llama")
    quantize_linears(model, torch.float32)
    finish_quantized(model)
    ref = _lora(model, lora_alpha=alpha)
    fused = _fused_copy(ref)
    assert type(fused.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "FusedLinear4bit"
    _assert_same_step(fused, ref, torch.randint(0, VOCAB, (2, 100)), chunked, tol)


def test_gradients_added_into_grad_over_several_steps_equal_autograds():
    ref = _lora(tiny_model("llama").double())
    fused = copy.deepcopy(ref)
    assert use_fused_lora(fused, into_grad=True)
    ids = torch.randint(0, VOCAB, (1, 80))
    for model in (ref, fused):
        model.zero_grad(set_to_none=True)
        for _ in range(2):  # the second step adds into the .grad the first created
            oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-14, msg=name)
    # a hook on an adapter weight: its gradient goes back through autograd, which runs the hook
    layer = fused.base_model.model.model.layers[0].self_attn.q_proj
    seen = []
    layer.lora_A["default"].weight.register_hook(lambda g: seen.append(g))
    layer(torch.randn(2, 64, dtype=torch.float64)).sum().backward()
    assert len(seen) == 1


def test_bf16_base_with_float32_adapters_stays_near_peft():
    # peft keeps a bf16 model's adapters in float32 and casts x to float32 for them; the fused layer casts the
    # adapters to bf16 instead (as Unsloth does). Both against the fp64 step: errors of the same size.
    truth = _lora(tiny_model("llama").double())
    ref = copy.deepcopy(truth)
    for name, p in ref.named_parameters():
        p.data = p.data.float() if "lora_" in name else p.data.bfloat16()
    fused = _fused_copy(ref)
    ids = torch.randint(0, VOCAB, (2, 150))
    (true_loss, want), (ref_loss, peft_grads), (loss, grads) = (_step(m, ids, True) for m in (truth, ref, fused))
    assert all(g.dtype == torch.float32 for g in grads.values()) and grads.keys() == want.keys()
    peft_error = max(rel_err(peft_grads[n], want[n]) for n in want)
    fused_error = max(rel_err(grads[n], want[n]) for n in want)
    assert fused_error <= 2 * peft_error, (fused_error, peft_error)
    assert abs(loss - true_loss) <= 2 * abs(ref_loss - true_loss) + 1e-3


def test_the_swap_keeps_modules_parameters_and_names_and_undoes():
    model = _lora(tiny_model("llama"))
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    names = use_fused_lora(model)
    assert names and all(".layers." in n for n in names)
    assert all(p is params[n] for n, p in model.named_parameters()) and list(model.state_dict()) == keys
    assert use_fused_lora(model) == []  # idempotent
    layer = model.get_submodule(names[0])
    assert isinstance(layer, peft.tuners.lora.Linear) and fusion_refusal(layer) is None
    assert sorted(plain_lora(model)) == sorted(names)
    assert all(type(model.get_submodule(n)) is peft.tuners.lora.Linear for n in names)
    assert all(p is params[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("kw,reason", [
    (dict(lora_dropout=0.1), "dropout > 0"),
    (dict(use_dora=True), "a LoRA variant (DoRA, ...)"),
    (dict(lora_bias=True), "a bias on lora_B"),
])
def test_layers_it_cannot_take_keep_peft_s_forward(kw, reason):
    model = _lora(tiny_model("llama"), **kw)
    layers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert layers and all(fusion_refusal(m) == reason for m in layers)
    assert use_fused_lora(model) == []
    assert all(type(m) is peft.tuners.lora.Linear for m in layers)


def test_several_active_adapters_or_disabled_or_merged_run_peft_s_forward():
    ref = _lora(tiny_model("llama").double())
    ref.add_adapter("other", peft.LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))
    fused = copy.deepcopy(ref)
    assert len(use_fused_lora(fused)) == 14  # one adapter active ("default"): fused
    ids = torch.randint(0, VOCAB, (1, 40))

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits

    torch.testing.assert_close(logits(fused), logits(ref), rtol=1e-12, atol=1e-12)
    for model in (ref, fused):
        model.base_model.set_adapter(["default", "other"])
    layer = fused.base_model.model.model.layers[0].self_attn.q_proj
    assert fusion_refusal(layer) == "2 active adapters" and layer._fused_adapter(torch.ones(1, 64)) is None
    torch.testing.assert_close(logits(fused), logits(ref), rtol=1e-12, atol=1e-12)
    for model in (ref, fused):
        model.base_model.set_adapter("default")
    with ref.disable_adapter(), fused.disable_adapter():
        torch.testing.assert_close(logits(fused), logits(ref), rtol=1e-12, atol=1e-12)
    for model in (ref, fused):
        model.merge_adapter()
    assert layer._fused_adapter(torch.ones(1, 64, dtype=torch.float64)) is None
    torch.testing.assert_close(logits(fused), logits(ref), rtol=1e-12, atol=1e-12)


def test_merge_and_unload_and_save_pretrained_round_trip(tmp_path):
    ref = _lora(tiny_model("llama").double())
    fused = _fused_copy(ref)
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        torch.testing.assert_close(fused(input_ids=ids).logits, want, rtol=1e-12, atol=1e-12)
    fused.save_pretrained(tmp_path / "fused")
    ref.save_pretrained(tmp_path / "peft")
    from safetensors.torch import load_file

    saved, peft_saved = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("fused", "peft"))
    assert saved.keys() == peft_saved.keys() and all(torch.equal(saved[k], peft_saved[k]) for k in saved)
    loaded = peft.PeftModel.from_pretrained(tiny_model("llama").double(), tmp_path / "fused")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-12, atol=1e-12)
    merged = fused.merge_and_unload()
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert list(merged.state_dict()) == list(tiny_model("llama").state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-10, atol=1e-10)


def test_liger_s_swiglu_keeps_the_fused_lora_projections():
    # oomb.surgery.fused_ops swaps a LoRA-wrapped MLP too (the projections run as modules inside liger's MLP),
    # and either order of the two swaps leaves the same projection modules, fused.
    pytest.importorskip("liger_kernel")
    from oomb.surgery.fused_ops import swap_fused_modules

    for fused_ops_first in (True, False):
        model = _lora(tiny_model("llama"))
        if fused_ops_first:
            swap_fused_modules(model)
        names = use_fused_lora(model)
        if not fused_ops_first:
            swap_fused_modules(model)
        mlp = model.base_model.model.model.layers[0].mlp
        assert type(mlp).__name__ == "LigerSwiGLUMLP" and len(names) == 14
        assert all(type(p).__name__ == "FusedLinear" for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))


def test_lora_without_bitsandbytes_installed_still_fuses(monkeypatch):
    # A LoRA run without QLoRA need not have bitsandbytes; peft's 4-bit module imports it, and a machine without it
    # stopped use_fused_lora with ModuleNotFoundError (seen on the GPU machine, whose image lacks bitsandbytes).
    import sys

    model = _lora(tiny_model("llama"))  # first: peft caches whether bitsandbytes is there when it first asks
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    monkeypatch.delitem(sys.modules, "peft.tuners.lora.bnb", raising=False)
    monkeypatch.delattr(peft.tuners.lora, "bnb", raising=False)  # so the next import runs the module again
    names = use_fused_lora(model)
    assert len(names) == 7 * model.config.num_hidden_layers
