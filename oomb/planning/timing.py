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

The rates were measured in one setting; other settings run a share of its matrix work, counted, not fitted
(``linear_work``): the setting of the rates runs every layer's forward twice (stage 1, then the rebuild), the
input gradient and the weight gradient, four products of 2·N·P FLOPs each, as much as 8·N·P. LoRA and QLoRA
never form the frozen weights' gradient (three of the four); the whole sequence as one chunk with
recompute="chunk" runs the forward once. LoRA's adapters add their own low-rank products, which read and write
each adapted layer's input and output rows (memory-bound, not FLOP-bound: ``adapter_bytes_per_token``) at
ADAPTER_BYTES_PER_S, fitted to two LoRA steps on an H100.

- On an H100 (80 GB) the H200's rates predict the full-weight steps it measured within 2%: Llama-3-8B at 64K,
  12.74 s (12.76 predicted), Qwen3-8B 13.68 s (13.62 predicted); same compute, less memory bandwidth, which the
  matmuls and attention of these steps do not run short of. Granite-3.3-8B ran 5% slower than predicted,
  15.70 s (14.94 predicted).
- ADAPTER_BYTES_PER_S: Llama-3-8B with LoRA r=16 on every linear layer under `oomb train` on one H100 (its AdamW
  step on the adapters included), 11.98 s at 64K and 36.64 s at 128K; the fit predicts 11.86 s and 36.70 s.
  A 4-bit base (QLoRA) dequantizes its weights for each matmul, not counted: Llama-3-8B QLoRA r=32 on the same
  H100 ran 1.97 s at 16K, 12.33 s at 64K and 37.31 s at 128K, 13%, 4% and 2% over what this predicts.

The records of these steps, with their commands, are in the repository's benchmarks/results/
(core-7b-vs-transformers-64k.json, core-7b-vs-transformers-256k.json, train-7b-auto.json,
core-7b-sparse-128k-fa4-blocks.json, sparse-1m-7b.json; the H100's core-llama-3-8b-vs-transformers-64k.json,
core-qwen3-8b-vs-transformers-64k.json, core-granite-3.3-8b-vs-transformers-64k.json and
train-llama-3-8b-lora-64k-128k.json; docs/benchmarks.md), and tests/engine/test_timing.py refits the rates from
them.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomb.engine.sizes import ModelShape

__all__ = ["ADAPTER_BYTES_PER_S", "ATTENTION_FORWARD_SHARE", "H200_DENSE", "H200_SPARSE", "PageSparsity", "StepRates",
           "StepWork", "adapter_bytes_per_token", "attended_keys", "linear_work", "predict_step_seconds", "step_flops"]

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


# The adapters' low-rank products stream each adapted layer's rows through memory: bytes a second, fitted to the
# LoRA steps of the module docstring (an H100's; an H200 reads its memory 1.4x as fast, not counted).
ADAPTER_BYTES_PER_S = 2.861e12


@dataclass(frozen=True)
class StepWork:
    """What a step runs beside the rates' setting (module docstring): each layer's forward ``forwards`` times (2:
    stage 1 and the rebuild; 1: the whole sequence as one chunk), the weight gradients or not (LoRA: not), and
    the adapters' streamed bytes per token and layer (``adapter_bytes_per_token``; 0 without LoRA)."""

    forwards: int = 2
    weight_grads: bool = True
    adapter_bytes: int = 0


def linear_work(work: StepWork) -> float:
    """The linear part's matmul work as a share of the rates' setting: two forwards, the input gradient and the
    weight gradient, 2·N·P FLOPs each."""
    return (work.forwards + 1 + work.weight_grads) / 4


def adapter_bytes_per_token(model_config, modules: tuple[str, ...], forwards: int, dtype_bytes: int = 2) -> int:
    """Bytes the LoRA adapters of ``modules`` (peft's module names, e.g. q_proj, down_proj) stream per token and
    layer: each forward reads the layer input x [in] for x A^T and reads and writes the output [out] to add the
    adapter into it; the backward reads dY [out] twice (dY B, dB) and x once (dA), and reads and writes dx [in].
    Names this does not know (experts', a model's own) count nothing."""
    shape = ModelShape.from_config(model_config)
    h, q, kv, inner = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inner),
             "up_proj": (h, inner), "down_proj": (inner, h)}
    elements = sum(forwards * (i + 2 * o) + 2 * o + 3 * i for i, o in (sizes[m] for m in modules if m in sizes))
    return elements * dtype_bytes


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
                         cache_attention: bool = True, sparsity: PageSparsity | None = None,
                         work: StepWork = StepWork()) -> float:
    """Predicted seconds of one step (no optimizer step) at ``rates``' GPU (H200_DENSE, or H200_SPARSE with
    ``sparsity``) for the ``work`` it runs (default: the rates' setting; ``linear_work``, LoRA's adapters);
    without the attention cache, with stage 2's extra attention forward (ATTENTION_FORWARD_SHARE, counted, not
    measured), which a step computing each layer once (``work.forwards=1``) does not run."""
    if rates is None:
        rates = H200_DENSE if sparsity is None else H200_SPARSE
    linear, attention = step_flops(model_config, seq_len, batch_size, sparsity)
    if not cache_attention and work.forwards > 1:
        attention *= 1 + ATTENTION_FORWARD_SHARE
    adapters = batch_size * seq_len * ModelShape.from_config(model_config).num_layers * work.adapter_bytes
    return (linear * linear_work(work) * rates.linear_s_per_flop + attention * rates.attention_s_per_flop
            + adapters / ADAPTER_BYTES_PER_S)
