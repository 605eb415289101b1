"""On a GPU in bf16: a handful of the sweep's families, chunked_backward's gradient error against fp32.

Run on the device with `pytest -m gpu -s tests/models/test_gpu_families.py`. Each family is the sweep's tiny
config (tests/models/families.py: its features on, windows shorter than the sequence). The bound is the habit
of comparing a bf16 result with plain bf16 training: oomb in bf16 (the kernels `auto` picks on this GPU) may be
no worse than twice transformers' own bf16 full-sequence training, both against an fp32 full-sequence step of
the same weights.
"""

import pytest
import torch
from families import sweep_config
from transformers import AutoModelForCausalLM

import oomb

pytestmark = pytest.mark.gpu

# One with sinks and sliding windows (gpt_oss), local:global windows (gemma3_text), logit scaling (cohere),
# latent attention (deepseek_v2: key and value head sizes differ), two calls per layer (diffllama), and the
# plain families.
GPU_FAMILIES = ("llama", "qwen3", "mistral", "gpt_oss", "gemma3_text", "cohere", "deepseek_v2", "diffllama")
SEQ, CHUNK, PAGE = 1024 + 37, 256, 64


def _model(config, dtype):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    model.to("cuda")  # a family that makes a tensor on the CPU in __init__ (DiffLlama's lambdas) too
    model.train()
    return model


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])


def _full_sequence(model, ids, labels) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=labels).loss.backward()
    return _grads(model)


@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_bf16_gradients_of_a_family_no_worse_than_transformers_own(family):
    config = sweep_config(family)
    reference = _model(config, torch.float32)
    with torch.no_grad():  # biases, norms and sinks away from their initial values, so every path matters
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    vocab = reference.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (2, SEQ), device="cuda")
    labels = ids.clone()
    labels[0, :100] = -100
    g_ref = _full_sequence(reference, ids, labels)
    model = _model(config, torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()})
    g_hf = _full_sequence(model, ids, labels)
    model.zero_grad(set_to_none=True)
    oomb.chunked_backward(model, ids, labels, chunk_size=CHUNK, page_size=PAGE)
    g_oomb = _grads(model)
    assert torch.isfinite(g_oomb).all()
    err_oomb = float((g_oomb - g_ref).norm() / g_ref.norm())
    err_hf = float((g_hf - g_ref).norm() / g_ref.norm())
    print(f"{family}: gradient error vs fp32, oomb bf16 {err_oomb:.4f}, transformers bf16 {err_hf:.4f}")
    assert err_oomb <= 2 * err_hf + 1e-6
