"""Memory planner: the bytes one training step needs, per item, before any work starts.

    plan_memory(config, options, shape, limits)          ->  MemoryPlan (GPU and host bytes, one row per item)
    plan_first_fitting(config, ..., choices=...)         ->  the first of alternative settings that fits
    largest_context(config, ..., choices=...)            ->  the longest seq_len whose plan fits with one of them

``options`` is the StepOptions the step runs with, ``shape`` the RunShape of what it trains
(oomb/engine/options.py): the one description of a step that the step, the planner and the trainer share.

What a step holds at its peak (stage 2, the recompute forward + backward of one chunk):

    parameters + gradients + optimizer states          (fixed; a 4-bit base: oomb/surgery/quantize.py)
    + fp32 master weights of 16-bit parameters          (master_weights=True)
    paged store: K, V, dK, dV pages + mean keys        (grows with the context; sliding layers: their windows')
    sparse page lists of every chunk                   (kept from stage 1 to stage 2)
    saved activations of one chunk, all layers         (formula below, measured per family)
      recompute="layer": of one layer, and every layer's input of the whole sequence (GPU or host)
    + max(fused loss workspace, one layer's backward temporaries)
    optimizer update workspace, where larger than what the step freed before it (the chunk's activations, the
    attention cache and the kept layer inputs on the GPU)
    CUDA context allowance

Each item is sized by the code that allocates it (the stores' and page lists' ``bytes_for``, the host stash's and
kept inputs' ``nbytes``, FlashAttention-4's workspace), parameters on a meta-device copy of the model (oomb/engine/
sizes.py), activations by the model of oomb/planning/activations.py (saved tensors per token, measured per family);
this module adds them up for one configuration and searches the longest context that fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from oomb.cache import PagedKVStore, PageLists, StoreBytes, StoreSpec
from oomb.engine.host_stash import HostAttentionCache, chunk_lengths_of
from oomb.engine.layer_recompute import LayerInputs
from oomb.engine.options import MemoryLimits, RunShape, StepOptions, with_changes
from oomb.engine.sizes import (
    OPTIMIZER_KINDS,
    ModelShape,
    ParameterCounts,
    count_parameters,
    dtype_name,
    itemsize,
    optimizer_state_bytes,
    store_spec,
)
from oomb.engine.step import check_architecture
from oomb.kernels.flash4 import KEY_SEGMENT, backward_workspace_bytes
from oomb.offload import OffloadedKVStore
from oomb.planning.activations import (
    LoraShape,
    checkpointed_bytes_per_token,
    fused_loss_bytes,
    layer_backward_bytes_per_token,
    measure_saved_activations,
    saved_bytes_per_token,
)
from oomb.sparse import DEFAULT_SCORE, store_key_summary
from oomb.surgery.quantize import nf4_weight_bytes

# The planner's names, importable from here as before the split into sizes and activations.
__all__ = [
    "AUTO_GPU_MARGIN_BYTES", "CUDA_CONTEXT_BYTES", "HOST_PROCESS_BYTES", "MEASURED_FAMILIES", "OPTIMIZER_KINDS",
    "LoraShape", "MeasuredLimits", "MemoryItem", "MemoryPlan", "ModelShape", "ParameterCounts", "StoreBytes",
    "checkpointed_bytes_per_token", "count_parameters", "format_bytes", "fused_loss_bytes", "largest_context",
    "layer_backward_bytes_per_token", "measure_saved_activations", "optimizer_state_bytes", "plan_first_fitting",
    "plan_memory", "saved_bytes_per_token", "store_spec"]

GiB = 2**30
# CUDA context, cuBLAS/Triton workspaces and caching-allocator slack: memory the process uses
# on the GPU outside torch's allocated bytes. An allowance, not a measurement (calibrate on the GPU).
CUDA_CONTEXT_BYTES = 1 * GiB
# offload_gpu_bytes="auto" leaves this much of the GPU free (allocator fragmentation, other processes).
AUTO_GPU_MARGIN_BYTES = 1 * GiB
# Host memory of a process not measured (interpreter, torch, transformers, CUDA libraries, data): an allowance
# (`oomb plan --host-memory`: another machine). The process that will train measures its own (MeasuredLimits).
HOST_PROCESS_BYTES = 4 * GiB
# Families whose saved-tensor formula was measured; others are planned with the llama formula.
MEASURED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt_oss", "granite", "gemma3_text")


@dataclass(frozen=True)
class MeasuredLimits(MemoryLimits):
    """Limits of the process that will train: process_bytes, its RSS (measured), is the plan's "process" item."""
    process_bytes: int = 0


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


def plan_memory(model_config, options: StepOptions, shape: RunShape, limits: MemoryLimits | None = None, *,
                offload_gpu_bytes: int | str | None = None) -> MemoryPlan:
    """Predict the peak bytes of one training step of ``model_config`` (a transformers config) run with ``options``
    (how the step runs: the same object chunked_backward takes) on ``shape`` (what it trains), checked against
    ``limits``.

    ``shape.device_type="cpu"`` puts every item in host memory (a CPU run); "cuda" puts the step on the GPU and
    the process on the host. Each item's bytes come from the code that allocates it: the stores' ``bytes_for``
    (oomb/cache/store.py, oomb/offload/store.py), the page lists' (oomb/cache/page_lists.py), the attention
    output cache's and the kept layer inputs' (oomb/engine/host_stash.py, layer_recompute.py), FlashAttention-4's
    gathered keys (oomb/kernels/flash4.py); parameters, gradients and optimizer states are counted on a meta-device
    copy of the model (oomb/engine/sizes.py), activations by the formulas of oomb/planning/activations.py.
    ``offload_gpu_bytes``: replaces ``options.offload_gpu_bytes``; "auto" keeps the first layers whole on the GPU
    that fit in what it has left after every other item, less 1 GiB. ``shape.tensor_parallel``: the plan of one of
    that many ranks: its store and page lists hold 1/T of the KV heads, it holds 1/T of the attention and MLP
    weights (their gradients and optimizer states) and all of the replicated ones; activations are planned as
    for one process (an upper bound). ``shape.master_weights``: fp32 copies of the 16-bit trainable parameters,
    fp32 optimizer states and fp32 gradients during the update; a no-op for fp32 parameters (LoRA adapters).
    ``shape.quantize="nf4"``: the linear layers bitsandbytes replaces hold NF4 weights (about 0.516 B a value),
    and a layer's backward holds one weight dequantized. The attention backend "fa4" (or "auto" on CUDA, where it
    may run) adds the keys and values FA4 reads gathered out of the pages.
    """
    limits = limits or MemoryLimits()
    if offload_gpu_bytes == "auto":  # the allowance is what the plan without it leaves
        base = plan_memory(model_config, dataclasses.replace(options, offload_gpu_bytes=0), shape, limits)
        headroom = 0
        if options.offload and shape.device_type == "cuda" and limits.gpu_bytes is not None:
            headroom = max(0, limits.gpu_bytes - base.gpu_bytes - AUTO_GPU_MARGIN_BYTES)
        return plan_memory(model_config, options, shape, limits, offload_gpu_bytes=headroom)
    if offload_gpu_bytes is not None:
        options = dataclasses.replace(options, offload_gpu_bytes=offload_gpu_bytes)  # checked by StepOptions
    if options.recompute != "chunk" and shape.layer_checkpointing:
        raise ValueError(f"recompute={options.recompute!r} rebuilds one layer at a time from kept inputs: not with "
                         "layer_checkpointing")
    model = ModelShape.from_config(model_config)
    notes = []
    if model.family not in MEASURED_FAMILIES:
        notes.append(f"activations of {model.family!r} are planned with the llama formula "
                     f"(measured families: {', '.join(MEASURED_FAMILIES)})")
    weights = _weights(model_config, shape)
    if shape.tensor_parallel > 1:
        notes.append(f"tensor parallel over {shape.tensor_parallel} ranks: one rank's paged store "
                     f"({model.kv_heads // shape.tensor_parallel} of {model.kv_heads} KV heads) and its shards of the "
                     "attention and MLP weights, gradients and optimizer states; activations are planned "
                     "unsplit (an upper bound)")
    architecture = check_architecture(model_config)  # UnsupportedModel (a ValueError) for what oomb cannot train
    selection = options.selection
    spec = store_spec(model_config, page_size=options.page_size, dtype=shape.dtype, grad_dtype=options.grad_dtype,
                      device="meta", tensor_parallel=shape.tensor_parallel,
                      calls_per_layer=architecture.calls_per_layer,
                      key_summary=store_key_summary(selection.score if selection is not None else None))
    items, freed = _step_items(model_config, model, spec, options, shape, weights)
    update = _update_bytes(weights, shape)
    gpu = shape.device_type == "cuda"

    def item(name: str, nbytes: int, note: str = "", *, host_always: bool = False) -> MemoryItem:
        on_gpu = gpu and not host_always
        return MemoryItem(name, nbytes if on_gpu else 0, 0 if on_gpu else nbytes, note)

    trainable = weights.trainable
    plan_items = [
        item("parameters", weights.params, (f"{sum(weights.four_bit):,} in NF4 (4-bit) + " if weights.four_bit else "")
             + f"{weights.plain:,} x {dtype_name(shape.dtype)}" + (" + adapters" if shape.lora_r > 0 else "")
             + (f" (one of {shape.tensor_parallel} tensor parallel ranks)" if shape.tensor_parallel > 1 else "")),
        item("gradients", weights.grads, (f"LoRA r={shape.lora_r}: " if shape.lora_r > 0 else "")
             + f"{sum(trainable):,} trainable ({dtype_name(weights.train_dtype)})"),
        item("optimizer states", weights.states, f"{shape.optimizer} ({dtype_name(weights.step_dtype)} moments)"
             if shape.optimizer == "adamw" else shape.optimizer),
        item("master weights", weights.masters, f"fp32 copies of the {sum(trainable):,} trainable parameters"
             if weights.masters else "off"),
        *[item(name, nbytes, note, host_always=host) for name, nbytes, note, host in items],
        item("optimizer update", max(0, update - freed), f"{format_bytes(update)} workspace"
             + (" (with the step's fp32 gradients)" if weights.masters else "")
             + ", counted beyond the chunk's activations"),
    ]
    store = _store_bytes(spec, options, shape)
    if options.offload:
        pages = -(-shape.seq_len // options.page_size)
        windows = "; sliding layers: what their windows reach" if spec.windows is not None else ""
        plan_items.append(MemoryItem("offloaded pages", 0, store.host, f"{shape.batch_size} x {pages} pages of K, V, "
                                     f"dK, dV and mean keys in pinned host memory{windows}"))
    if gpu:
        plan_items.append(MemoryItem("CUDA context", CUDA_CONTEXT_BYTES, 0, "allowance"))
    measured = isinstance(limits, MeasuredLimits)  # else the flat allowance: a plan for another machine's sizes
    note = "measured: this process's resident memory" if measured else "allowance (another host, not measured)"
    plan_items.append(MemoryItem("process", 0, limits.process_bytes if measured else HOST_PROCESS_BYTES,
                                 note + ": interpreter, libraries, data"))
    settings = {
        "family": model.family, "seq_len": shape.seq_len, "batch_size": shape.batch_size,
        "chunk_size": options.chunk_size, "page_size": options.page_size, "dtype": dtype_name(shape.dtype),
        "grad_dtype": dtype_name(options.grad_dtype or shape.dtype),
        "page_budget": selection.page_budget if selection is not None else None,
        "select_block": selection.block if selection is not None else 128,
        "select_score": selection.score if selection is not None else DEFAULT_SCORE,
        "chunk_pages": selection.chunk_pages if selection is not None else None, "lora_r": shape.lora_r,
        "optimizer": shape.optimizer, "master_weights": bool(weights.masters),
        "layer_checkpointing": shape.layer_checkpointing, "offload": options.offload,
        "offload_gpu_bytes": options.offload_gpu_bytes if options.offload else 0,
        "offload_resident_layers": store.resident_layers, "cache_attention": options.cache_attention,
        "recompute": options.recompute, "device_type": shape.device_type, "tensor_parallel": shape.tensor_parallel,
        "quantize": shape.quantize,
    }
    return MemoryPlan(items=plan_items, settings=settings, device_type=shape.device_type,
                      device_total_bytes=limits.gpu_bytes if gpu else None, host_total_bytes=limits.host_bytes,
                      notes=notes)


@dataclass(frozen=True)
class _Weights:
    """Parameters, gradients, optimizer states and master copies of one rank, and what is trained."""

    params: int  # bytes
    plain: int  # parameters held in the model's dtype
    four_bit: tuple[int, ...]  # numel of each NF4 weight
    trainable: tuple[int, ...]  # numel of each trained tensor
    train_dtype: torch.dtype
    step_dtype: torch.dtype  # what the optimizer steps
    grads: int
    states: int
    masters: int


def _weights(model_config, shape: RunShape) -> _Weights:
    counts = count_parameters(model_config, shape.lora_r, shape.lora_targets if shape.lora_r > 0 else (),
                              quantized=shape.quantize != "none")
    rank_tensors = counts.per_rank(shape.tensor_parallel)  # = counts.tensors in one process
    four_bit = tuple(n for n, q in zip(rank_tensors, counts.quantized, strict=True) if q) if counts.quantized else ()
    plain = sum(rank_tensors) - sum(four_bit)
    params = plain * itemsize(shape.dtype) + sum(nf4_weight_bytes(n) for n in four_bit)
    if shape.lora_r > 0:  # peft keeps adapters of a bf16/fp16 model in float32 (autocast_adapter_dtype=True)
        train_dtype = torch.float32 if shape.dtype in (torch.bfloat16, torch.float16) else shape.dtype
        trainable = counts.lora
        params += sum(trainable) * itemsize(train_dtype)
    else:
        train_dtype, trainable = shape.dtype, rank_tensors
    masters = shape.master_weights and train_dtype in (torch.bfloat16, torch.float16)
    step_dtype = torch.float32 if masters else train_dtype
    return _Weights(params=params, plain=plain, four_bit=four_bit, trainable=trainable, train_dtype=train_dtype,
                    step_dtype=step_dtype, grads=sum(trainable) * itemsize(train_dtype),
                    states=optimizer_state_bytes(shape.optimizer, trainable, step_dtype),
                    masters=4 * sum(trainable) if masters else 0)


def _store_bytes(spec: StoreSpec, options: StepOptions, shape: RunShape) -> StoreBytes:
    """The paged store's bytes, as the store the options choose allocates them."""
    if not options.offload:
        return PagedKVStore.bytes_for(spec, shape.batch_size, shape.seq_len, chunk_size=options.chunk_size)
    selection = options.selection
    listed = None
    if selection is not None:
        lists = spec.num_kv_heads if selection.per_head else 1
        listed = selection.pages_per_list(min(options.chunk_size, shape.seq_len)) * lists
    return OffloadedKVStore.bytes_for(spec, shape.batch_size, shape.seq_len, chunk_size=options.chunk_size,
                                      listed_pages=listed, gpu_bytes=options.offload_gpu_bytes)


def _update_bytes(weights: _Weights, shape: RunShape) -> int:
    """The optimizer update's workspace: torch AdamW with foreach (CUDA) builds sqrt(exp_avg_sq) of all states at
    once, its for-loop path (CPU) one tensor at a time; bitsandbytes updates in place. With master weights the
    step's gradients are fp32 copies, each replacing its 16-bit gradient as it is made."""
    update = 0
    if shape.optimizer == "adamw":
        numel = sum(weights.trainable) if shape.device_type == "cuda" else max(weights.trainable, default=0)
        update = numel * itemsize(weights.step_dtype)
    if weights.masters:
        update += (4 - itemsize(weights.train_dtype)) * sum(weights.trainable)
    return update


def _step_items(model_config, model: ModelShape, spec: StoreSpec, options: StepOptions, shape: RunShape,
                weights: _Weights) -> tuple[list[tuple[str, int, str, bool]], int]:
    """The step's items (name, bytes, note, in host memory whatever the device), and the bytes freed before the
    optimizer runs (the chunk's activations, and the attention cache and kept inputs where on the GPU)."""
    s = itemsize(shape.dtype)
    seq_len, batch = shape.seq_len, shape.batch_size
    chunk = min(options.chunk_size, seq_len)
    tokens = batch * chunk  # rows of one chunk
    selection, by_layer = options.selection, options.recompute != "chunk"
    store = _store_bytes(spec, options, shape)
    pages = -(-seq_len // options.page_size)
    page_lists = 0
    if selection is not None:
        layer_types = getattr(model_config, "layer_types", None) or ["full_attention"] * model.num_layers
        page_lists = PageLists.bytes_for(
            batch_size=batch, seq_len=seq_len, chunk_size=options.chunk_size, page_size=options.page_size,
            page_budget=selection.page_budget, block=selection.block,
            lists=spec.num_kv_heads if selection.per_head else 1,
            layers=sum(t == "full_attention" for t in layer_types))
    heads = model.heads // shape.tensor_parallel  # one rank's query heads
    cache = options.cache_attention
    attention_outputs = 0
    if cache:  # every stage-1 chunk's out and lse per attention layer until stage 2 (by layer or on the host: all)
        kept = chunk_lengths_of(seq_len, chunk, but_last=not (by_layer or cache == "host"))
        attention_outputs = HostAttentionCache.nbytes([(heads, layer.value_dim) for layer in spec.layers], kept,
                                                      batch, shape.dtype)
    kept_inputs = LayerInputs.nbytes(model.num_layers, chunk_lengths_of(seq_len, chunk), batch, model.hidden,
                                     shape.dtype) if by_layer else 0

    lora = LoraShape(shape.lora_r, weights_lora_modules(model_config, shape), weights.train_dtype,
                     fused=shape.lora_fused) if shape.lora_r > 0 else None
    per_layer, per_model = saved_bytes_per_token(model, shape.dtype, lora, fused_ops=shape.fused_ops)
    if by_layer:
        saved = tokens * (per_layer + per_model)  # the layer being rebuilt, and the model's own (final norm, RoPE)
        rebuilt = 2 * tokens * model.hidden * s if options.recompute == "layer-host" else 0  # in use, and the next
        saved_note = f"{per_layer} B/token of the one layer rebuilt + {per_model} B/token, {tokens} tokens"
    elif shape.layer_checkpointing:
        ck_layer, ck_model = checkpointed_bytes_per_token(model, shape.dtype, fused_ops=shape.fused_ops)
        saved = tokens * (model.num_layers * ck_layer + ck_model)
        rebuilt = tokens * per_layer  # the layer whose backward runs, recomputed with all its tensors
        saved_note = f"layer inputs of {model.num_layers} layers + one layer rebuilt, {tokens} tokens"
    else:
        saved = tokens * (model.num_layers * per_layer + per_model)
        rebuilt = 0
        saved_note = f"{per_layer} B/token/layer x {model.num_layers} layers + {per_model} B/token, {tokens} tokens"
    gpu = shape.device_type == "cuda"
    liger = options.loss_impl == "liger" or (options.loss_impl == "auto" and gpu)
    loss_ws = fused_loss_bytes(model, tokens, shape.dtype, liger=liger)
    mlp_grads, attention_grads = layer_backward_bytes_per_token(model, shape.dtype)
    fa4 = options.backend == "fa4" or (options.backend == "auto" and gpu)
    gathered = _fa4_gathered(model, options, shape) if fa4 else 0
    layer_ws = rebuilt + max(tokens * mlp_grads, tokens * attention_grads + gathered)
    if weights.four_bit:  # bitsandbytes dequantizes a 4-bit weight to the compute dtype for each matmul
        layer_ws += max(weights.four_bit) * s
    if cache == "host":  # the next layer's outputs on their way back from the host
        layer_ws += tokens * heads * (model.head_dim * s + 4)
    workspace = max(loss_ws, layer_ws)
    freed = (saved + workspace + (attention_outputs if cache != "host" else 0)
             + (kept_inputs if options.recompute == "layer" else 0))
    if options.offload:
        store_item = ("paged store (device part)", store.device,
                      f"{store.resident_layers} of {spec.num_layers} layers kept whole, block tables, two layer slots"
                      if store.resident_layers else
                      "block tables, two layer slots (pages and mean keys of one layer each)", False)
    else:
        store_item = ("paged store", store.device, PagedKVStore.describe(spec, batch, pages), False)
    items = [
        store_item,
        ("sparse page lists", page_lists, "dense" if selection is None else
         f"budget {selection.page_budget}, block {selection.block}"
         + ("" if selection.chunk_pages is None else f", at most {selection.chunk_pages} pages a chunk"), False),
        ("attention output cache", attention_outputs, "off" if not cache else
         "out + lse of every stage-1 chunk and layer (train.cache_attention)"
         + (" in pinned host memory" if cache == "host" else ""), cache == "host"),
        ("kept layer inputs", kept_inputs, "off (recompute=chunk)" if not by_layer else
         f"{model.num_layers + 1} x {model.hidden} values per token, {batch} x {seq_len} tokens"
         + (" (pinned host memory)" if options.recompute == "layer-host" else ""), options.recompute == "layer-host"),
        ("saved activations", saved, saved_note, False),
        ("chunk workspace", workspace, f"larger of fused loss {format_bytes(loss_ws)} and layer "
         f"backward {format_bytes(layer_ws)}" + (" (with a dequantized weight)" if weights.four_bit else ""), False),
    ]
    return items, freed


def weights_lora_modules(model_config, shape: RunShape) -> tuple[str, ...]:
    """The last names of the modules LoRA adapts (peft's choice for ``shape.lora_targets``)."""
    return count_parameters(model_config, shape.lora_r, shape.lora_targets).lora_modules


def _fa4_gathered(model: ModelShape, options: StepOptions, shape: RunShape) -> int:
    """FlashAttention-4's backward workspace (kernels/flash4.py): the keys one call reads gathered out of the pages.
    Dense: every key of the sequence, up to KEY_SEGMENT keys of the past and the chunk (a longer past is attended
    in segments, whose merged output and dQ add two float32 copies of the chunk's queries). Page-sparse: the pages
    the chunk's lists name and its own keys."""
    seq_len, chunk = shape.seq_len, min(options.chunk_size, shape.seq_len)
    heads, kv_heads = model.heads // shape.tensor_parallel, model.kv_heads // shape.tensor_parallel
    keys = min(seq_len, KEY_SEGMENT + options.chunk_size)
    merged = shape.batch_size * chunk * heads if seq_len > KEY_SEGMENT + options.chunk_size else 0
    selection = options.selection
    if selection is not None:
        lists = model.kv_heads if selection.per_head else 1
        keys = min(seq_len, lists * selection.pages_per_list(options.chunk_size) * options.page_size
                   + options.chunk_size)
        merged = 0
    return backward_workspace_bytes(shape.batch_size, keys, kv_heads, model.head_dim, itemsize(shape.dtype), merged)


def largest_context(model_config, options: StepOptions, shape: RunShape, limits: MemoryLimits | None = None, *,
                    choices: Sequence[dict] = ({},), max_seq_len: int = 1 << 40,
                    offload_gpu_bytes: int | str | None = None) -> int:
    """The longest seq_len (a multiple of the page size) whose plan fits with one of ``choices``; 0 if none does.

    ``choices``: alternatives for some of the settings (e.g. the values an "auto" setting may take), each a dict
    of StepOptions and RunShape fields laid over ``options`` and ``shape`` (``with_changes``); the answer is the
    longest over all of them, whatever their order. Memory grows with seq_len, so a choice's longest is found by
    bisection over multiples of the page size; a choice that does not fit one page beyond the longest found so far
    costs one plan.
    """
    page = options.page_size
    max_pages = max(1, max_seq_len // page)
    best = 0  # pages
    for choice in reversed(choices):  # the least memory is usually listed last: it gives the answer first
        chosen_options, chosen_shape = with_changes(options, shape, choice)

        def fits(pages: int, o=chosen_options, s=chosen_shape) -> bool:
            return plan_memory(model_config, o, dataclasses.replace(s, seq_len=pages * page), limits,
                               offload_gpu_bytes=offload_gpu_bytes).fits

        if best < max_pages and fits(best + 1):
            best = _last_fitting(fits, best + 1, max_pages)
    return best * page


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


def plan_first_fitting(model_config, options: StepOptions, shape: RunShape, limits: MemoryLimits | None = None, *,
                       choices: Sequence[dict], offload_gpu_bytes: int | str | None = None) -> tuple[MemoryPlan, int]:
    """The plan of the first of ``choices`` that fits, and that choice's index.

    ``choices`` as in largest_context, most preferred first; when none fits, the last one's plan
    (list the least memory last: its plan says how far the run is from fitting).
    """
    if not choices:
        raise ValueError("choices must hold at least one set of settings (an empty dict: the settings as given)")
    for index, choice in enumerate(choices):
        plan = plan_memory(model_config, *with_changes(options, shape, choice), limits,
                           offload_gpu_bytes=offload_gpu_bytes)
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



