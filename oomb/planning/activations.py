"""The activation model of the memory planner: what one chunk's recompute forward and backward hold.

Saved activations are what autograd keeps between the recompute forward and the backward.
The per-token formulas in ``saved_bytes_per_token`` were derived by counting the unique
non-parameter storages that ``torch.autograd.graph.saved_tensors_hooks`` sees during the
recompute forward of a chunk (``measure_saved_activations``, run on CPU for tiny models of
each family with distinct sizes so every tensor's shape names its term); the tests check
them against that measurement at other sizes. s = itemsize of the model dtype:

    RMSNorm (llama style)  4h (fp32 input) + 4 (rsqrt) + s*h (normalized, model dtype)
    RMSNorm (gpt_oss)      4h + 4 + 4h (its weight multiplies in fp32; Gemma-3's (1 + weight) too)
    decoder layer          2 norms + 2*s*h (inputs of q/k/v and of the MLP or router)
                           + 3*s*H*D (q after RoPE, attention output, o_proj input) + 4*H (lse)
    dense MLP              4*s*I (gate, act(gate), up, act(gate)*up)
    qwen3 q/k norms        (4 + s) * (H + H_kv) * D + 4 * (H + H_kv)
    Gemma-3                4 norms a layer (sandwich: after attention and after the MLP too), q/k norms
                           (4 + 4) * (H + H_kv) * D + 4 * (H + H_kv) (fp32 weight), GEGLU as the dense
                           MLP; a RoPE cos/sin pair per attention kind (local and global)
    gpt_oss MoE            8k + s*k (router top-k ids and weights)
                           + k * (2*s*h + 7*s*I + s + 1 + 32) (per routed token: sorted input and
                           output rows, gate_up [2I], clamp/glu/gated terms, weights, mask, 4 int64 ids)
    per model              final norm + 8 (token ids) + RoPE cos and sin (2*s*D per table; gpt_oss 2*s*D/2)
    layer checkpointing    s*h per layer (its input) + final norm + 8; one layer's full set is
                           rebuilt during that layer's backward
    LoRA (frozen base)     norms keep 4h + 4; a frozen linear saves nothing, an adapted one its
                           input cast to the adapter dtype + lora_A's output (see _linear_inputs);
                           fused LoRA (oomb.surgery.lora) its input as it is + lora_A's output in
                           the model dtype
    fused ops (liger)      an RMSNorm keeps its input in the model dtype and an fp32 rsqrt per row,
                           s*h + 4, trainable or not (LigerRMSNormFunction saves X, W, RSTD); the
                           SwiGLU keeps gate and up, 2*s*I (LigerSiLUMulFunction saves a, b), beside
                           down_proj's input. Read from liger-kernel 0.8.5's save_for_backward calls
                           (its kernels need CUDA, so no CPU measurement) and checked against the
                           H200 peaks of the fused-ops records (tests/engine/test_plan.py).

The measurement lives here too (``measure_saved_activations``), so the formula and the
oracle it is tested against sit side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oomb.engine.sizes import ModelShape, itemsize

# oomb's torch loss walks rows in blocks of this many bytes of fp32 logits
# (oomb.engine.loss._LOGITS_BLOCK_BYTES).
TORCH_LOSS_LOGITS_BLOCK = 64 * 2**20


# Model families whose norms (and SwiGLU MLPs; gpt_oss: norms only, its experts stay) oomb.surgery.fused_ops swaps
# for liger's, as these formulas count them. Gemma-3's fused norms and GEGLU are counted as transformers' (more).
FUSED_OPS_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite", "gpt_oss")
# Families whose RMSNorm multiplies by its weight in fp32 (it keeps the fp32 normalized values for the weight's
# gradient); Gemma-3's weight is a (1 + weight) offset.
FP32_WEIGHT_NORMS = ("gpt_oss", "gemma3_text")
# Families with a norm after attention and after the MLP as well as before each (Gemma's sandwich).
SANDWICH_NORMS = ("gemma3_text",)
# Families with RMSNorms over each head's queries and keys.
QK_NORMS = ("qwen3", "gemma3_text")


def _norm_bytes(h: int, s: int, family: str, trainable: bool = True, fused: bool = False) -> int:
    """Saved bytes per token of one RMSNorm over h values (see the module docstring).

    A frozen norm weight (LoRA) does not need the normalized values, only the fp32 input and rsqrt.
    liger's fused norm keeps its input in the model dtype and the rsqrt, whatever is trained.
    """
    if fused:
        return s * h + 4
    if not trainable:
        return 4 * h + 4
    return 4 * h + 4 + (4 * h if family in FP32_WEIGHT_NORMS else s * h)


@dataclass(frozen=True)
class LoraShape:
    """LoRA adapters as peft adds them: rank, the targeted linear names and the adapters' dtype; ``fused``: run
    by oomb.surgery.lora's fused layers (train lora.fused)."""

    r: int
    targets: tuple[str, ...]
    dtype: torch.dtype = torch.float32
    fused: bool = False


def _linear_inputs(shape: ModelShape, dtype: torch.dtype, lora: LoraShape | None) -> int:
    """Bytes per token the layer's linears save of their inputs (the rest of a layer does not change).

    Full fine-tuning: the q/k/v input (shared), the o_proj input, the gate/up input (shared) and
    the down_proj input, in the model dtype. LoRA: a frozen linear saves nothing (its input's
    gradient needs only the weight); an adapted one saves its input cast to the adapter dtype
    (one copy per adapter when the dtypes differ, the shared input otherwise) and lora_A's output;
    fused (oomb.surgery.lora), the shared input as it is and lora_A's output in the model dtype.
    """
    s = itemsize(dtype)
    h, hd, inter = shape.hidden, shape.heads * shape.head_dim, shape.intermediate
    groups = [(("q_proj", "k_proj", "v_proj"), h), (("o_proj",), hd)]
    if shape.family != "gpt_oss":  # gpt_oss: the router's input is counted with its MoE term
        groups += [(("gate_proj", "up_proj"), h), (("down_proj",), inter)]
    if lora is None:
        return sum(s * width for _, width in groups) + (s * h if shape.family == "gpt_oss" else 0)
    shared = lora.fused or lora.dtype == dtype  # one saved input for the group, in the model dtype
    a = s if lora.fused else itemsize(lora.dtype)
    total = 0
    for names, width in groups:
        adapted = [n for n in names if n in lora.targets]
        if adapted:
            total += s * width if shared else len(adapted) * a * width
            total += len(adapted) * a * lora.r
    return total


def saved_bytes_per_token(shape: ModelShape, dtype: torch.dtype, lora: LoraShape | None = None, *,
                          fused_ops: bool = False) -> tuple[int, int]:
    """(per decoder layer, per model) bytes autograd saves per token in the recompute forward.

    With ``lora`` every base weight is frozen: norms keep only their fp32 input and rsqrt, the
    first layer's input norm nothing (the frozen embedding's output needs no gradient), token ids
    are not kept; gpt_oss's MoE term stays that of full fine-tuning (not measured with LoRA).
    ``fused_ops``: liger's RMSNorm and SwiGLU in place of transformers' (families in FUSED_OPS_FAMILIES).
    """
    s = itemsize(dtype)
    h, hd, kvd = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    trainable = lora is None
    fused = fused_ops and shape.family in FUSED_OPS_FAMILIES
    norm = _norm_bytes(h, s, shape.family, trainable, fused)
    # 2 norms (4 with sandwich norms), q after RoPE and the attention output, log-sum-exp, the linears' inputs
    norms = 4 if shape.family in SANDWICH_NORMS else 2
    layer = norms * norm + 2 * s * hd + 4 * shape.heads + _linear_inputs(shape, dtype, lora)
    if shape.family == "gpt_oss":
        k = shape.experts_per_token
        layer += 8 * k + s * k + k * (2 * s * h + 7 * s * shape.intermediate + s + 1 + 32)
        rope = s * shape.head_dim  # cos and sin of half the head dimension each
    else:
        # act(gate)'s input, act(gate) and up (their product); liger's SwiGLU: gate and up
        layer += (2 if fused else 3) * s * shape.intermediate
        rope = 2 * s * shape.head_dim * shape.rope_tables
    if shape.family in QK_NORMS:  # q_norm / k_norm over each head
        kept = 4 if shape.family in FP32_WEIGHT_NORMS else s  # the normalized values, for a trained weight
        per_value = s if fused else 4 + (kept if trainable else 0)
        layer += per_value * (hd + kvd) + 4 * (shape.heads + shape.kv_heads)
    # per model: the final norm, token ids, RoPE; with LoRA the final norm's bytes equal those the
    # first layer's input norm does not save (its input, the frozen embedding's output, needs no gradient).
    model = norm + 8 + rope if trainable else rope
    return layer, model


def checkpointed_bytes_per_token(shape: ModelShape, dtype: torch.dtype, *, fused_ops: bool = False
                                 ) -> tuple[int, int]:
    """With per-layer checkpointing: (per layer, per model) saved bytes per token."""
    s = itemsize(dtype)
    fused = fused_ops and shape.family in FUSED_OPS_FAMILIES
    return s * shape.hidden, _norm_bytes(shape.hidden, s, shape.family, fused=fused) + 8


def layer_backward_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> tuple[int, int]:
    """Gradients alive at once inside one layer's backward: (the MLP's, attention's), per token. The MLP's backward
    runs first and frees its gradients before attention's begins, so a layer holds the larger of the two (with
    whatever attention's kernel gathers on top of attention's: the planner adds FlashAttention-4's keys there).

    Dense MLP: d(act*up), then d(act) and d(up), then d(gate): at most three [T, I] tensors.
    MoE: the same over the k routed rows of width 2I (gate_up). Attention: dq (model dtype),
    delta (fp32) and the chunk's dK/dV read back from the gradient pages (model dtype, twice:
    the read and its cast).
    """
    s = itemsize(dtype)
    if shape.family == "gpt_oss":
        mlp = 3 * s * shape.experts_per_token * 2 * shape.intermediate
    else:
        mlp = 3 * s * shape.intermediate
    attention = s * shape.heads * shape.head_dim + 4 * shape.heads + 4 * s * shape.kv_heads * shape.head_dim
    return mlp, attention


def fused_loss_bytes(shape: ModelShape, tokens: int, dtype: torch.dtype, *, liger: bool) -> int:
    """Workspace of the fused linear cross-entropy over ``tokens`` rows (held until its backward).

    liger (CUDA): grad_input [T, h] + grad_weight [V, h] in the model dtype, one logits chunk
    [rows, V] in the model dtype and fp32 per-row losses. oomb's torch path (CPU): grad_h [T, h],
    grad_w [V, h] fp32, a float32 copy of the weight unless it is already float32, and one
    64 MiB logits block.
    """
    s = itemsize(dtype)
    h, v = shape.hidden, shape.vocab
    if liger:
        # liger walks rows in chunks of next_pow2(ceil(T / ceil(V / hidden))) (liger-kernel 0.8.5,
        # chunk_mem_const 1).
        inc = -(-v // h)
        rows = min(1 << (max(1, -(-tokens // inc)) - 1).bit_length(), tokens)
        return s * tokens * h + s * v * h + s * rows * v + 4 * tokens
    weight_copy = 0 if s == 4 else 4 * v * h
    return s * tokens * h + 4 * v * h + weight_copy + TORCH_LOSS_LOGITS_BLOCK


def measure_saved_activations(model: torch.nn.Module, input_ids: torch.Tensor, *, page_size: int = 16,
                              backend: str = "torch") -> int:
    """Bytes autograd saves during the recompute forward of one chunk (``input_ids`` [B, C]).

    Counts the unique storages that ``saved_tensors_hooks`` sees, parameters excluded: the
    measurement the per-token formulas were derived from and are tested against. Runs the
    decoder exactly as stage 2 does (oomb attention, an empty store holding only this chunk).
    """
    from oomb.attention import StepContext, oomb_attention
    from oomb.cache import PagedKVStore, StoreSpec
    from oomb.engine.support import model_support
    from oomb.kernels import get_backend

    dtype = model.get_input_embeddings().weight.dtype
    support = model_support(model)
    spec = StoreSpec(layers=support.page_shapes, page_size=page_size, dtype=dtype, grad_dtype=dtype,
                     device=input_ids.device)
    store = PagedKVStore(spec)
    batch, tokens = input_ids.shape
    store.reserve(batch, tokens)
    store.append_chunk(tokens)
    step = StepContext(store=store, backend=get_backend(backend, input_ids.device.type), stage="recompute",
                       sites=support.site_map(model), site_layers=support.site_layers)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    positions = torch.arange(tokens, device=input_ids.device).expand(batch, -1)
    with oomb_attention(model, step), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_decoder()(input_ids=input_ids, position_ids=positions, use_cache=False)
    store.release()
    return sum(seen.values())
