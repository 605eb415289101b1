"""Memory planner: the bytes one training step needs, per item, before any work starts.

    plan_memory(config, seq_len=..., ...)              ->  MemoryPlan (GPU and host bytes, one row per item)
    plan_first_fitting(config, choices, seq_len=...)    ->  the first of alternative settings that fits
    largest_context(config, choices=..., ...)           ->  the longest seq_len whose plan fits with one of them

What a step holds at its peak (stage 2, the recompute forward + backward of one chunk):

    parameters + gradients + optimizer states          (fixed; a 4-bit base: oomb/engine/quantize.py)
    + fp32 master weights of 16-bit parameters          (master_weights=True)
    paged store: K, V, dK, dV pages + mean keys        (grows with the context: StoreSpec's page math)
    sparse page lists of every chunk                   (kept from stage 1 to stage 2)
    saved activations of one chunk, all layers         (formula below, measured per family)
      recompute="layer": of one layer, and every layer's input of the whole sequence (GPU or host)
    + max(fused loss workspace, one layer's backward temporaries)
    optimizer update workspace, where larger than what the step freed before it (the chunk's activations, the
    attention cache and the kept layer inputs on the GPU)
    CUDA context allowance

The sizes of the fixed items and of the store are in oomb/engine/sizes.py, the activation
model (saved tensors per token, measured per family) in oomb/engine/activations.py; this
module adds them up for one configuration and searches the longest context that fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from oomb.engine.activations import (
    LoraShape,
    checkpointed_bytes_per_token,
    fused_loss_bytes,
    layer_backward_bytes_per_token,
    measure_saved_activations,
    saved_bytes_per_token,
)
from oomb.engine.layer_recompute import RECOMPUTE_MODES
from oomb.engine.prepare import require_int
from oomb.engine.quantize import QUANTIZE_KINDS, nf4_weight_bytes
from oomb.engine.sizes import (
    OPTIMIZER_KINDS,
    ModelShape,
    ParameterCounts,
    StoreBytes,
    count_parameters,
    dtype_name,
    itemsize,
    optimizer_state_bytes,
    page_list_bytes,
    paged_store_bytes,
    store_spec,
)
from oomb.engine.step import check_architecture
from oomb.kernels.flash4 import KEY_SEGMENT
from oomb.sparse import DEFAULT_SCORE, store_key_summary

# The planner's names, importable from here as before the split into sizes and activations.
__all__ = [
    "AUTO_GPU_MARGIN_BYTES", "CUDA_CONTEXT_BYTES", "HOST_PROCESS_BYTES", "MEASURED_FAMILIES", "OPTIMIZER_KINDS",
    "LoraShape", "MemoryItem", "MemoryPlan", "ModelShape", "ParameterCounts", "StoreBytes",
    "checkpointed_bytes_per_token", "count_parameters", "format_bytes", "fused_loss_bytes", "largest_context",
    "layer_backward_bytes_per_token", "measure_saved_activations", "optimizer_state_bytes", "page_list_bytes",
    "paged_store_bytes", "plan_first_fitting", "plan_memory", "saved_bytes_per_token", "store_spec",
]

GiB = 2**30
# CUDA context, cuBLAS/Triton workspaces and caching-allocator slack: memory the process uses
# on the GPU outside torch's allocated bytes. An allowance, not a measurement (calibrate on the GPU).
CUDA_CONTEXT_BYTES = 1 * GiB
# offload_gpu_bytes="auto" leaves this much of the GPU free (allocator fragmentation, other processes).
AUTO_GPU_MARGIN_BYTES = 1 * GiB
# Host memory of the Python process itself (interpreter, torch, transformers, CUDA libraries,
# data). An allowance, not a measurement.
HOST_PROCESS_BYTES = 4 * GiB
# Families whose saved-tensor formula was measured; others are planned with the llama formula.
MEASURED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt_oss")


@dataclass(frozen=True)
class MemoryItem:
    name: str
    gpu_bytes: int
    host_bytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    """Bytes one training step needs at its peak, item by item, and what is available."""

    items: list[MemoryItem]
    settings: dict
    device_type: str  # "cuda": GPU and host; "cpu": everything in host memory
    device_total_bytes: int | None  # None = not checked
    host_total_bytes: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_bytes(self) -> int:
        return sum(i.gpu_bytes for i in self.items)

    @property
    def host_bytes(self) -> int:
        return sum(i.host_bytes for i in self.items)

    @property
    def gpu_fits(self) -> bool:
        return self.device_total_bytes is None or self.gpu_bytes <= self.device_total_bytes

    @property
    def host_fits(self) -> bool:
        return self.host_total_bytes is None or self.host_bytes <= self.host_total_bytes

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_fits

    def summary(self) -> str:
        """One line: the planned peak against the memory it was planned for."""
        parts = []
        if self.device_type == "cuda":
            parts.append(f"GPU {format_bytes(self.gpu_bytes)} of {format_bytes(self.device_total_bytes)}")
        parts.append(f"host {format_bytes(self.host_bytes)} of {format_bytes(self.host_total_bytes)}")
        return "memory plan: " + ", ".join(parts)

    def to_dict(self) -> dict:
        return {
            "settings": self.settings,
            "device_type": self.device_type,
            "items": [asdict(i) for i in self.items],
            "gpu_bytes": self.gpu_bytes,
            "host_bytes": self.host_bytes,
            "device_total_bytes": self.device_total_bytes,
            "host_total_bytes": self.host_total_bytes,
            "fits": self.fits,
            "notes": self.notes,
        }


def plan_memory(
    model_config,
    *,
    seq_len: int,
    batch_size: int = 1,
    chunk_size: int = 4096,
    page_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    grad_dtype: torch.dtype | None = None,
    page_budget: int | None = None,
    select_block: int = 128,
    per_head_selection: bool = False,
    select_score: str = DEFAULT_SCORE,
    chunk_pages: int | None = None,
    lora_r: int = 0,
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    optimizer: str = "adamw",
    master_weights: bool = False,
    layer_checkpointing: bool = False,
    offload: bool = False,
    offload_gpu_bytes: int | str = 0,
    cache_attention: bool | str = False,
    device_type: str = "cuda",
    loss_impl: str = "auto",
    device_total_bytes: int | None = None,
    host_total_bytes: int | None = None,
    tensor_parallel: int = 1,
    attention: str = "triton",
    fused_ops: bool = False,
    quantize: str = "none",
    recompute: str = "chunk",
) -> MemoryPlan:
    """Predict the peak bytes of one training step of ``model_config`` (a transformers config).

    ``device_type="cpu"`` puts every item in host memory (a CPU run); "cuda" puts the step on
    the GPU and the process on the host. ``page_budget`` (sparse mode) adds the page lists
    kept between the stages; ``chunk_pages`` caps the pages a chunk's lists name (PageSelection.chunk_pages),
    which sizes an offloaded store's device slots. ``offload`` moves the pages to host memory and keeps two layer
    slots (and the mean keys) on the GPU, as oomb.offload.OffloadedKVStore does;
    ``offload_gpu_bytes`` lets it keep the first layers whose pages fit in that many bytes whole
    on the GPU ("auto": what the GPU has left after every other item, less 1 GiB).
    ``loss_impl`` as in chunked_backward ("auto": liger on CUDA). ``tensor_parallel``: the plan of
    one of that many ranks that split the heads: its paged store and page lists hold 1/T of the KV
    heads, and it holds 1/T of the attention and MLP weights (their gradients and optimizer
    states) and all of the replicated ones; activations are planned as for one process (an upper
    bound: the split layers keep 1/T of theirs). ``master_weights``: the optimizer steps fp32 copies
    of the 16-bit trainable parameters (oomb.train.optim.MasterWeights; `oomb train`'s default
    train.master_weights=auto in one process): 4 B per parameter, fp32 optimizer states, and fp32
    gradients during the step; a no-op when the trainable parameters are fp32 (LoRA adapters).
    ``attention``: the attention backend; "fa4" adds the keys and values it reads gathered out of the pages.
    ``fused_ops``: liger's RMSNorm and SwiGLU replace transformers' (oomb.engine.fused_ops), which keep less.
    ``quantize="nf4"`` (QLoRA, with ``lora_r`` > 0): the linear layers transformers' bitsandbytes quantizer
    replaces hold NF4 weights (oomb.engine.quantize.nf4_weight_bytes, about 0.516 B per value), the rest
    stays in ``dtype``; a layer's backward also holds one weight dequantized to ``dtype``.
    ``cache_attention="host"`` keeps the attention outputs in pinned host memory, with two layers' of one chunk
    on the GPU at a time. ``recompute`` as in chunked_backward: "layer" keeps every decoder layer's input (and
    the last output) of the whole sequence on the GPU, "layer-host" in pinned host memory with two of one
    chunk's on the GPU, and stage 2 rebuilds one layer's activations at a time; stage 1 runs the last chunk
    too, so the attention cache holds every chunk.
    """
    arguments = dict(locals())  # the parameters, for the "auto" GPU allowance's second plan
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("chunk_size", chunk_size),
                        ("page_size", page_size), ("select_block", select_block), ("tensor_parallel", tensor_parallel)):
        require_int(name, value, minimum=1)
    require_int("lora_r", lora_r, minimum=0)
    if page_budget is not None:
        require_int("page_budget", page_budget, minimum=1)
        if chunk_pages is not None:
            require_int("chunk_pages", chunk_pages, minimum=page_budget)
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if optimizer not in OPTIMIZER_KINDS:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_KINDS)}")
    if quantize not in QUANTIZE_KINDS:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_KINDS)}, got {quantize!r}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    if recompute != "chunk" and (offload or layer_checkpointing):
        raise ValueError(f"recompute={recompute!r} rebuilds one layer at a time from kept inputs: not with "
                         "offload or layer_checkpointing")
    if quantize != "none" and (lora_r == 0 or tensor_parallel > 1):
        raise ValueError("a 4-bit base (quantize='nf4') trains LoRA adapters (lora_r > 0) in one process "
                         "(tensor_parallel=1)")
    if offload_gpu_bytes == "auto":
        settings = {k: v for k, v in arguments.items() if k not in ("model_config", "offload_gpu_bytes")}
        base = plan_memory(model_config, **settings)
        headroom = 0
        if offload and device_type == "cuda" and base.device_total_bytes is not None:
            headroom = max(0, base.device_total_bytes - base.gpu_bytes - AUTO_GPU_MARGIN_BYTES)
        return plan_memory(model_config, offload_gpu_bytes=headroom, **settings)
    if isinstance(offload_gpu_bytes, bool) or not isinstance(offload_gpu_bytes, int) or offload_gpu_bytes < 0:
        raise ValueError(f"offload_gpu_bytes must be a byte count >= 0 or 'auto', got {offload_gpu_bytes!r}")
    shape = ModelShape.from_config(model_config)
    notes = []
    if shape.family not in MEASURED_FAMILIES:
        notes.append(f"activations of {shape.family!r} are planned with the llama formula "
                     f"(measured families: {', '.join(MEASURED_FAMILIES)})")
    grad_dtype = grad_dtype or dtype
    s = itemsize(dtype)
    chunk = min(chunk_size, seq_len)
    tokens = batch_size * chunk  # rows of one chunk

    counts = count_parameters(model_config, lora_r, tuple(lora_targets) if lora_r > 0 else (),
                              quantized=quantize != "none")
    rank_tensors = counts.per_rank(tensor_parallel)  # = counts.tensors in one process
    four_bit = [n for n, q in zip(rank_tensors, counts.quantized, strict=True) if q] if quantize != "none" else []
    params = (sum(rank_tensors) - sum(four_bit)) * s + sum(nf4_weight_bytes(n) for n in four_bit)
    # peft keeps adapters of a bf16/fp16 model in float32 (autocast_adapter_dtype=True).
    lora_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    if lora_r > 0:
        trainable, train_dtype = counts.lora, lora_dtype
        params += sum(counts.lora) * itemsize(lora_dtype)
    else:
        trainable, train_dtype = rank_tensors, dtype
    grads = sum(trainable) * itemsize(train_dtype)
    masters = master_weights and train_dtype in (torch.bfloat16, torch.float16)
    step_dtype = torch.float32 if masters else train_dtype  # what the optimizer steps
    master_bytes = 4 * sum(trainable) if masters else 0
    states = optimizer_state_bytes(optimizer, trainable, step_dtype)

    if tensor_parallel > 1:
        notes.append(f"tensor parallel over {tensor_parallel} ranks: one rank's paged store "
                     f"({shape.kv_heads // tensor_parallel} of {shape.kv_heads} KV heads) and its shards of the "
                     "attention and MLP weights, gradients and optimizer states; activations are planned "
                     "unsplit (an upper bound)")
    architecture = check_architecture(model_config)  # UnsupportedModel (a ValueError) for what oomb cannot train
    spec = store_spec(model_config, page_size=page_size, dtype=dtype, grad_dtype=grad_dtype, device="meta",
                      tensor_parallel=tensor_parallel, calls_per_layer=architecture.calls_per_layer,
                      key_summary=store_key_summary(select_score if page_budget is not None else None))
    pages_per_seq = -(-seq_len // page_size)
    store_bytes = paged_store_bytes(spec, batch_size=batch_size, seq_len=seq_len, chunk_size=chunk_size,
                                    offload=offload, offload_gpu_bytes=offload_gpu_bytes, page_budget=page_budget,
                                    select_block=select_block, per_head_selection=per_head_selection,
                                    chunk_pages=chunk_pages)
    store, store_host, resident = store_bytes.device, store_bytes.host, store_bytes.resident_layers
    page_lists = 0 if page_budget is None else page_list_bytes(
        model_config, spec, batch_size=batch_size, seq_len=seq_len, chunk_size=chunk_size, page_budget=page_budget,
        select_block=select_block, per_head_selection=per_head_selection)

    by_layer = recompute != "chunk"
    attention_outputs = 0
    if cache_attention:
        # chunked_backward(cache_attention=True): out [B, H, C, D] in the model's dtype and lse [B, H, C]
        # float32 of every attention layer for every chunk of stage 1 (all but the last; by layer: all), until
        # stage 2.
        # (in host memory the buffer is sized for every chunk: oomb.engine.prepare allocates it before the chunks run)
        every = by_layer or cache_attention == "host"
        stage1_tokens = batch_size * (seq_len if every else (-(-seq_len // chunk) - 1) * chunk)
        heads = shape.heads // tensor_parallel  # one rank's query heads
        attention_outputs = stage1_tokens * shape.num_layers * heads * (shape.head_dim * s + 4)

    lora_shape = LoraShape(lora_r, tuple(lora_targets), lora_dtype) if lora_r > 0 else None
    per_layer, per_model = saved_bytes_per_token(shape, dtype, lora_shape, fused_ops=fused_ops)
    # recompute="layer": each decoder layer's input and the last layer's output of every token, in the model's dtype.
    kept_inputs = batch_size * seq_len * (shape.num_layers + 1) * shape.hidden * s if by_layer else 0
    if by_layer:
        saved = tokens * (per_layer + per_model)  # the layer being rebuilt, and the model's own (final norm, RoPE)
        rebuilt = 2 * tokens * shape.hidden * s if recompute == "layer-host" else 0  # the input in use, the next
        saved_note = f"{per_layer} B/token of the one layer rebuilt + {per_model} B/token, {tokens} tokens"
    elif layer_checkpointing:
        ck_layer, ck_model = checkpointed_bytes_per_token(shape, dtype, fused_ops=fused_ops)
        saved = tokens * (shape.num_layers * ck_layer + ck_model)
        rebuilt = tokens * per_layer  # the layer whose backward runs, recomputed with all its tensors
        saved_note = f"layer inputs of {shape.num_layers} layers + one layer rebuilt, {tokens} tokens"
    else:
        saved = tokens * (shape.num_layers * per_layer + per_model)
        rebuilt = 0
        saved_note = f"{per_layer} B/token/layer x {shape.num_layers} layers + {per_model} B/token, {tokens} tokens"
    liger = loss_impl == "liger" or (loss_impl == "auto" and device_type == "cuda")
    loss_ws = fused_loss_bytes(shape, tokens, dtype, liger=liger)
    layer_ws = rebuilt + tokens * layer_backward_bytes_per_token(shape, dtype)
    if attention == "fa4":
        # FlashAttention-4 reads keys and values laid out contiguously (kernels/flash4.py): its backward holds the
        # layer's K and V gathered out of the pages, dK and dV, and fp32 dK/dV accumulators (GQA): 8 copies of
        # [keys, H_kv, D] in 16-bit units, beside the layer's own backward. Dense: every key of the sequence, up
        # to KEY_SEGMENT keys of the past and the chunk (longer pasts are attended in segments, whose merged output
        # and dQ add two float32 copies of the chunk's queries). A page-sparse call gathers at most the pages its
        # lists name and the chunk's own keys (kernels/flash4_sparse.py), or nothing where the Triton kernels run it.
        keys = min(seq_len, KEY_SEGMENT + chunk_size)
        heads = shape.heads // tensor_parallel
        merged = 2 * tokens * heads * shape.head_dim * 4 if seq_len > KEY_SEGMENT + chunk_size else 0
        if page_budget is not None:
            per_list = -(-chunk_size // select_block) * page_budget
            named = per_list if chunk_pages is None else min(per_list, chunk_pages)  # a capped chunk gathers its cap
            lists = shape.kv_heads if per_head_selection else 1
            keys, merged = min(seq_len, lists * named * page_size + chunk_size), 0
        layer_ws += 8 * batch_size * keys * (shape.kv_heads // tensor_parallel) * shape.head_dim * s + merged
    if four_bit:  # bitsandbytes dequantizes a 4-bit weight to the compute dtype for each matmul, forward and backward
        layer_ws += max(four_bit) * s
    if cache_attention == "host":  # the next layer's outputs on their way back from the host
        layer_ws += tokens * (shape.heads // tensor_parallel) * (shape.head_dim * s + 4)
    workspace = max(loss_ws, layer_ws)
    activations = saved + workspace

    # torch AdamW with foreach (CUDA) builds sqrt(exp_avg_sq) of all states at once; the for-loop
    # path (CPU) one tensor at a time. bitsandbytes updates in place. With master weights the
    # step's gradients are fp32 copies, each replacing its 16-bit gradient as it is made.
    if optimizer == "adamw":
        update_numel = sum(trainable) if device_type == "cuda" else max(trainable, default=0)
        update = update_numel * itemsize(step_dtype)
    else:
        update = 0
    if masters:
        update += (4 - itemsize(train_dtype)) * sum(trainable)
    # The optimizer steps after chunked_backward has returned: the chunk's activations, the attention cache and
    # the kept layer inputs (where they are on the GPU) are freed by then; the paged store stays between steps.
    # (H200, Qwen2.5-7B, AdamW, recompute=layer-host with the cache: the measured peak is the step's, not the
    # update's; benchmarks/results/train-7b-auto.json.)
    freed = (activations + (attention_outputs if cache_attention != "host" else 0)
             + (kept_inputs if recompute == "layer" else 0))
    update_extra = max(0, update - freed)

    gpu = device_type == "cuda"

    def item(name: str, nbytes: int, note: str = "", *, host_always: bool = False) -> MemoryItem:
        on_gpu = gpu and not host_always
        return MemoryItem(name, nbytes if on_gpu else 0, 0 if on_gpu else nbytes, note)

    trainable_note = (f"LoRA r={lora_r}: {sum(trainable):,} trainable ({dtype_name(train_dtype)})" if lora_r > 0
                      else f"{sum(trainable):,} trainable ({dtype_name(train_dtype)})")
    items = [
        item("parameters", params, (f"{sum(four_bit):,} in NF4 (4-bit) + " if four_bit else "")
             + f"{sum(rank_tensors) - sum(four_bit):,} x {dtype_name(dtype)}" + (" + adapters" if lora_r > 0 else "")
             + (f" (one of {tensor_parallel} tensor parallel ranks)" if tensor_parallel > 1 else "")),
        item("gradients", grads, trainable_note),
        item("optimizer states", states, f"{optimizer} ({dtype_name(step_dtype)} moments)" if optimizer == "adamw"
             else optimizer),
        item("master weights", master_bytes, f"fp32 copies of the {sum(trainable):,} trainable parameters"
             if masters else "off"),
        item("paged store", store, f"{batch_size} x {pages_per_seq} pages x {spec.bytes_per_page():,} B "
             f"(K, V, dK, dV, mean keys) + page table") if not offload else
        item("paged store (device part)", store, f"{resident} of {spec.num_layers} layers kept whole, "
             "block tables, two layer slots" if offload and resident else
             "block tables, two layer slots (pages and mean keys of one layer each)"),
        item("sparse page lists", page_lists, "dense" if page_budget is None else
             f"budget {page_budget}, block {select_block}"
             + ("" if chunk_pages is None else f", at most {chunk_pages} pages a chunk")),
        item("attention output cache", attention_outputs, "off" if not cache_attention else
             "out + lse of every stage-1 chunk and layer (train.cache_attention)"
             + (" in pinned host memory" if cache_attention == "host" else ""), host_always=cache_attention == "host"),
        item("kept layer inputs", kept_inputs, "off (recompute=chunk)" if not by_layer else
             f"{shape.num_layers + 1} x {shape.hidden} values per token, {batch_size} x {seq_len} tokens"
             + (" (pinned host memory)" if recompute == "layer-host" else ""), host_always=recompute == "layer-host"),
        item("saved activations", saved, saved_note),
        item("chunk workspace", workspace, f"larger of fused loss {format_bytes(loss_ws)} and layer "
             f"backward {format_bytes(layer_ws)}" + (" (with a dequantized weight)" if four_bit else "")),
        item("optimizer update", update_extra, f"{format_bytes(update)} workspace"
             + (" (with the step's fp32 gradients)" if masters else "") + ", counted beyond the chunk's activations"),
    ]
    if offload:
        items.append(MemoryItem("offloaded pages", 0, store_host, f"{batch_size} x {pages_per_seq} pages of K, V, "
                                "dK, dV and mean keys in pinned host memory"))
    if gpu:
        items.append(MemoryItem("CUDA context", CUDA_CONTEXT_BYTES, 0, "allowance"))
    items.append(MemoryItem("process", 0, HOST_PROCESS_BYTES, "allowance: interpreter, libraries, data"))
    settings = {
        "family": shape.family, "seq_len": seq_len, "batch_size": batch_size, "chunk_size": chunk_size,
        "page_size": page_size, "dtype": dtype_name(dtype), "grad_dtype": dtype_name(grad_dtype),
        "page_budget": page_budget,
        "select_block": select_block, "select_score": select_score, "chunk_pages": chunk_pages, "lora_r": lora_r,
        "optimizer": optimizer,
        "master_weights": masters,
        "layer_checkpointing": layer_checkpointing, "offload": offload,
        "offload_gpu_bytes": offload_gpu_bytes if offload else 0, "offload_resident_layers": resident,
        "cache_attention": cache_attention, "recompute": recompute,
        "device_type": device_type, "tensor_parallel": tensor_parallel, "quantize": quantize,
    }
    return MemoryPlan(items=items, settings=settings, device_type=device_type,
                      device_total_bytes=device_total_bytes if gpu else None,
                      host_total_bytes=host_total_bytes, notes=notes)


def largest_context(model_config, *, page_size: int = 128, max_seq_len: int = 1 << 40,
                    choices: Sequence[dict] = ({},), **settings) -> int:
    """The longest seq_len (a multiple of ``page_size``) whose plan fits with one of ``choices``; 0 if none does.

    Takes plan_memory's keyword arguments (without seq_len). ``choices``: alternatives for some of
    them (e.g. the values an "auto" setting may take), each a dict laid over ``settings``; the answer
    is the longest over all of them, whatever their order. Memory grows with seq_len, so a choice's
    longest is found by bisection over multiples of page_size; a choice that does not fit one page
    beyond the longest found so far costs one plan.
    """
    max_pages = max(1, max_seq_len // page_size)
    best = 0  # pages
    for choice in reversed(choices):  # the least memory is usually listed last: it gives the answer first
        def fits(pages: int, choice=choice) -> bool:
            return plan_memory(model_config, seq_len=pages * page_size, page_size=page_size,
                               **{**settings, **choice}).fits

        if best < max_pages and fits(best + 1):
            best = _last_fitting(fits, best + 1, max_pages)
    return best * page_size


def _last_fitting(fits, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with fits(n), given fits(lo) and fits false from some n on."""
    if fits(hi):
        return hi
    step = 1
    while lo + step < hi and fits(lo + step):  # gallop: contexts that fit are usually far below hi
        lo, step = lo + step, step * 2
    hi = min(hi, lo + step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def plan_first_fitting(model_config, choices: Sequence[dict], *, seq_len: int, **settings) -> tuple[MemoryPlan, int]:
    """The plan at ``seq_len`` of the first of ``choices`` that fits, and that choice's index.

    ``choices`` as in largest_context, most preferred first; when none fits, the last one's plan
    (list the least memory last: its plan says how far the run is from fitting).
    """
    if not choices:
        raise ValueError("choices must hold at least one set of settings (an empty dict: the settings as given)")
    for index, choice in enumerate(choices):
        plan = plan_memory(model_config, seq_len=seq_len, **{**settings, **choice})
        if plan.fits:
            return plan, index
    return plan, len(choices) - 1


def format_bytes(nbytes: int | None) -> str:
    """1536 -> '1.50 KiB'; GiB above 1 GiB, MiB above 1 MiB, and so on."""
    if nbytes is None:
        return "?"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"



