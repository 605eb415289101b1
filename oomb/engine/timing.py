"""How long one exact (dense) training step takes, predicted from steps measured on a GPU.

A step's time has two parts: the matmuls and elementwise work of the layers and the LM head, linear
in the context (6 x tokens x matmul parameters FLOPs, counted without recomputation), and causal
attention, quadratic in it (6 x tokens^2 x layers x heads x head_dim FLOPs, forward and backward).
Each part runs at its own rate on a given GPU; two measured steps of different lengths give both
rates. The rates below were fitted on the H200 to the setting `oomb train` picks for Qwen2.5-7B there
(FlashAttention-4 kernels, chunks of 16384, the attention cache, recompute="layer-host", liger's fused
ops) — the 64K step of benchmarks/results/core-7b-vs-transformers-64k.json (cache on the GPU) and the
256K step of core-7b-vs-transformers-256k.json (cache in host memory, which costs no time), without an
optimizer; tests/engine/test_timing.py refits them from those records. Between them the fit predicts
31.69 s at 128K, where `oomb train` measured 31.65 s with AdamW (train-7b-auto.json). The prediction is for
that setting and GPU, or without the attention cache with stage 2's extra attention forward counted
(ATTENTION_FORWARD_SHARE); other settings (shorter chunks, offload) are slower or faster by amounts measured only
at some lengths (docs/benchmarks.md). Every layer is counted as attending the whole context (sliding-window layers
attend less).

Page-sparse attention (a page budget per block of queries) counts the keys each query attends: its own chunk's up to
itself, and at most the budget's pages of the past (``attended_keys``). The linear part runs at the dense rate; the
attention part at a rate of its own (H200_SPARSE), slower than dense FlashAttention's: the pages are gathered and
attended in blocks. That rate is fitted to one measured step (Qwen2.5-7B, 128K, the H200, FA4's block sparsity,
chunks of 8192, 64 pages of 128 per block of 128 queries, the attention cache: 17.24 s,
benchmarks/results/core-7b-sparse-128k-fa4-blocks.json) and checked against another: the 1M step on the same
machine without the cache and with pages offloaded, 157.7 s measured, 152.5 s predicted (sparse-1m-7b.json;
tests/engine/test_timing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from oomb.engine.sizes import ModelShape

__all__ = ["ATTENTION_FORWARD_SHARE", "H200_DENSE", "H200_SPARSE", "PageSparsity", "StepRates", "attended_keys",
           "predict_step_seconds", "step_flops"]

# FlashAttention's forward runs 2 of the 7 matmuls of its forward and backward (QK^T, PV; the backward recomputes
# QK^T and computes dV, dP, dQ, dK). Without the attention cache stage 2 runs the forward once more: that share of
# the attention time again, at the same rate.
ATTENTION_FORWARD_SHARE = 2 / 7


@dataclass(frozen=True)
class StepRates:
    """Seconds per FLOP of the linear part and of the attention part of a step, on one GPU."""

    gpu: str
    linear_s_per_flop: float
    attention_s_per_flop: float
    basis: str


H200_DENSE = StepRates(
    gpu="NVIDIA H200",
    linear_s_per_flop=2.1226e-15,  # 471 TFLOP/s of 6·N·P (the recompute forward included in the time)
    attention_s_per_flop=1.9227e-15,  # 520 TFLOP/s of 6·N²·L·H·D
    basis="Qwen2.5-7B steps at 64K and 256K tokens, fa4 kernels, chunk 16384, attention cache, recompute "
          "layer-host, fused ops (benchmarks/results/core-7b-vs-transformers-64k.json, "
          "core-7b-vs-transformers-256k.json)",
)

H200_SPARSE = StepRates(
    gpu="NVIDIA H200",
    linear_s_per_flop=H200_DENSE.linear_s_per_flop,
    attention_s_per_flop=2.9250e-15,  # 342 TFLOP/s of the attended keys' FLOPs (step_flops with a PageSparsity)
    basis="the linear rate of H200_DENSE; the attention rate from a Qwen2.5-7B step at 128K tokens, fa4 kernels with "
          "FA4's block sparsity, 64 pages of 128 per block of 128 queries, chunk 8192, attention cache, recompute "
          "layer-host, fused ops (benchmarks/results/core-7b-sparse-128k-fa4-blocks.json)",
)


@dataclass(frozen=True)
class PageSparsity:
    """What bounds a page-sparse query's keys: ``page_budget`` pages of ``page_size`` tokens of the past, and its
    own chunk of ``chunk_size`` tokens up to itself."""

    page_budget: int
    page_size: int
    chunk_size: int


def attended_keys(seq_len: int, sparsity: PageSparsity | None = None) -> float:
    """Mean keys one query attends over a sequence of ``seq_len`` tokens: (seq_len + 1) / 2 causal (dense), or with
    ``sparsity`` its chunk's keys up to itself plus the past's up to the budget's pages."""
    if sparsity is None:
        return (seq_len + 1) / 2
    past_cap = sparsity.page_budget * sparsity.page_size
    total = 0.0
    for start in range(0, seq_len, sparsity.chunk_size):
        queries = min(sparsity.chunk_size, seq_len - start)
        total += queries * (queries + 1) / 2 + queries * min(start, past_cap)
    return total / seq_len


def step_flops(model_config, seq_len: int, batch_size: int = 1,
               sparsity: PageSparsity | None = None) -> tuple[float, float]:
    """(linear, attention) FLOPs of one training step over ``batch_size`` sequences of ``seq_len`` tokens,
    counted as full-sequence training without recomputation counts them; with ``sparsity``, attention over the
    keys each query attends (``attended_keys``: 12 FLOPs per query, key and head dimension, forward and backward)."""
    shape = ModelShape.from_config(model_config)
    h, d, kv, hidden = shape.heads, shape.head_dim, shape.kv_heads, shape.hidden
    mlp = 3 * hidden * shape.intermediate * max(1, shape.experts_per_token)
    layer = hidden * d * (h + 2 * kv) + h * d * hidden + mlp
    matmul_params = shape.num_layers * layer + shape.vocab * hidden
    linear = 6.0 * batch_size * seq_len * matmul_params
    if sparsity is None:
        attention = 6.0 * batch_size * seq_len**2 * shape.num_layers * h * d
    else:
        attention = 12.0 * batch_size * seq_len * attended_keys(seq_len, sparsity) * shape.num_layers * h * d
    return linear, attention


def predict_step_seconds(model_config, seq_len: int, batch_size: int = 1, rates: StepRates | None = None,
                         cache_attention: bool = True, sparsity: PageSparsity | None = None) -> float:
    """Predicted seconds of one step (no optimizer step) at ``rates``' setting and GPU (H200_DENSE, or H200_SPARSE
    with ``sparsity``); without the attention cache, with stage 2's extra attention forward (ATTENTION_FORWARD_SHARE,
    counted, not measured)."""
    if rates is None:
        rates = H200_DENSE if sparsity is None else H200_SPARSE
    linear, attention = step_flops(model_config, seq_len, batch_size, sparsity)
    if not cache_attention:
        attention *= 1 + ATTENTION_FORWARD_SHARE
    return linear * rates.linear_s_per_flop + attention * rates.attention_s_per_flop
