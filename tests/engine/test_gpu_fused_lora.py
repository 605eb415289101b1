"""Fused LoRA (oomb.surgery.lora) on a GPU in bf16, as `oomb train` runs it: liger's fused ops where installed,
adapter gradients added into .grad by their matmuls, layer-host recompute, the default kernels. Run with
`pytest -m gpu`. The bound follows tests/engine/test_gpu_bf16.py: the fused step's adapter-gradient error against
an fp32 truth (the same adapters, peft's own layers, full-sequence backward) at most twice that of peft's own bf16
layers through the same chunked step.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import oomb
from oomb.surgery.fused_ops import use_fused_ops
from oomb.surgery.grad_accumulation import fused_grad_accumulation_applies, use_fused_grad_accumulation
from oomb.surgery.lora import use_fused_lora

pytestmark = pytest.mark.gpu
peft = pytest.importorskip("peft")


def _truth():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                      attention_dropout=0.0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    # init_lora_weights=False: B nonzero, so every adapter gradient counts
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _adapter_grads(model):
    return {n: p.grad.float() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def _bf16_step(truth, ids, fused):
    model = copy.deepcopy(truth)
    for name, p in model.named_parameters():  # peft's habit on a bf16 model: the adapters stay float32
        p.data = p.data if "lora_" in name else p.data.bfloat16()
    use_fused_ops(model, "auto")
    into_grad = fused_grad_accumulation_applies(model, "auto")
    if into_grad:
        use_fused_grad_accumulation(model)
    if fused:
        assert len(use_fused_lora(model, into_grad=into_grad)) == 7 * 4
    model.train()
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, chunk_size=2048, page_size=128, recompute="layer-host")
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)  # frozen: no gradient
    return float(loss), _adapter_grads(model)


def test_fused_lora_bf16_adapter_gradients_as_close_to_fp32_as_peft_s():
    truth = _truth()
    ids = torch.randint(0, 4096, (1, 8192 + 77), device="cuda")
    truth.zero_grad(set_to_none=True)
    out = truth(input_ids=ids, labels=ids)
    out.loss.backward()
    true_loss = out.loss.item()
    want = _adapter_grads(truth)
    (peft_loss, peft_grads), (loss, grads) = (_bf16_step(truth, ids, fused) for fused in (False, True))
    assert grads.keys() == peft_grads.keys() == want.keys() and want

    def error(g):
        flat = torch.cat([g[n].reshape(-1) for n in want])
        ref = torch.cat([want[n].reshape(-1) for n in want])
        return float((flat - ref).norm() / ref.norm())

    print(f"adapter gradient error vs fp32: fused {error(grads):.4f}, peft's layers {error(peft_grads):.4f}; "
          f"loss {loss:.5f} / {peft_loss:.5f} / fp32 {true_loss:.5f}")
    assert torch.isfinite(torch.tensor(loss))
    assert error(grads) <= 2 * error(peft_grads) + 1e-6
    assert abs(loss - true_loss) <= 2 * abs(peft_loss - true_loss) + 1e-3
