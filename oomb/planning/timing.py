"""How long one exact (dense) training step takes, predicted from steps measured on a GPU.

A step's time has two parts: the matmuls and elementwise work of the layers and the LM head, linear
in the context (6 x tokens x matmul parameters FLOPs, counted without recomputation), and causal
attention, quadratic in it (6 x tokens^2 x layers x heads x head_dim FLOPs, forward and backward).
Each part runs at its own rate on a given GPU; two measured steps of different lengths give both
rates. The prediction is for the setting the rates were measured in, or without the attention cache
with stage 2's extra attention forward counted (ATTENTION_FORWARD_SHARE); other settings (shorter
chunks, offload) are slower or faster by amounts measured only at some lengths. Every layer is counted
as attending the whole context (sliding-window layers attend less).

The rates below ship as numbers; this is what they were measured on. One NVIDIA H200 (139.8 GiB), the
Qwen2.5-7B architecture with random init, bf16 parameters and gradients, one sequence per step, no
optimizer, in the setting `oomb train` picks for that model on that GPU: the FlashAttention-4 kernels
(the ``fa4`` backend), chunks of 16384 tokens, pages of 128, stage 2 rebuilt one layer at a time from
inputs kept in host memory (recompute="layer-host"), liger's fused RMSNorm, SwiGLU and RoPE, and the
attention cache (stage 1's attention outputs kept for stage 2). Each step was timed after a warm-up
step at its own length, the median of two.

- H200_DENSE solves the two parts from two dense steps: 65,536 tokens in 10.87 s (the attention
  cache on the GPU) and 262,144 tokens in 103.16 s (the cache in pinned host memory, which costs no
  time). That is 471 TFLOP/s of the linear FLOPs and 520 TFLOP/s of the attention FLOPs. Between
  the two it predicts 31.69 s at 131,072 tokens, where `oomb train` in the same setting measured
  31.65 s per step with its AdamW step included.

Page-sparse attention (a page budget per block of queries) counts the keys each query attends: its own
chunk's up to itself, and at most the budget's pages of the past (``attended_keys``). The linear part
runs at the dense rate; the attention part at a rate of its own, slower than dense FlashAttention's:
the pages are gathered and attended in blocks.

- H200_SPARSE's attention rate comes from one page-sparse step on the same machine: 131,072 tokens
  in 17.24 s, FA4's block sparsity, 64 pages of 128 tokens per block of 128 queries (pages ranked
  by the default "bound" score), chunks of 8192, the attention cache on the GPU, recompute="layer-host",
  fused ops. That is 342 TFLOP/s of the attended keys' FLOPs. Checked against a step it was not
  fitted to: 1,048,576 tokens on the same machine with the pages offloaded (so without the attention
  cache), one page list per chunk of 8192 with the same budget, 157.7 s measured, 152.5 s predicted.

The records of these steps, with their commands, are in the repository's benchmarks/results/
(core-7b-vs-transformers-64k.json, core-7b-vs-transformers-256k.json, train-7b-auto.json,
core-7b-sparse-128k-fa4-blocks.json, sparse-1m-7b.json; docs/benchmarks.md), and
tests/engine/test_timing.py refits the rates from them.
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
    basis="Qwen2.5-7B dense steps on one H200, no optimizer: 65,536 tokens in 10.87 s and 262,144 tokens in "
          "103.16 s; fa4 kernels, chunk 16384, attention cache, recompute layer-host, fused ops",
)

H200_SPARSE = StepRates(
    gpu="NVIDIA H200",
    linear_s_per_flop=H200_DENSE.linear_s_per_flop,
    attention_s_per_flop=2.9250e-15,  # 342 TFLOP/s of the attended keys' FLOPs (step_flops with a PageSparsity)
    basis="the linear rate of H200_DENSE; the attention rate from a Qwen2.5-7B page-sparse step on one H200, no "
          "optimizer: 131,072 tokens in 17.24 s; fa4 kernels with FA4's block sparsity, 64 pages of 128 per block "
          "of 128 queries, chunk 8192, attention cache, recompute layer-host, fused ops",
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
