"""liger's fused RMSNorm / SwiGLU swapped into transformers models, and its RoPE routed in
(oomb.surgery.fused_ops).

The swapped model must give the plain model's loss and gradients, keep its parameters (the same
objects, the same names), and leave models of other families untouched. The swap itself is
tested on CPU; the numerics only on the GPU: liger's RMSNorm and SwiGLU kernels do not run in
Triton's interpreter (liger 0.8.5 calls ``.to`` on float arguments, Python floats there).
"""

from __future__ import annotations

import copy

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


def _swap_count(config, family: str, norms: bool) -> int:
    norms_per_layer = 4 if family == "qwen3" else 2  # Qwen3 adds q_norm and k_norm
    per_layer = 1 + (norms_per_layer if norms else 0)  # the MLP, the norms
    return config.num_hidden_layers * per_layer + (1 if norms else 0)  # + the final norm


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_swap_keeps_parameters_names_and_checkpoints(family, tmp_path):
    plain = tiny_model(family)
    fused = copy.deepcopy(plain)
    params_before = dict(fused.named_parameters())
    swapped = swap_fused_modules(fused)
    assert len(swapped) == _swap_count(plain.config, family, norms=True)
    assert type(fused.model.layers[0].mlp).__name__ == "LigerSwiGLUMLP"
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


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
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
    gpt_oss = tiny_model("gpt_oss")  # its experts are not SwiGLU MLPs, its norms not in the table
    kinds = [type(m).__name__ for m in gpt_oss.modules()]
    assert swap_fused_modules(gpt_oss) == []
    assert [type(m).__name__ for m in gpt_oss.modules()] == kinds

    llama = tiny_model("llama")
    assert use_fused_ops(llama, "none") == []
    assert use_fused_ops(llama, "auto") == []  # a CPU model: liger's kernels run on CUDA only
    assert not any(type(m).__name__.startswith("Liger") for m in llama.modules())
    with pytest.raises(ValueError, match="use one of auto, liger, none"):
        use_fused_ops(llama, "fast")


def test_rope_routing_is_undone_and_skips_other_families(monkeypatch):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
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
    assert use_fused_rope(tiny_model("gpt_oss")) is None  # its RoPE rotates halves of cos/sin's width
    plain_rope()
    assert modeling_qwen2.apply_rotary_pos_emb is own


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
