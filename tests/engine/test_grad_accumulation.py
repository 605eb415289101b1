"""Weight gradients added into .grad by their matmuls (oomb.surgery.grad_accumulation): the same gradients as
autograd's matmul-then-add, over chunked steps too; and the plain path wherever writing .grad directly would skip
something (hooks, frozen weights, several ranks, no autograd)."""

import copy

import pytest
import torch

import oomb
from oomb.sparse import PageSelection
from oomb.surgery import grad_accumulation as ga
from oomb.surgery.grad_accumulation import GradAccumulatingLinear, plain_linears, use_fused_grad_accumulation
from oomb.train.config.presets import preset_config


def _tiny(seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = preset_config("tiny")
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_swap_keeps_parameters_names_and_modules_outside_the_layers():
    model = _tiny()
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    swapped = use_fused_grad_accumulation(model)
    layers = model.config.num_hidden_layers
    assert len(swapped) == 7 * layers  # q, k, v, o, gate, up, down per layer
    assert all(name.startswith("model.layers.") for name in swapped)
    assert all(isinstance(model.get_submodule(n), GradAccumulatingLinear) for n in swapped)
    assert type(model.lm_head) is torch.nn.Linear  # the head's gradient comes from the fused loss
    assert all(p is before[n] for n, p in model.named_parameters()) and list(model.state_dict()) == keys
    assert use_fused_grad_accumulation(model) == []  # idempotent
    assert sorted(plain_linears(model)) == sorted(swapped)
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in swapped)
    assert all(p is before[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("bias", [True, False])
def test_gradients_over_several_backwards_match_autograds(bias):
    torch.manual_seed(1)
    plain = torch.nn.Linear(24, 40, bias=bias).double()
    fused = GradAccumulatingLinear.holding(copy.deepcopy(plain))
    for _ in range(3):  # the first backward creates .grad, the others add into it
        x = torch.randn(2, 5, 24, dtype=torch.float64)
        for layer in (plain, fused):
            xi = x.clone().requires_grad_()
            (layer(xi).sin().sum()).backward()
            layer.last_dx = xi.grad
        torch.testing.assert_close(fused.last_dx, plain.last_dx)
    torch.testing.assert_close(fused.weight.grad, plain.weight.grad)
    if bias:
        torch.testing.assert_close(fused.bias.grad, plain.bias.grad)
    # the swapped path ran: no AccumulateGrad node feeds the weight
    y = fused(torch.randn(3, 24, dtype=torch.float64))
    assert "LinearIntoGrad" in type(y.grad_fn).__name__


def test_a_chunked_sparse_step_gives_the_same_gradients():
    plain = _tiny()
    fused = copy.deepcopy(plain)
    assert use_fused_grad_accumulation(fused)
    ids = torch.randint(0, plain.config.vocab_size, (1, 192))
    kw = dict(chunk_size=64, page_size=16, backend="torch", recompute="layer-host", cache_attention=True,
              selection=PageSelection(page_budget=2, chunk_pages=3))
    for model in (plain, fused):
        for _ in range(2):  # .grad kept between steps, as with gradient accumulation
            oomb.chunked_backward(model, ids, **kw)
    want, got = _grads(plain), _grads(fused)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12, msg=name)


def test_the_plain_path_wherever_writing_grad_would_skip_something(monkeypatch):
    layer = GradAccumulatingLinear.holding(torch.nn.Linear(8, 8).double())
    x = torch.randn(4, 8, dtype=torch.float64)

    def node():
        return type(layer(x).grad_fn).__name__

    assert "LinearIntoGrad" in node()
    with torch.no_grad():
        assert layer(x).grad_fn is None
    seen = []
    handle = layer.weight.register_hook(lambda g: seen.append(g))
    assert "LinearIntoGrad" not in node()  # a hook on the weight: autograd's own accumulation runs it
    layer(x).sum().backward()
    assert len(seen) == 1
    handle.remove()
    handle = layer.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p))
    assert "LinearIntoGrad" not in node()
    handle.remove()
    layer.weight.requires_grad_(False)
    assert "LinearIntoGrad" not in node()
    layer.weight.requires_grad_(True)
    monkeypatch.setattr(ga.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(ga.dist, "get_world_size", lambda: 2)
    assert "LinearIntoGrad" not in node()  # several ranks: their reduction hooks see every gradient
    monkeypatch.setattr(ga.dist, "get_world_size", lambda: 1)
    assert "LinearIntoGrad" in node()


def test_frozen_layers_and_lora_adapters_keep_their_modules():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    swapped = use_fused_grad_accumulation(model)
    # frozen bases and the adapters stay; the trained layers left: none (peft froze every base weight)
    assert swapped == []
    assert not any(isinstance(m, GradAccumulatingLinear) for m in model.modules())


@pytest.mark.gpu
def test_bf16_gradients_added_in_the_matmul_on_the_gpu():
    """cuBLAS's beta = 1 matmul in bf16: closer to the float32 sum than autograd's bf16 add of bf16 products."""
    torch.manual_seed(3)
    exact = torch.nn.Linear(512, 1024).cuda()
    plain = copy.deepcopy(exact).bfloat16()
    fused = GradAccumulatingLinear.holding(copy.deepcopy(plain))
    for _ in range(8):  # eight chunks' gradients summed into .grad
        x = torch.randn(2, 256, 512, device="cuda")
        for layer in (exact, plain, fused):
            inp = x.to(layer.weight.dtype)
            (layer(inp).float().square().mean()).backward()
    assert "LinearIntoGrad" in type(fused(x.bfloat16()).grad_fn).__name__

    def error(layer):
        return ((layer.weight.grad.float() - exact.weight.grad).norm() / exact.weight.grad.norm()).item()

    assert error(fused) < 1e-2 and error(fused) <= error(plain) * 1.05
    torch.testing.assert_close(fused.bias.grad.float(), exact.bias.grad, rtol=2e-2, atol=1e-3)


def test_oomb_train_adds_in_the_matmul_only_with_fused_ops_on_one_cuda_process():
    import types

    from oomb.train.config.settings import load_config
    from oomb.train.loop.distributed import DistributedContext
    from oomb.train.loop.model import fuses_grad_accumulation

    def model_on(device):
        weight = types.SimpleNamespace(device=torch.device(device))
        return types.SimpleNamespace(parameters=lambda: iter([weight]))

    cfg = load_config(None, [])
    one = DistributedContext.single(torch.device("cpu"))  # a single process
    assert fuses_grad_accumulation(model_on("cuda"), cfg, one)
    assert fuses_grad_accumulation(model_on("cuda"), cfg, types.SimpleNamespace(world_size=1))
    assert not fuses_grad_accumulation(model_on("cuda"), cfg, types.SimpleNamespace(world_size=2))  # FSDP's hooks
    assert not fuses_grad_accumulation(model_on("cpu"), cfg, one)
    assert not fuses_grad_accumulation(model_on("cuda"), load_config(None, ["train.fused_ops=none"]), one)
    assert not fuses_grad_accumulation(model_on("cuda"), load_config(None, ["train.fused_grad_accumulation=false"]),
                                       one)
