"""On a GPU in bf16: chunked_backward's gradient error against an fp32 full-sequence reference.

Run on the H200 with `pytest -m gpu`. The bound follows the habit of comparing a bf16
result's error with plain bf16 training's: oomb (bf16, chunked) must be no worse than
twice transformers' own bf16 full-sequence SDPA training (both against fp32), and within
1e-2 of that bf16 training itself (global relative error over all parameters).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import oomb
from oomb.sparse import PageSelection

pytestmark = pytest.mark.gpu


def _model(dtype):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                      attention_dropout=0.0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


def _flat_grads(model):
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


def _full_sequence(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return _flat_grads(model)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_gradients_close_to_fp32_full_sequence(backend):
    ids = torch.randint(0, 4096, (1, 8192 + 77), device="cuda")
    ref_model = _model(torch.float32)
    g_ref = _full_sequence(ref_model, ids)
    model = _model(torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref_model.state_dict().items()})
    g_hf = _full_sequence(model, ids)
    model.zero_grad(set_to_none=True)
    oomb.chunked_backward(model, ids, chunk_size=2048, page_size=128, backend=backend)
    g_oomb = _flat_grads(model)
    assert torch.isfinite(g_oomb).all()
    err_oomb = float((g_oomb - g_ref).norm() / g_ref.norm())
    err_hf = float((g_hf - g_ref).norm() / g_ref.norm())
    err_vs_bf16 = float((g_oomb - g_hf).norm() / g_hf.norm())
    print(f"global relative gradient error vs fp32: oomb {err_oomb:.4f}, transformers bf16 {err_hf:.4f}; "
          f"oomb vs transformers bf16: {err_vs_bf16:.4f}")
    assert err_oomb <= 2 * err_hf + 1e-6
    assert err_vs_bf16 <= 2e-2


def test_gradient_page_dtype_accuracy():
    """bf16 against fp32 gradient pages (accuracy and the memory they cost): printed for docs/kernels.md."""
    ids = torch.randint(0, 4096, (1, 16384), device="cuda")
    ref_model = _model(torch.float32)
    g_ref = _full_sequence(ref_model, ids)
    model = _model(torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref_model.state_dict().items()})
    errors = {}
    for name, grad_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model.zero_grad(set_to_none=True)
        oomb.chunked_backward(model, ids, chunk_size=2048, page_size=128, grad_dtype=grad_dtype)
        g = _flat_grads(model)
        assert torch.isfinite(g).all()
        errors[name] = float((g - g_ref).norm() / g_ref.norm())
        oomb.release_memory(model)
    print(f"gradient pages bf16: error vs fp32 full sequence {errors['bf16']:.5f}; fp32 pages: {errors['fp32']:.5f}")
    assert errors["fp32"] <= errors["bf16"] * 1.05 + 1e-6


def _bf16_errors_against_fp32(ids, backends, **kw) -> dict[str, float]:
    """Per backend, the global relative gradient error of a bf16 chunked_backward step against the same step in
    fp32 on the PyTorch path (same weights, rounded to bf16)."""
    ref_model = _model(torch.float32)
    ref_model.zero_grad(set_to_none=True)
    oomb.chunked_backward(ref_model, ids, backend="torch", **kw)
    g_ref = _flat_grads(ref_model)
    model = _model(torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref_model.state_dict().items()})
    errors = {}
    for backend in backends:
        model.zero_grad(set_to_none=True)
        oomb.chunked_backward(model, ids, backend=backend, **kw)
        g = _flat_grads(model)
        assert torch.isfinite(g).all()
        errors[backend] = float((g - g_ref).norm() / g_ref.norm())
    return errors


def test_sparse_with_documents_bf16_close_to_fp32():
    """Sparse + packed documents in bf16 (Triton, and the PyTorch path) against the same run in fp32.

    The pages are all forced (sink + local = budget) so the selection cannot differ between
    precisions; the bound is the one used for dense training: Triton's error at most twice the
    PyTorch path's in the same bf16.
    """

    ids = torch.randint(0, 4096, (1, 16384 + 50), device="cuda")
    doc_ids = torch.zeros_like(ids)
    doc_ids[:, 9000:] = 1
    kw = dict(chunk_size=2048, page_size=128, doc_ids=doc_ids,
              selection=PageSelection(page_budget=8, block=128, sink_pages=2, local_pages=6))
    errors = _bf16_errors_against_fp32(ids, ("torch", "triton"), **kw)
    print(f"sparse+documents bf16 vs fp32: triton {errors['triton']:.5f}, torch path {errors['torch']:.5f}")
    assert errors["triton"] <= 2 * errors["torch"] + 1e-6


@pytest.mark.parametrize("sparse", [{}, {"page_budget": 8}, {"selection": PageSelection(page_budget=8, block=2048)}],
                         ids=["dense", "sparse", "sparse, one list per chunk"])
def test_offload_bit_identical_on_gpu(sparse):
    """Copies on their own stream with events (sparse pages through the mapped-memory copy kernel), and
    layers kept on the GPU by offload_gpu_bytes: the same gradients, bit for bit, as pages on the GPU.
    One page list per chunk is the case where no torch.unique makes the host wait for the selection
    (the copy stream must wait for it: oomb/cache/page_lists.py, PastPages.hand_to_stream).
    Deterministic algorithms on: FlashAttention-4's backward (the fa4 backend) otherwise sums with atomics in
    no fixed order, and two runs of the same step differ in their last bits, offloaded or not."""
    from oomb.engine import store_for_model

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _offload_runs(sparse, store_for_model)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _offload_runs(sparse, store_for_model):
    ids = torch.randint(0, 4096, (1, 16384 + 77), device="cuda")
    model = _model(torch.bfloat16)
    runs = {"gpu": {}, "offload": {"offload": True}, "offload, 2 layers kept": {"offload": True}}
    grads = {}
    for name, kw in runs.items():
        if name == "offload, 2 layers kept":
            kw["offload_gpu_bytes"] = 2 * store_for_model(model).layer_nbytes(1, ids.shape[1])
        model.zero_grad(set_to_none=True)
        oomb.chunked_backward(model, ids, chunk_size=2048, page_size=128, **sparse, **kw)
        grads[name] = _flat_grads(model)
        if "offload_gpu_bytes" in kw:
            assert store_for_model(model).resident_layers == 2
        if name != "offload":
            oomb.release_memory(model)
    for name in ("offload", "offload, 2 layers kept"):
        assert torch.isfinite(grads[name]).all(), name
        assert torch.equal(grads[name], grads["gpu"]), name


def test_sparse_step_on_fa4_block_sparsity_bf16_close_to_fp32(monkeypatch):
    """A sparse step through FA4's block sparsity (kernels/flash4_sparse.py, the default on Hopper)
    against the same step in fp32 on the PyTorch path, bounded as above by the PyTorch path's own bf16 error. The
    pages are forced (sink + local = budget) so the selection cannot differ between precisions."""
    from oomb import kernels
    from oomb.kernels import flash4, flash4_calls, flash4_sparse

    if (reason := kernels.flash4_unavailable()) is not None:
        pytest.skip(reason)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA4 block sparsity is offered on Hopper only")
    built = []
    real = flash4_sparse.page_sparse_keys
    monkeypatch.setattr(flash4, "page_sparse_keys", lambda *a, **k: built.append(1) or real(*a, **k))
    ids = torch.randint(0, 4096, (1, 16384 + 50), device="cuda")
    kw = dict(chunk_size=2048, page_size=128, selection=PageSelection(page_budget=8, block=128, sink_pages=2,
                                                                      local_pages=6))
    monkeypatch.setenv(flash4_calls.BLOCK_SPARSE_ENV, "1")
    kernels._flash4_backend.cache_clear()  # built again, reading the variable
    try:
        errors = _bf16_errors_against_fp32(ids, ("torch", "fa4"), **kw)
    finally:
        kernels._flash4_backend.cache_clear()
    print(f"sparse bf16 vs fp32: fa4 block sparsity {errors['fa4']:.5f}, torch path {errors['torch']:.5f}")
    assert built, "the fa4 backend ran the sparse calls on FA4's block sparsity"
    assert errors["fa4"] <= 2 * errors["torch"] + 1e-6
