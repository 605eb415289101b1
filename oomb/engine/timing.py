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
(ATTENTION_FORWARD_SHARE); other settings (shorter chunks, offload) and page-sparse attention are slower or
faster by amounts measured only at some lengths (docs/benchmarks.md). Every layer is
counted as attending the whole context (sliding-window layers attend less).
"""

from __future__ import annotations

from dataclasses import dataclass

from oomb.engine.sizes import ModelShape

__all__ = ["ATTENTION_FORWARD_SHARE", "H200_DENSE", "StepRates", "predict_step_seconds", "step_flops"]

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


def step_flops(model_config, seq_len: int, batch_size: int = 1) -> tuple[float, float]:
    """(linear, attention) FLOPs of one training step over ``batch_size`` sequences of ``seq_len`` tokens,
    counted as full-sequence training without recomputation counts them."""
    shape = ModelShape.from_config(model_config)
    h, d, kv, hidden = shape.heads, shape.head_dim, shape.kv_heads, shape.hidden
    mlp = 3 * hidden * shape.intermediate * max(1, shape.experts_per_token)
    layer = hidden * d * (h + 2 * kv) + h * d * hidden + mlp
    matmul_params = shape.num_layers * layer + shape.vocab * hidden
    linear = 6.0 * batch_size * seq_len * matmul_params
    attention = 6.0 * batch_size * seq_len**2 * shape.num_layers * h * d
    return linear, attention


def predict_step_seconds(model_config, seq_len: int, batch_size: int = 1, rates: StepRates = H200_DENSE,
                         cache_attention: bool = True) -> float:
    """Predicted seconds of one exact step (no optimizer step) at ``rates``' setting and GPU; without the attention
    cache, with stage 2's extra attention forward (ATTENTION_FORWARD_SHARE, counted, not measured)."""
    linear, attention = step_flops(model_config, seq_len, batch_size)
    if not cache_attention:
        attention *= 1 + ATTENTION_FORWARD_SHARE
    return linear * rates.linear_s_per_flop + attention * rates.attention_s_per_flop
