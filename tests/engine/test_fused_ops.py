"""liger's fused RMSNorm / SwiGLU / GEGLU swapped into transformers models, and its RoPE routed in
(oomb.surgery.fused_ops).

The swapped model must give the plain model's loss and gradients, keep its parameters (the same
objects, the same names), and leave models of other families untouched. The swap itself is
tested on CPU, and so is each liger module's construction (casting mode, offset, eps: the
arithmetic it selects); the numerics only on the GPU: liger's kernels do not run in Triton's
interpreter (liger 0.8.5 calls ``.to`` on float arguments, Python floats there).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import oomb
from oomb.surgery.fused_ops import liger_available, plain_rope, swap_fused_modules, use_fused_ops, use_fused_rope

pytestmark = pytest.mark.skipif(not liger_available(), reason="needs liger-kernel")


@pytest.fixture(autouse=True)
def _transformers_rope_after():
    # liger's RoPE is process-wide for a family: no test leaves it to the next
    yield
    plain_rope()


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


FUSED_FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "granite", "gemma3_text", "gpt_oss"]
# RMSNorms per decoder layer: Qwen3 adds q_norm and k_norm, Gemma-3 has four around its two blocks and q/k norms
_NORMS_PER_LAYER = {"qwen3": 4, "gemma3_text": 6}
# the liger module each family's MLP becomes: GPT-OSS's experts stay
_FUSED_MLP = {"gemma3_text": "LigerGEGLUMLP", "gpt_oss": "GptOssMLP"}
# the arithmetic of each family's RMSNorm as liger's (casting_mode, offset): the weight multiplied in the input dtype
# ("llama") or in fp32 ("gemma"), by weight or by (1 + weight)
_NORM_ARITHMETIC = {"gpt_oss": ("gemma", 0.0), "gemma3_text": ("gemma", 1.0)}


def _swap_count(config, family: str) -> int:
    mlps = 0 if family == "gpt_oss" else 1
    return config.num_hidden_layers * (_NORMS_PER_LAYER.get(family, 2) + mlps) + 1  # + the final norm


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_swap_keeps_parameters_names_and_checkpoints(family, tmp_path):
    plain = tiny_model(family)
    fused = copy.deepcopy(plain)
    params_before = dict(fused.named_parameters())
    mlp_before = fused.model.layers[0].mlp
    swapped = swap_fused_modules(fused)
    assert len(swapped) == _swap_count(plain.config, family)
    assert type(fused.model.layers[0].mlp).__name__ == _FUSED_MLP.get(family, "LigerSwiGLUMLP")
    if family == "gpt_oss":
        assert fused.model.layers[0].mlp is mlp_before  # router and experts: the same module
    assert type(fused.model.layers[0].input_layernorm).__name__ == "LigerRMSNorm"
    assert type(fused.model.norm).__name__ == "LigerRMSNorm"
    # The same Parameter objects under the same names: optimizer state and checkpoints carry over.
    params_after = dict(fused.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is params_before[n] for n in params_before)
    assert not any(p.is_meta for p in fused.parameters())
    assert fused.state_dict().keys() == plain.state_dict().keys()
    fused.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, p in plain.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, rtol=0, atol=0)


@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_each_norm_becomes_liger_norm_of_its_arithmetic(family):
    # liger's kernels need CUDA: on CPU, the arithmetic each swapped norm selects (liger_kernel/ops/rms_norm.py reads
    # casting_mode and offset; LigerRMSNorm.forward passes them with variance_epsilon) and its weight object.
    model = tiny_model(family, rms_norm_eps=3e-6)  # an eps of its own: read from the norm, not a default
    norms = {name: m for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    model.eval()
    swap_fused_modules(model)
    casting_mode, offset = _NORM_ARITHMETIC.get(family, ("llama", 0.0))
    for name, norm in norms.items():
        fused = model.get_submodule(name)
        assert type(fused).__name__ == "LigerRMSNorm", name
        assert fused.weight is norm.weight
        assert (fused.casting_mode, fused.offset, fused.variance_epsilon) == (casting_mode, offset, 3e-6), name
        assert fused.in_place is False and fused.training is False
    assert len(norms) == model.config.num_hidden_layers * _NORMS_PER_LAYER.get(family, 2) + 1


def test_gemma3_mlp_is_geglu_only_with_the_tanh_gelu():
    from liger_kernel.transformers.geglu import LigerGEGLUMLP

    model = tiny_model("gemma3_text", intermediate_size=80)
    mlp = model.model.layers[0].mlp
    swap_fused_modules(model)
    fused = model.model.layers[0].mlp
    assert type(fused) is LigerGEGLUMLP and fused.intermediate_size == 80
    assert (fused.gate_proj, fused.up_proj, fused.down_proj) == (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    # LigerGEGLUMLP computes the tanh form whatever the config says: another activation keeps transformers' MLP
    exact = tiny_model("gemma3_text", hidden_activation="gelu")
    swap_fused_modules(exact)
    assert type(exact.model.layers[0].mlp).__name__ == "Gemma3MLP"
    assert type(exact.model.layers[0].input_layernorm).__name__ == "LigerRMSNorm"


@pytest.mark.gpu
@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_fp32_fused_model_equals_plain_model_on_gpu(family):
    plain = tiny_model(family).to("cuda")
    fused = copy.deepcopy(plain)
    ids = torch.randint(0, VOCAB, (2, 48), device="cuda")
    ref_loss, ref_grads = _loss_and_grads(plain, ids)  # before the family's RoPE is liger's
    assert use_fused_ops(fused, "auto") == [*swap_fused_modules(copy.deepcopy(plain)), "rope"]
    loss, grads = _loss_and_grads(fused, ids)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")


@pytest.mark.gpu
def test_chunked_backward_of_fused_model_equals_plain_on_gpu():
    plain = tiny_model("qwen2").to("cuda")
    fused = copy.deepcopy(plain)
    ids = torch.randint(0, VOCAB, (1, 256), device="cuda")
    losses, grads = [], []
    for model in (plain, fused):
        if model is fused:  # after the plain model's step: the family's RoPE becomes liger's
            assert "rope" in use_fused_ops(fused, "auto")
        model.zero_grad(set_to_none=True)
        losses.append(oomb.chunked_backward(model, ids, chunk_size=64, page_size=16))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for name, ref in grads[0].items():
        torch.testing.assert_close(grads[1][name], ref, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "granite", "gemma3_text", "gpt_oss"])
def test_bf16_norms_round_as_transformers_on_gpu(family):
    # Where the weight multiplies (input dtype or fp32) decides bf16 rounding: the casting that reproduces
    # transformers' norm gives its bits but for rare last-bit differences of the fp32 rsqrt.
    model = tiny_model(family).to("cuda", torch.bfloat16)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    x = torch.randn(4096, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    want = norm(x)
    swap_fused_modules(model)
    got = model.model.layers[0].input_layernorm(x)
    assert got.dtype == want.dtype
    assert (got == want).float().mean() >= 0.99
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)


@pytest.mark.gpu
def test_bf16_fused_model_on_gpu():
    plain = tiny_model("qwen3").to("cuda", torch.bfloat16)
    fused = copy.deepcopy(plain)
    ids = torch.randint(0, VOCAB, (2, 512), device="cuda")
    ref_loss, ref_grads = _loss_and_grads(plain, ids)
    assert "rope" in use_fused_ops(fused, "auto")  # a CUDA model: auto swaps
    loss, grads = _loss_and_grads(fused, ids)
    assert abs(loss.item() - ref_loss.item()) <= 1e-2 * abs(ref_loss.item())
    ref = torch.cat([g.float().flatten() for g in ref_grads.values()])
    got = torch.cat([grads[n].float().flatten() for n in ref_grads])
    assert torch.isfinite(got).all()
    assert (got - ref).norm() / ref.norm() <= 1e-2


def test_other_families_and_modes_are_left_alone():
    phi = tiny_model("phi")  # LayerNorms, a non-gated GELU MLP, partial RoPE: nothing liger's modules compute
    kinds = [type(m).__name__ for m in phi.modules()]
    assert swap_fused_modules(phi) == []
    assert [type(m).__name__ for m in phi.modules()] == kinds

    llama = tiny_model("llama")
    assert use_fused_ops(llama, "none") == []
    assert use_fused_ops(llama, "auto") == []  # a CPU model: liger's kernels run on CUDA only
    assert not any(type(m).__name__.startswith("Liger") for m in llama.modules())
    with pytest.raises(ValueError, match="use one of auto, liger, none"):
        use_fused_ops(llama, "fast")


def test_rope_routing_is_undone_and_skips_other_families(monkeypatch):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.phi import modeling_phi
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    own = modeling_qwen2.apply_rotary_pos_emb
    qwen3_own = modeling_qwen3.apply_rotary_pos_emb
    calls = []
    monkeypatch.setattr("liger_kernel.transformers.rope.liger_rotary_pos_emb",
                        lambda *a, **k: calls.append("liger") or liger_rotary_pos_emb(*a, **k))
    assert use_fused_rope(tiny_model("qwen2")) == "qwen2"
    assert use_fused_rope(tiny_model("qwen2")) == "qwen2"  # twice: transformers' function is still the one kept
    routed = modeling_qwen2.apply_rotary_pos_emb
    assert routed is not own and modeling_qwen3.apply_rotary_pos_emb is qwen3_own  # another family: untouched
    q, k, cos, sin = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    for got, want in zip(routed(q, k, cos, sin), own(q, k, cos, sin), strict=True):  # CPU tensors: transformers'
        assert torch.equal(got, want)
    assert calls == []
    phi_own = modeling_phi.apply_rotary_pos_emb
    assert use_fused_rope(tiny_model("phi")) is None  # partial RoPE: its own
    assert modeling_phi.apply_rotary_pos_emb is phi_own
    plain_rope()
    assert modeling_qwen2.apply_rotary_pos_emb is own


# family -> (its modeling module, the width of its cos/sin as a fraction of the head): GPT-OSS's are half the head
_ROPE_MODULES = {"granite": ("granite", 1), "gemma3_text": ("gemma3", 1), "gpt_oss": ("gpt_oss", 2)}


@pytest.mark.parametrize("family", sorted(_ROPE_MODULES))
def test_routed_rope_is_transformers_on_cpu_tensors(family, monkeypatch):
    import importlib

    import liger_kernel.transformers.rope as liger_rope

    name, split = _ROPE_MODULES[family]
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    own = modeling.apply_rotary_pos_emb
    calls = []
    for function in ("liger_rotary_pos_emb", "liger_rotary_pos_emb_gpt_oss"):
        monkeypatch.setattr(liger_rope, function, lambda *a, f=function, **k: calls.append(f))
    assert use_fused_rope(tiny_model(family)) == family
    routed = modeling.apply_rotary_pos_emb
    assert routed is not own
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)  # q and k of different head counts
    cos, sin = torch.randn(2, 5, 16 // split), torch.randn(2, 5, 16 // split)
    for got, want in zip(routed(q, k, cos, sin), own(q, k, cos, sin), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(routed(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2),
                         own(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2), strict=True):
        assert torch.equal(got, want)  # [B, T, H, D] (unsqueeze_dim 2): transformers' on any device
    assert calls == []
    plain_rope()
    assert modeling.apply_rotary_pos_emb is own


def test_gpt_oss_rope_is_liger_gpt_oss_function_on_cuda_tensors(monkeypatch):
    # On CUDA tensors the routed function hands q, k, cos, sin to liger_rotary_pos_emb_gpt_oss (rotary_dim = the head,
    # from cos/sin half its width); the others' to liger_rotary_pos_emb. Checked with a stand-in for q.is_cuda.
    import liger_kernel.transformers.rope as liger_rope
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.gpt_oss import modeling_gpt_oss

    calls = []
    for function in ("liger_rotary_pos_emb", "liger_rotary_pos_emb_gpt_oss"):
        monkeypatch.setattr(liger_rope, function, lambda q, k, cos, sin, f=function: calls.append(f) or (q, k))
    q = types.SimpleNamespace(is_cuda=True)
    assert use_fused_rope(tiny_model("gpt_oss")) == "gpt_oss"
    modeling_gpt_oss.apply_rotary_pos_emb(q, "k", "cos", "sin")
    assert use_fused_rope(tiny_model("gemma3_text")) == "gemma3_text"
    modeling_gemma3.apply_rotary_pos_emb(q, "k", "cos", "sin")
    assert calls == ["liger_rotary_pos_emb_gpt_oss", "liger_rotary_pos_emb"]


def test_gemma3_and_its_text_model_share_one_rope_routing():
    from transformers import Gemma3Config
    from transformers.models.gemma3 import modeling_gemma3

    own = modeling_gemma3.apply_rotary_pos_emb
    multimodal = types.SimpleNamespace(config=Gemma3Config())  # only its model type is read
    assert use_fused_rope(multimodal) == "gemma3"
    assert use_fused_rope(tiny_model("gemma3_text")) == "gemma3_text"  # the same module, routed again
    assert modeling_gemma3.apply_rotary_pos_emb is not own
    plain_rope()
    assert modeling_gemma3.apply_rotary_pos_emb is own  # not the first routing, kept as if it were transformers'


def test_an_architecture_is_still_checked_on_the_cpu_once_rope_is_routed():
    # A library user swaps liger's RoPE in, then trains: oomb's check of the architecture trains a tiny copy on
    # the CPU, where liger's Triton kernel cannot run (it used to refuse the model with Triton's error).
    from oomb.engine.step import check_architecture

    model = tiny_model("llama")
    model.config.rope_theta = 12345.0  # a config of its own: not a verdict cached by another test
    assert use_fused_rope(model) == "llama"
    check_architecture(model.config, training=True)


def test_liger_mode_refuses_a_cpu_model():
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        use_fused_ops(tiny_model("llama"), "liger")


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.fused_ops=fast"], "train.fused_ops='fast': use one of auto, liger, none"),
        (["train.fused_ops=liger", "train.device=cpu"], "needs a CUDA device"),
        (["train.fused_ops=liger", "train.tensor_parallel=2"], "not supported with train.tensor_parallel > 1"),
    ],
)
def test_train_config_refuses_bad_fused_ops(overrides, match):
    from oomb.train.config.checks import check_config
    from oomb.train.config.settings import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        check_config(load_config(None, overrides))


def test_peft_adapters_on_the_mlp_survive_the_swap():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen2"), peft.LoraConfig(r=4, target_modules=["gate_proj", "q_proj"]))
    trainable_before = {n for n, p in model.named_parameters() if p.requires_grad}
    gate_before = model.base_model.model.model.layers[0].mlp.gate_proj
    assert swap_fused_modules(model)
    mlp = model.base_model.model.model.layers[0].mlp
    assert type(mlp).__name__ == "LigerSwiGLUMLP" and mlp.gate_proj is gate_before  # the LoRA-wrapped linear
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable_before
