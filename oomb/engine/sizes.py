"""Sizes a training step's memory is made of, apart from activations (oomb/planning/activations.py).

    ModelShape.from_config(config)     the decoder's sizes (a supported architecture, or a clear error)
    config_page_shapes / store_spec    the paged store's layers as a config describes them, and its spec
                                       (its bytes: the stores' own bytes_for)
    count_parameters                   parameters (meta device), the LoRA adapters peft would add and which
                                       weights a 4-bit base quantizes (oomb/surgery/quantize.py)
    optimizer_state_bytes              AdamW / bitsandbytes 8-bit states

The memory planner (oomb/planning/plan.py) adds these up with the activations into one plan.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import torch

from oomb.cache import PageShape, StoreSpec
from oomb.surgery.adapters import ALL_LINEAR, lora_numels
from oomb.surgery.quantize import quantized_linear_names

OPTIMIZER_KINDS = ("adamw", "adamw8bit", "paged_adamw8bit")
# bitsandbytes 8-bit optimizers: tensors of at least this many values get 8-bit states with
# one float32 absmax per block of this many values; smaller tensors keep two float32 states.
_BNB_MIN_8BIT_SIZE = 4096
_BNB_BLOCK = 256


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


# The config fields the memory planner reads a decoder's sizes from, in transformers' common names (a config's
# attribute_map covers most others); the MLP width may be named otherwise or left to its GPT-2-era default.
MODEL_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
_MLP_WIDTH_FIELDS = ("intermediate_size", "ffn_dim", "decoder_ffn_dim", "n_inner", "ffn_hidden_size")


def check_model_config(config) -> None:
    """Raise ValueError, naming the model type and the fields, where a config lacks a size the planner needs."""
    missing = [name for name in MODEL_SIZE_FIELDS if getattr(config, name, None) is None]
    if missing:
        raise ValueError(
            f"oomb cannot plan the memory of {getattr(config, 'model_type', None)!r} models ({type(config).__name__}): "
            f"the planner reads a decoder's sizes from the config fields {', '.join(MODEL_SIZE_FIELDS)}, and this one "
            f"has no {', '.join(missing)}. Set train.memory_check=false to train without a plan"
        )


def mlp_width(config) -> int:
    """The MLP's inner width: the first of the usual fields the config sets, else 4 x hidden (GPT-2's default)."""
    return next((w for name in _MLP_WIDTH_FIELDS if (w := getattr(config, name, None))), 4 * config.hidden_size)


def _rope_tables(config) -> int:
    """How many RoPE cos/sin pairs a forward keeps: Gemma-3 computes one per attention kind its layers use (local
    layers have their own base); the other families, one."""
    if config.model_type != "gemma3_text":
        return 1
    return len(set((getattr(config, "layer_types", None) or ["full_attention"])[: config.num_hidden_layers]))


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
    rope_tables: int = 1  # RoPE cos/sin pairs a forward computes and keeps (Gemma-3: its local and global bases)

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """The sizes of a transformers config; ValueError for a config oomb does not support."""
        check_model_config(config)
        heads = config.num_attention_heads
        return cls(
            family=config.model_type,
            num_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=mlp_width(config),
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
            experts=getattr(config, "num_local_experts", 0) or 0,
            experts_per_token=getattr(config, "num_experts_per_tok", 0) or 0,
            rope_tables=_rope_tables(config),
        )


def config_page_shapes(config, *, calls_per_layer: int = 1) -> tuple[PageShape, ...]:
    """The K/V shape of each attention call of a forward, read from a decoder config: per-layer configs where the
    config has them (``per_layer_config``), latent attention's key (``qk_nope_head_dim + qk_rope_head_dim``) and
    value (``v_head_dim``) head sizes, ``num_key_value_heads`` (else every head has its own K/V), ``head_dim`` (else
    hidden_size / heads). The store the engine allocates is shaped by the model's own calls (oomb.engine.support);
    tests check that this reading of the config agrees with them for every family the sweep trains."""
    check_model_config(config)
    per_layer = getattr(config, "per_layer_config", None) if getattr(config, "is_heterogeneous", False) else None
    shapes = []
    for layer in range(config.num_hidden_layers):
        c = per_layer[layer] if per_layer else config
        heads = c.num_attention_heads
        if getattr(c, "qk_nope_head_dim", None) is not None and getattr(c, "qk_rope_head_dim", None) is not None:
            key_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
            value_dim = getattr(c, "v_head_dim", None) or key_dim
            kv_heads = heads  # the latent is expanded to every head's own keys and values
        else:
            key_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
            value_dim = getattr(c, "v_head_dim", None) or key_dim
            kv_heads = getattr(c, "num_key_value_heads", None) or heads
        shapes += [PageShape(kv_heads, key_dim, value_dim)] * calls_per_layer
    return tuple(shapes)


def store_spec(config, *, page_size: int, dtype: torch.dtype, grad_dtype: torch.dtype | None,
               device: torch.device | str, tensor_parallel: int = 1, key_summary: str = "mean",
               calls_per_layer: int = 1) -> StoreSpec:
    """The paged store's spec for a model config, as the planner counts it (``config_page_shapes``); with tensor
    parallelism, one rank's store: its kv_heads / tensor_parallel KV heads per layer."""
    shapes = config_page_shapes(config, calls_per_layer=calls_per_layer)
    odd = sorted({s.kv_heads for s in shapes if s.kv_heads % tensor_parallel})
    if odd:
        raise ValueError(f"tensor parallel degree {tensor_parallel} does not divide the "
                         f"{' or '.join(map(str, odd))} KV heads")
    return StoreSpec(
        layers=tuple(PageShape(s.kv_heads // tensor_parallel, s.key_dim, s.value_dim) for s in shapes),
        page_size=page_size, dtype=dtype, grad_dtype=grad_dtype or dtype, device=torch.device(device),
        key_summary=key_summary, windows=config_windows(config, calls_per_layer=calls_per_layer),
    )


def config_windows(config, *, calls_per_layer: int = 1) -> tuple[int | None, ...] | None:
    """Each attention call's sliding window, read from a decoder config as transformers' layers read it: a
    ``layer_types`` entry "sliding_attention" attends ``sliding_window`` tokens back. None where the config lists
    no layer types (the planned store then keeps every page: an upper bound of what the engine's store, shaped by
    the model's own calls, holds); tests check the two agree for the families with windows."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "is_heterogeneous", False) or not types or not window or len(types) != config.num_hidden_layers:
        return None
    return tuple(window if kind == "sliding_attention" else None for kind in types for _ in range(calls_per_layer))


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter numbers of a model (counted on the meta device, no memory used)."""

    total: int  # every parameter (tied embeddings once)
    tensors: tuple[int, ...]  # numel of each parameter tensor
    lora: tuple[int, ...] = ()  # numel of each LoRA adapter tensor (A and B per targeted linear)
    lora_modules: tuple[str, ...] = ()  # last names of the adapted modules (q_proj, ..., experts)
    split: tuple[bool, ...] = ()  # per tensor: split over tensor parallel ranks (oomb.surgery.tensor_parallel)
    quantized: tuple[bool, ...] = ()  # per tensor: a weight a 4-bit base holds in NF4 (counted when asked)

    def per_rank(self, tensor_parallel: int) -> tuple[int, ...]:
        """numel of each parameter tensor on one of ``tensor_parallel`` ranks."""
        return tuple(n // tensor_parallel if split else n for n, split in zip(self.tensors, self.split, strict=True))


# Parameters apply_tensor_parallel splits (row- or column-wise; a row-parallel bias stays replicated).
_SPLIT = re.compile(r"self_attn\.([qkv]_proj\.(weight|bias)|o_proj\.weight|sinks)$|mlp\.(gate|up|down)_proj\.weight$")


@functools.lru_cache(maxsize=16)
def _count_parameters(config_json: str, model_type: str, lora_r: int, lora_targets: tuple[str, ...],
                      quantized: bool) -> ParameterCounts:
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
    four_bit = {f"{name}.weight" for name in quantized_linear_names(model)} if quantized else set()
    lora, adapted = (), ()
    if lora_r > 0:  # peft on the meta copy: the adapters the run adds (fused experts' too), nothing allocated
        targets = ALL_LINEAR if lora_targets == (ALL_LINEAR,) else list(lora_targets)
        lora, adapted = lora_numels(model, lora_r, targets)
    return ParameterCounts(total=sum(tensors), tensors=tensors, lora=lora, lora_modules=adapted, split=split,
                           quantized=tuple(name in four_bit for name, _ in named) if quantized else ())


def count_parameters(config, lora_r: int = 0, lora_targets: tuple[str, ...] = (), *,
                     quantized: bool = False) -> ParameterCounts:
    """Parameters of ``config``'s causal LM and of the LoRA adapters peft would add on ``lora_targets`` (module
    names, or ``("all-linear",)``: oomb.surgery.adapters); ``quantized``: also which weights a 4-bit base holds in
    NF4 (ParameterCounts.quantized)."""
    return _count_parameters(config.to_json_string(use_diff=False), config.model_type, lora_r, tuple(lora_targets),
                             quantized)


def optimizer_state_bytes(kind: str, numels: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of the optimizer's states for trainable tensors of these sizes (see oomb/train/loop/optim.py).

    ``dtype``: of the tensors the optimizer steps (float32 for fp32 master weights).
    adamw: torch AdamW keeps exp_avg and exp_avg_sq in that dtype. adamw8bit and
    paged_adamw8bit: bitsandbytes 8-bit blockwise states (1 byte each + a float32 absmax per
    256 values) for tensors of 4096 values or more, two float32 states below that, and two
    256-entry float32 quantization maps.
    """
    if kind == "adamw":
        return 2 * itemsize(dtype) * sum(numels)
    if kind in ("adamw8bit", "paged_adamw8bit"):
        total = 0
        for n in numels:
            total += 2 * n + 2 * 4 * -(-n // _BNB_BLOCK) if n >= _BNB_MIN_8BIT_SIZE else 8 * n
        if any(n >= _BNB_MIN_8BIT_SIZE for n in numels):
            total += 2 * 256 * 4  # the two 256-entry float32 quantization maps, shared by all tensors
        return total
    raise ValueError(f"unknown optimizer {kind!r}: choose one of {', '.join(OPTIMIZER_KINDS)}")

