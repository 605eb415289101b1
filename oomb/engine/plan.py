"""Memory planner: the bytes one training step needs, per item, before any work starts.

    plan_memory(config, seq_len=..., ...)   ->  MemoryPlan (GPU and host bytes, one row per item)
    largest_context(config, ...)             ->  the longest seq_len whose plan fits

What a step holds at its peak (stage 2, the recompute forward + backward of one chunk):

    parameters + gradients + optimizer states          (fixed)
    + fp32 master weights of 16-bit parameters          (master_weights=True)
    paged store: K, V, dK, dV pages + mean keys        (grows with the context: StoreSpec's page math)
    sparse page lists of every chunk                   (kept from stage 1 to stage 2)
    saved activations of one chunk, all layers         (formula below, measured per family)
    + max(fused loss workspace, one layer's backward temporaries)
    optimizer update workspace, where larger than the chunk's activations (they are freed by then)
    CUDA context allowance

Saved activations are what autograd keeps between the recompute forward and the backward.
The per-token formulas in ``saved_bytes_per_token`` were derived by counting the unique
non-parameter storages that ``torch.autograd.graph.saved_tensors_hooks`` sees during the
recompute forward of a chunk (``measure_saved_activations``, run on CPU for tiny models of
each family with distinct sizes so every tensor's shape names its term); the tests check
them against that measurement at other sizes. s = itemsize of the model dtype:

    RMSNorm (llama style)  4h (fp32 input) + 4 (rsqrt) + s*h (normalized, model dtype)
    RMSNorm (gpt_oss)      4h + 4 + 4h (its weight multiplies in fp32)
    decoder layer          2 norms + 2*s*h (inputs of q/k/v and of the MLP or router)
                           + 3*s*H*D (q after RoPE, attention output, o_proj input) + 4*H (lse)
    dense MLP              4*s*I (gate, act(gate), up, act(gate)*up)
    qwen3 q/k norms        (4 + s) * (H + H_kv) * D + 4 * (H + H_kv)
    gpt_oss MoE            8k + s*k (router top-k ids and weights)
                           + k * (2*s*h + 7*s*I + s + 1 + 32) (per routed token: sorted input and
                           output rows, gate_up [2I], clamp/glu/gated terms, weights, mask, 4 int64 ids)
    per model              final norm + 8 (token ids) + RoPE cos and sin (2*s*D; gpt_oss 2*s*D/2)
    layer checkpointing    s*h per layer (its input) + final norm + 8; one layer's full set is
                           rebuilt during that layer's backward
    LoRA (frozen base)     norms keep 4h + 4; a frozen linear saves nothing, an adapted one its
                           input cast to the adapter dtype + lora_A's output (see _linear_inputs)
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, field

import torch

from oomb.cache import StoreSpec
from oomb.sparse import DEFAULT_SCORE, store_key_summary

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
OPTIMIZER_KINDS = ("adamw", "adamw8bit", "paged_adamw8bit")
# bitsandbytes 8-bit optimizers: tensors of at least this many values get 8-bit states with
# one float32 absmax per block of this many values; smaller tensors keep two float32 states.
_BNB_MIN_8BIT_SIZE = 4096
_BNB_BLOCK = 256
# liger's fused linear cross-entropy walks rows in chunks of
# next_pow2(ceil(T / ceil(V / hidden))) (liger-kernel 0.8.5, chunk_mem_const 1).
_TORCH_LOSS_LOGITS_BLOCK = 64 * 2**20  # oomb.engine.loss._LOGITS_BLOCK_BYTES


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder architecture that memory depends on."""

    family: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # routed experts (0 = dense MLP)
    experts_per_token: int = 0

    @classmethod
    def from_config(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        return cls(
            family=config.model_type,
            num_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
            experts=getattr(config, "num_local_experts", 0) or 0,
            experts_per_token=getattr(config, "num_experts_per_tok", 0) or 0,
        )


def store_spec(config, *, page_size: int, dtype: torch.dtype, grad_dtype: torch.dtype | None,
               device: torch.device | str, tensor_parallel: int = 1, key_summary: str = "mean") -> StoreSpec:
    """The paged store's spec for a model config (the same spec the engine builds); with tensor
    parallelism, one rank's store: its kv_heads / tensor_parallel KV heads."""
    shape = ModelShape.from_config(config)
    if shape.kv_heads % tensor_parallel:
        raise ValueError(f"tensor parallel degree {tensor_parallel} does not divide the {shape.kv_heads} KV heads")
    return StoreSpec(
        num_layers=shape.num_layers, num_kv_heads=shape.kv_heads // tensor_parallel, head_dim=shape.head_dim,
        page_size=page_size, dtype=dtype, grad_dtype=grad_dtype or dtype, device=torch.device(device),
        key_summary=key_summary,
    )


# ---------------------------------------------------------------------------- activations
def _norm_bytes(h: int, s: int, family: str, trainable: bool = True) -> int:
    """Saved bytes per token of one RMSNorm over h values (see the module docstring).

    A frozen norm weight (LoRA) does not need the normalized values, only the fp32 input and rsqrt.
    """
    if not trainable:
        return 4 * h + 4
    return 4 * h + 4 + (4 * h if family == "gpt_oss" else s * h)


@dataclass(frozen=True)
class LoraShape:
    """LoRA adapters as peft adds them: rank, the targeted linear names and the adapters' dtype."""

    r: int
    targets: tuple[str, ...]
    dtype: torch.dtype = torch.float32


def _linear_inputs(shape: ModelShape, dtype: torch.dtype, lora: LoraShape | None) -> int:
    """Bytes per token the layer's linears save of their inputs (the rest of a layer does not change).

    Full fine-tuning: the q/k/v input (shared), the o_proj input, the gate/up input (shared) and
    the down_proj input, in the model dtype. LoRA: a frozen linear saves nothing (its input's
    gradient needs only the weight); an adapted one saves its input cast to the adapter dtype
    (one copy per adapter when the dtypes differ, the shared input otherwise) and lora_A's output.
    """
    s = _itemsize(dtype)
    h, hd, inter = shape.hidden, shape.heads * shape.head_dim, shape.intermediate
    groups = [(("q_proj", "k_proj", "v_proj"), h), (("o_proj",), hd)]
    if shape.family != "gpt_oss":  # gpt_oss: the router's input is counted with its MoE term
        groups += [(("gate_proj", "up_proj"), h), (("down_proj",), inter)]
    if lora is None:
        return sum(s * width for _, width in groups) + (s * h if shape.family == "gpt_oss" else 0)
    a = _itemsize(lora.dtype)
    total = 0
    for names, width in groups:
        adapted = [n for n in names if n in lora.targets]
        if adapted:
            total += (len(adapted) * a * width if lora.dtype != dtype else s * width)
            total += len(adapted) * a * lora.r
    return total


def saved_bytes_per_token(shape: ModelShape, dtype: torch.dtype, lora: LoraShape | None = None) -> tuple[int, int]:
    """(per decoder layer, per model) bytes autograd saves per token in the recompute forward.

    With ``lora`` every base weight is frozen: norms keep only their fp32 input and rsqrt, the
    first layer's input norm nothing (the frozen embedding's output needs no gradient), token ids
    are not kept; gpt_oss's MoE term stays that of full fine-tuning (not measured with LoRA).
    """
    s = _itemsize(dtype)
    h, hd, kvd = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    trainable = lora is None
    norm = _norm_bytes(h, s, shape.family, trainable)
    # 2 norms, q after RoPE and the attention output, log-sum-exp, the linears' inputs
    layer = 2 * norm + 2 * s * hd + 4 * shape.heads + _linear_inputs(shape, dtype, lora)
    if shape.family == "gpt_oss":
        k = shape.experts_per_token
        layer += 8 * k + s * k + k * (2 * s * h + 7 * s * shape.intermediate + s + 1 + 32)
        rope = s * shape.head_dim  # cos and sin of half the head dimension each
    else:
        layer += 3 * s * shape.intermediate  # act(gate)'s input, act(gate) and up (their product)
        rope = 2 * s * shape.head_dim
    if shape.family == "qwen3":
        layer += (4 + (s if trainable else 0)) * (hd + kvd) + 4 * (shape.heads + shape.kv_heads)
    # per model: the final norm, token ids, RoPE; with LoRA the final norm's bytes equal those the
    # first layer's input norm does not save.
    model = norm + 8 + rope if trainable else rope
    return layer, model


def checkpointed_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> tuple[int, int]:
    """With per-layer checkpointing: (per layer, per model) saved bytes per token."""
    s = _itemsize(dtype)
    return s * shape.hidden, _norm_bytes(shape.hidden, s, shape.family) + 8


def _layer_backward_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """Gradients alive at once inside one layer's backward (the MLP's, or attention's if larger).

    Dense MLP: d(act*up), then d(act) and d(up), then d(gate): at most three [T, I] tensors.
    MoE: the same over the k routed rows of width 2I (gate_up). Attention: dq (model dtype),
    delta (fp32) and the chunk's dK/dV read back from the gradient pages (model dtype, twice:
    the read and its cast).
    """
    s = _itemsize(dtype)
    if shape.family == "gpt_oss":
        mlp = 3 * s * shape.experts_per_token * 2 * shape.intermediate
    else:
        mlp = 3 * s * shape.intermediate
    attention = s * shape.heads * shape.head_dim + 4 * shape.heads + 4 * s * shape.kv_heads * shape.head_dim
    return max(mlp, attention)


def fused_loss_bytes(shape: ModelShape, tokens: int, dtype: torch.dtype, *, liger: bool) -> int:
    """Workspace of the fused linear cross-entropy over ``tokens`` rows (held until its backward).

    liger (CUDA): grad_input [T, h] + grad_weight [V, h] in the model dtype, one logits chunk
    [rows, V] in the model dtype and fp32 per-row losses. oomb's torch path (CPU): grad_h [T, h],
    grad_w [V, h] fp32, a float32 copy of the weight unless it is already float32, and one
    64 MiB logits block.
    """
    s = _itemsize(dtype)
    h, v = shape.hidden, shape.vocab
    if liger:
        inc = -(-v // h)
        rows = min(1 << (max(1, -(-tokens // inc)) - 1).bit_length(), tokens)
        return s * tokens * h + s * v * h + s * rows * v + 4 * tokens
    weight_copy = 0 if s == 4 else 4 * v * h
    return s * tokens * h + 4 * v * h + weight_copy + _TORCH_LOSS_LOGITS_BLOCK


# ---------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParameterCounts:
    """Parameter numbers of a model (counted on the meta device, no memory used)."""

    total: int  # every parameter (tied embeddings once)
    tensors: tuple[int, ...]  # numel of each parameter tensor
    lora: tuple[int, ...] = ()  # numel of each LoRA adapter tensor (A and B per targeted linear)
    split: tuple[bool, ...] = ()  # per tensor: split over tensor parallel ranks (oomb.engine.tensor_parallel)

    def per_rank(self, tensor_parallel: int) -> tuple[int, ...]:
        """numel of each parameter tensor on one of ``tensor_parallel`` ranks."""
        return tuple(n // tensor_parallel if split else n for n, split in zip(self.tensors, self.split, strict=True))


# Parameters apply_tensor_parallel splits (row- or column-wise; a row-parallel bias stays replicated).
_SPLIT = re.compile(r"self_attn\.([qkv]_proj\.(weight|bias)|o_proj\.weight|sinks)$|mlp\.(gate|up|down)_proj\.weight$")


@functools.lru_cache(maxsize=16)
def _count_parameters(config_json: str, model_type: str, lora_r: int, lora_targets: tuple[str, ...]) -> ParameterCounts:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    fields.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, KeyError, ImportError, RuntimeError) as e:
        raise ValueError(f"cannot build a {model_type!r} model from its config to count its parameters: {e}") from e
    named = list(model.named_parameters())
    tensors = tuple(p.numel() for _, p in named)
    split = tuple(bool(_SPLIT.search(name)) for name, _ in named)
    lora: list[int] = []
    if lora_r > 0:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in lora_targets:
                lora += [lora_r * module.in_features, module.out_features * lora_r]
    return ParameterCounts(total=sum(tensors), tensors=tensors, lora=tuple(lora), split=split)


def count_parameters(config, lora_r: int = 0, lora_targets: tuple[str, ...] = ()) -> ParameterCounts:
    """Parameters of ``config``'s causal LM and of the LoRA adapters peft would add."""
    return _count_parameters(config.to_json_string(use_diff=False), config.model_type, lora_r, tuple(lora_targets))


def optimizer_state_bytes(kind: str, numels: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of the optimizer's states for trainable tensors of these sizes (see oomb/train/optim.py).

    ``dtype``: of the tensors the optimizer steps (float32 for fp32 master weights).
    adamw: torch AdamW keeps exp_avg and exp_avg_sq in that dtype. adamw8bit and
    paged_adamw8bit: bitsandbytes 8-bit blockwise states (1 byte each + a float32 absmax per
    256 values) for tensors of 4096 values or more, two float32 states below that, and two
    256-entry float32 quantization maps.
    """
    if kind == "adamw":
        return 2 * _itemsize(dtype) * sum(numels)
    if kind in ("adamw8bit", "paged_adamw8bit"):
        total = 0
        for n in numels:
            total += 2 * n + 2 * 4 * -(-n // _BNB_BLOCK) if n >= _BNB_MIN_8BIT_SIZE else 8 * n
        if any(n >= _BNB_MIN_8BIT_SIZE for n in numels):
            total += 2 * 256 * 4  # the two 256-entry float32 quantization maps, shared by all tensors
        return total
    raise ValueError(f"unknown optimizer {kind!r}: choose one of {', '.join(OPTIMIZER_KINDS)}")


# ---------------------------------------------------------------------------- the plan
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
    lora_r: int = 0,
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    optimizer: str = "adamw",
    master_weights: bool = False,
    layer_checkpointing: bool = False,
    offload: bool = False,
    offload_gpu_bytes: int | str = 0,
    cache_attention: bool = False,
    device_type: str = "cuda",
    loss_impl: str = "auto",
    device_total_bytes: int | None = None,
    host_total_bytes: int | None = None,
    tensor_parallel: int = 1,
) -> MemoryPlan:
    """Predict the peak bytes of one training step of ``model_config`` (a transformers config).

    ``device_type="cpu"`` puts every item in host memory (a CPU run); "cuda" puts the step on
    the GPU and the process on the host. ``page_budget`` (sparse mode) adds the page lists
    kept between the stages. ``offload`` moves the pages to host memory and keeps two layer
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
    """
    arguments = dict(locals())  # the parameters, for the "auto" GPU allowance's second plan
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("chunk_size", chunk_size),
                        ("page_size", page_size), ("select_block", select_block)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if optimizer not in OPTIMIZER_KINDS:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_KINDS)}")
    if offload_gpu_bytes == "auto":
        settings = {k: v for k, v in arguments.items() if k not in ("model_config", "offload_gpu_bytes")}
        base = plan_memory(model_config, **settings)
        headroom = 0
        if offload and device_type == "cuda" and base.device_total_bytes is not None:
            headroom = max(0, base.device_total_bytes - base.gpu_bytes - AUTO_GPU_MARGIN_BYTES)
        return plan_memory(model_config, offload_gpu_bytes=headroom, **settings)
    if not isinstance(offload_gpu_bytes, int) or offload_gpu_bytes < 0:
        raise ValueError(f"offload_gpu_bytes must be a byte count >= 0 or 'auto', got {offload_gpu_bytes!r}")
    shape = ModelShape.from_config(model_config)
    notes = []
    if shape.family not in MEASURED_FAMILIES:
        notes.append(f"activations of {shape.family!r} are planned with the llama formula "
                     f"(measured families: {', '.join(MEASURED_FAMILIES)})")
    grad_dtype = grad_dtype or dtype
    s = _itemsize(dtype)
    chunk = min(chunk_size, seq_len)
    tokens = batch_size * chunk  # rows of one chunk

    counts = count_parameters(model_config, lora_r, tuple(lora_targets) if lora_r > 0 else ())
    rank_tensors = counts.per_rank(tensor_parallel)  # = counts.tensors in one process
    params = sum(rank_tensors) * s
    # peft keeps adapters of a bf16/fp16 model in float32 (autocast_adapter_dtype=True).
    lora_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    if lora_r > 0:
        trainable, train_dtype = counts.lora, lora_dtype
        params += sum(counts.lora) * _itemsize(lora_dtype)
    else:
        trainable, train_dtype = rank_tensors, dtype
    grads = sum(trainable) * _itemsize(train_dtype)
    masters = master_weights and train_dtype in (torch.bfloat16, torch.float16)
    step_dtype = torch.float32 if masters else train_dtype  # what the optimizer steps
    master_bytes = 4 * sum(trainable) if masters else 0
    states = optimizer_state_bytes(optimizer, trainable, step_dtype)

    if tensor_parallel > 1:
        notes.append(f"tensor parallel over {tensor_parallel} ranks: one rank's paged store "
                     f"({shape.kv_heads // tensor_parallel} of {shape.kv_heads} KV heads) and its shards of the "
                     "attention and MLP weights, gradients and optimizer states; activations are planned "
                     "unsplit (an upper bound)")
    spec = store_spec(model_config, page_size=page_size, dtype=dtype, grad_dtype=grad_dtype, device="meta",
                      tensor_parallel=tensor_parallel,
                      key_summary=store_key_summary(select_score if page_budget is not None else None))
    pages_per_seq = -(-seq_len // page_size)
    store = batch_size * pages_per_seq * spec.bytes_per_page() + batch_size * pages_per_seq * 4  # + page table
    store_host = resident = 0
    if offload:
        # Host: every page's K, V, dK, dV and mean key (pinned, exactly this size). Device: block
        # tables and two layer slots, each holding one layer's mean keys and the pages one kernel
        # call reads (all past pages when dense; the page lists' union when sparse: at most one
        # budget per selection block and list) plus the chunk's, grown by at most 5/4 over what
        # they held. offload_gpu_bytes keeps the first layers whole on the device instead.
        page_layer_bytes = spec.bytes_per_token() * page_size // spec.num_layers
        layer_pages = batch_size * pages_per_seq * page_layer_bytes  # one layer's K, V, dK, dV
        layer_means = spec.layer_bytes(batch_size * pages_per_seq) - layer_pages  # and its mean keys
        # as OffloadedKVStore.reserve
        resident = min(spec.num_layers, offload_gpu_bytes // spec.layer_bytes(batch_size * pages_per_seq))
        chunk_pages = -(-min(chunk_size, seq_len) // page_size)
        slot_pages = pages_per_seq
        if page_budget is not None:
            lists = spec.num_kv_heads if per_head_selection else 1
            chosen = -(-min(chunk_size, seq_len) // select_block) * page_budget * lists
            slot_pages = min(pages_per_seq, chosen + chunk_pages)
        offloaded = spec.num_layers - resident
        # Mean keys: the kept layers' on the device, the others' on the host, one layer's per slot.
        slots = (2 * batch_size * slot_pages * page_layer_bytes * 5 // 4 + 2 * layer_means) if offloaded else 0
        store_host = offloaded * (layer_pages + layer_means)
        # + the store's and two slots' tables
        store = resident * (layer_pages + layer_means) + slots + 3 * batch_size * pages_per_seq * 4

    page_lists = 0
    if page_budget is not None:
        # int32 [B, H_sel, ceil(C / block), budget] per full-attention layer, for every chunk whose
        # past holds more than `budget` pages (fewer: attention is dense, no list).
        h_sel = spec.num_kv_heads if per_head_selection else 1
        layer_types = getattr(model_config, "layer_types", None) or ["full_attention"] * shape.num_layers
        full_layers = sum(t == "full_attention" for t in layer_types)
        n_chunks = -(-seq_len // chunk)
        # Chunk k has k * chunk // page_size past pages: lists exist from k = ceil((budget + 1) * page / chunk).
        listed = max(0, n_chunks - -(-(page_budget + 1) * page_size // chunk))
        page_lists = 4 * batch_size * h_sel * -(-chunk // select_block) * page_budget * full_layers * listed

    attention_outputs = 0
    if cache_attention:
        # chunked_backward(cache_attention=True): out [B, H, C, D] in the model's dtype and lse [B, H, C]
        # float32 of every attention layer for every chunk of stage 1 (all but the last), until stage 2.
        stage1_tokens = batch_size * (-(-seq_len // chunk) - 1) * chunk
        heads = shape.heads // tensor_parallel  # one rank's query heads
        attention_outputs = stage1_tokens * shape.num_layers * heads * (shape.head_dim * s + 4)

    lora_shape = LoraShape(lora_r, tuple(lora_targets), lora_dtype) if lora_r > 0 else None
    per_layer, per_model = saved_bytes_per_token(shape, dtype, lora_shape)
    if layer_checkpointing:
        ck_layer, ck_model = checkpointed_bytes_per_token(shape, dtype)
        saved = tokens * (shape.num_layers * ck_layer + ck_model)
        rebuilt = tokens * per_layer  # the layer whose backward runs, recomputed with all its tensors
        saved_note = f"layer inputs of {shape.num_layers} layers + one layer rebuilt, {tokens} tokens"
    else:
        saved = tokens * (shape.num_layers * per_layer + per_model)
        rebuilt = 0
        saved_note = f"{per_layer} B/token/layer x {shape.num_layers} layers + {per_model} B/token, {tokens} tokens"
    liger = loss_impl == "liger" or (loss_impl == "auto" and device_type == "cuda")
    loss_ws = fused_loss_bytes(shape, tokens, dtype, liger=liger)
    layer_ws = rebuilt + tokens * _layer_backward_bytes_per_token(shape, dtype)
    workspace = max(loss_ws, layer_ws)
    activations = saved + workspace

    # torch AdamW with foreach (CUDA) builds sqrt(exp_avg_sq) of all states at once; the for-loop
    # path (CPU) one tensor at a time. bitsandbytes updates in place. With master weights the
    # step's gradients are fp32 copies, each replacing its 16-bit gradient as it is made.
    if optimizer == "adamw":
        update_numel = sum(trainable) if device_type == "cuda" else max(trainable, default=0)
        update = update_numel * _itemsize(step_dtype)
    else:
        update = 0
    if masters:
        update += (4 - _itemsize(train_dtype)) * sum(trainable)
    update_extra = max(0, update - activations)

    gpu = device_type == "cuda"

    def item(name: str, nbytes: int, note: str = "", *, host_always: bool = False) -> MemoryItem:
        on_gpu = gpu and not host_always
        return MemoryItem(name, nbytes if on_gpu else 0, 0 if on_gpu else nbytes, note)

    trainable_note = (f"LoRA r={lora_r}: {sum(trainable):,} trainable ({_name(train_dtype)})" if lora_r > 0
                      else f"{sum(trainable):,} trainable ({_name(train_dtype)})")
    items = [
        item("parameters", params, f"{sum(rank_tensors):,} x {_name(dtype)}" + (" + adapters" if lora_r > 0 else "")
             + (f" (one of {tensor_parallel} tensor parallel ranks)" if tensor_parallel > 1 else "")),
        item("gradients", grads, trainable_note),
        item("optimizer states", states, f"{optimizer} ({_name(step_dtype)} moments)" if optimizer == "adamw"
             else optimizer),
        item("master weights", master_bytes, f"fp32 copies of the {sum(trainable):,} trainable parameters"
             if masters else "off"),
        item("paged store", store, f"{batch_size} x {pages_per_seq} pages x {spec.bytes_per_page():,} B "
             f"(K, V, dK, dV, mean keys) + page table") if not offload else
        item("paged store (device part)", store, f"{resident} of {spec.num_layers} layers kept whole, "
             "block tables, two layer slots" if offload and resident else
             "block tables, two layer slots (pages and mean keys of one layer each)"),
        item("sparse page lists", page_lists, "dense" if page_budget is None else
             f"budget {page_budget}, block {select_block}"),
        item("attention output cache", attention_outputs, "off" if not cache_attention else
             "out + lse of every stage-1 chunk and layer (train.cache_attention)"),
        item("saved activations", saved, saved_note),
        item("chunk workspace", workspace, f"larger of fused loss {_gib(loss_ws)} and layer backward {_gib(layer_ws)}"),
        item("optimizer update", update_extra, f"{_gib(update)} workspace"
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
        "page_size": page_size, "dtype": _name(dtype), "grad_dtype": _name(grad_dtype), "page_budget": page_budget,
        "select_block": select_block, "select_score": select_score, "lora_r": lora_r, "optimizer": optimizer,
        "master_weights": masters,
        "layer_checkpointing": layer_checkpointing, "offload": offload,
        "offload_gpu_bytes": offload_gpu_bytes if offload else 0, "offload_resident_layers": resident,
        "cache_attention": cache_attention,
        "device_type": device_type, "tensor_parallel": tensor_parallel,
    }
    return MemoryPlan(items=items, settings=settings, device_type=device_type,
                      device_total_bytes=device_total_bytes if gpu else None,
                      host_total_bytes=host_total_bytes, notes=notes)


def largest_context(model_config, *, page_size: int = 128, max_seq_len: int = 1 << 40, **settings) -> int:
    """The longest seq_len (a multiple of ``page_size``) whose plan fits; 0 if none does.

    Takes plan_memory's keyword arguments (without seq_len); memory grows with seq_len, so
    the answer is found by bisection over multiples of page_size.
    """
    def fits(pages: int) -> bool:
        return plan_memory(model_config, seq_len=pages * page_size, page_size=page_size, **settings).fits

    lo, hi = 0, max(1, max_seq_len // page_size)  # fits(lo) holds (or lo == 0); find the last that fits
    if fits(hi):
        return hi * page_size
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
    return lo * page_size


def format_bytes(nbytes: int | None) -> str:
    """1536 -> '1.50 KiB'; GiB above 1 GiB, MiB above 1 MiB, and so on."""
    if nbytes is None:
        return "?"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


_gib = format_bytes


# ---------------------------------------------------------------------------- measurement
def measure_saved_activations(model: torch.nn.Module, input_ids: torch.Tensor, *, page_size: int = 16,
                              backend: str = "torch") -> int:
    """Bytes autograd saves during the recompute forward of one chunk (``input_ids`` [B, C]).

    Counts the unique storages that ``saved_tensors_hooks`` sees, parameters excluded: the
    measurement the per-token formulas were derived from and are tested against. Runs the
    decoder exactly as stage 2 does (oomb attention, an empty store holding only this chunk).
    """
    from oomb.attention import STEP_KWARG, StepContext, oomb_attention
    from oomb.cache import PagedKVStore
    from oomb.kernels import get_backend

    dtype = model.get_input_embeddings().weight.dtype
    spec = store_spec(model.config, page_size=page_size, dtype=dtype, grad_dtype=dtype, device=input_ids.device)
    store = PagedKVStore(spec)
    batch, tokens = input_ids.shape
    store.reserve(batch, tokens)
    store.append_chunk(tokens)
    step = StepContext(store=store, backend=get_backend(backend, input_ids.device.type), stage="recompute")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    positions = torch.arange(tokens, device=input_ids.device).expand(batch, -1)
    with oomb_attention(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_decoder()(input_ids=input_ids, position_ids=positions, use_cache=False, **{STEP_KWARG: step})
    store.release()
    return sum(seen.values())
