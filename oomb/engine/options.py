"""How a training step runs and what it trains, each described once.

    StepOptions   how a chunk-recurrent pass runs (chunks, pages, kernels, page selection, offload, the
                  attention cache, recompute): what ``chunked_backward``, ``chunked_eval`` and the NaN locator
                  run, and what the memory planner plans
    RunShape      what the step trains and holds besides: the batch and its length, the precision, the
                  trainable parameters (LoRA, a 4-bit base) and their optimizer, the tensor parallel degree,
                  and how the model was prepared (layer checkpointing, fused ops)
    MemoryLimits  the GPU and host memory a plan is checked against

``oomb train`` builds the first two from its config (oomb.train.config.step.step_options, oomb.train.loop.memory's
run shape) and hands the same StepOptions to the planner, its steps, its evaluation and the NaN locator;
``chunked_backward``'s and ``chunked_eval``'s keyword arguments (StepKeywords) build a StepOptions.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Collection
from dataclasses import dataclass
from typing import TypedDict

import torch

from oomb.engine.layer_recompute import RECOMPUTE_MODES
from oomb.engine.loss import LOSS_IMPLS
from oomb.engine.sizes import OPTIMIZER_KINDS
from oomb.kernels import BACKEND_NAMES
from oomb.sparse import PageSelection
from oomb.surgery.quantize import QUANTIZE_KINDS


def require_int(name: str, value, *, minimum: int) -> None:
    """Raise unless ``value`` is an integer (not a bool: True would run as 1) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be positive, got {value}" if minimum == 1 else
                         f"{name} must be >= {minimum}, got {value}")


def _require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class StepOptions:
    """How a chunk-recurrent pass runs: ``chunked_backward``'s settings in one object, checked when made.

    The same object given to ``chunked_backward``, ``chunked_eval`` and ``locate_nonfinite`` makes
    them run the same store and the same attention (``cache_attention``, ``recompute`` and ``loss_impl`` apply to
    training steps only).
    """

    chunk_size: int = 4096  # tokens per chunk (a multiple of page_size)
    page_size: int = 128  # tokens per page of the K/V store
    backend: str = "auto"  # attention kernels: "auto" (fa4 on Hopper/Blackwell with flash-attn-4, else Triton on CUDA,
    # PyTorch elsewhere), "fa4", "triton", "torch"
    grad_dtype: torch.dtype | None = None  # dtype of the gradient pages (None: the model's dtype)
    loss_impl: str = "auto"  # fused linear cross-entropy: "auto", "liger" or "torch"
    selection: PageSelection | None = None  # page-sparse attention (its page_budget included); None = dense
    offload: bool = False  # K, V and their gradient pages in host memory (oomb.offload)
    offload_gpu_bytes: int = 0  # with offload: device bytes for keeping the first layers' pages whole
    cache_attention: bool | str = False  # stage 2 reuses stage 1's attention outputs: True (device memory) or
    # "host" (pinned host memory, oomb.engine.host_stash); with offload only "host"
    recompute: str = "chunk"  # stage 2 rebuilds a chunk's activations: "chunk", "layer" or "layer-host"
    # (oomb.engine.layer_recompute)

    def __post_init__(self) -> None:
        require_int("chunk_size", self.chunk_size, minimum=1)
        require_int("page_size", self.page_size, minimum=1)
        if self.chunk_size % self.page_size:
            raise ValueError(
                f"chunk_size={self.chunk_size} is not a multiple of page_size={self.page_size}: chunks must start on "
                f"a page; try chunk_size={max(self.page_size, self.chunk_size // self.page_size * self.page_size)}"
            )
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend {self.backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
        if self.grad_dtype is not None and not (isinstance(self.grad_dtype, torch.dtype)
                                                and self.grad_dtype.is_floating_point):
            raise TypeError(f"grad_dtype must be a floating-point torch dtype (torch.bfloat16, torch.float16, "
                            f"torch.float32) or None for the model's dtype, got {self.grad_dtype!r}")
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"unknown cross-entropy implementation loss_impl={self.loss_impl!r}: use "
                             f"{', '.join(map(repr, LOSS_IMPLS))}")
        if self.selection is not None:
            if not isinstance(self.selection, PageSelection):
                raise TypeError(f"selection must be an oomb.sparse.PageSelection or None (dense), "
                                f"got {type(self.selection).__name__}")
            for name in ("page_budget", "block"):
                require_int(f"selection.{name}", getattr(self.selection, name), minimum=1)
            for name in ("sink_pages", "local_pages"):
                require_int(f"selection.{name}", getattr(self.selection, name), minimum=0)
            _require_bool("selection.per_head", self.selection.per_head)
            if self.selection.chunk_pages is not None:
                require_int("selection.chunk_pages", self.selection.chunk_pages, minimum=self.selection.page_budget)
        _require_bool("offload", self.offload)
        if not (isinstance(self.cache_attention, bool) or self.cache_attention == "host"):
            raise TypeError(f"cache_attention must be True, False or 'host', got {self.cache_attention!r}")
        require_int("offload_gpu_bytes", self.offload_gpu_bytes, minimum=0)
        if self.offload_gpu_bytes and not self.offload:
            raise ValueError("offload_gpu_bytes sets how much of an offloaded store stays on the GPU: "
                             "it needs offload=True")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={self.recompute!r}: use one of {', '.join(RECOMPUTE_MODES)}")
        if self.cache_attention is True and self.offload:
            raise ValueError("cache_attention=True keeps every chunk's attention outputs on the GPU for stage 2, "
                             "against offload=True's purpose (GPU memory for the pages): use cache_attention='host' "
                             "(in host memory) or False")


_DEFAULTS = StepOptions()


def selection_policy(page_budget: int | None, selection: PageSelection | None) -> PageSelection | None:
    """The page-selection policy of a step: ``page_budget`` overrides the budget of ``selection``."""
    if page_budget is not None:
        require_int("page_budget", page_budget, minimum=1)
        return dataclasses.replace(selection or PageSelection(), page_budget=page_budget)
    return selection


class StepKeywords(TypedDict, total=False):
    """The StepOptions fields as keyword arguments (``chunked_backward(model, ids, chunk_size=8192)``), and
    ``page_budget``: the budget of ``selection`` (a default PageSelection where none is given)."""

    chunk_size: int
    page_size: int
    backend: str
    grad_dtype: torch.dtype | None
    loss_impl: str
    page_budget: int | None
    selection: PageSelection | None
    offload: bool
    offload_gpu_bytes: int
    cache_attention: bool | str
    recompute: str


STEP_KEYWORDS = frozenset(StepKeywords.__annotations__)
# What a forward-only pass takes: the rest describe a backward (chunked_eval, locate_nonfinite's forward).
EVAL_KEYWORDS = frozenset({"chunk_size", "page_size", "backend", "page_budget", "selection", "offload",
                           "offload_gpu_bytes"})


def options_from_keywords(options: StepOptions | None, keywords: dict, *, caller: str,
                          allowed: Collection[str] = STEP_KEYWORDS) -> StepOptions:
    """``options`` where given, else the StepOptions the keywords describe (``page_budget`` folded into
    ``selection``). Both at once is refused unless every keyword is at its default: one source of truth.
    ``caller`` names the function in the message about a keyword it does not take."""
    unknown = sorted(set(keywords) - set(allowed))
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(unknown)}; its step settings are "
                        f"{', '.join(sorted(allowed))} (or options=StepOptions(...))")
    keywords = dict(keywords)
    page_budget = keywords.pop("page_budget", None)
    if options is None:
        selection = selection_policy(page_budget, keywords.pop("selection", None))
        return StepOptions(selection=selection, **keywords)
    if not isinstance(options, StepOptions):
        raise TypeError(f"options must be an oomb.engine.StepOptions, got {type(options).__name__}")
    given = [name for name, value in keywords.items() if value != getattr(_DEFAULTS, name)]
    if page_budget is not None:
        given.append("page_budget")
    if given:
        raise ValueError(f"options= was given together with {', '.join(given)}: set them in the StepOptions "
                         f"(dataclasses.replace(options, ...)) instead")
    return options


DEVICE_TYPES = ("cuda", "cpu")


@dataclass(frozen=True)
class RunShape:
    """What one training step trains and holds, besides how it runs (StepOptions); checked when made."""

    seq_len: int  # tokens per sequence
    batch_size: int = 1  # sequences per step
    dtype: torch.dtype = torch.bfloat16  # the model's parameters (the K/V pages too)
    device_type: str = "cuda"  # "cuda": the step on the GPU, the process on the host; "cpu": all in host memory
    lora_r: int = 0  # LoRA rank (0: every parameter trains)
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # module names, or ("all-linear",)
    lora_fused: bool = False  # peft's LoRA layers run fused (oomb.surgery.lora, train lora.fused)
    quantize: str = "none"  # "nf4": a 4-bit base under LoRA adapters (QLoRA)
    optimizer: str = "adamw"  # "adamw", "adamw8bit" or "paged_adamw8bit" (bitsandbytes)
    master_weights: bool = False  # the optimizer steps fp32 copies of 16-bit trainable parameters
    tensor_parallel: int = 1  # ranks the heads are split over
    layer_checkpointing: bool = False  # transformers' own, inside each chunk
    fused_ops: bool = False  # liger's RMSNorm, gated MLP and RoPE (oomb.surgery.fused_ops)

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "tensor_parallel"):
            require_int(name, getattr(self, name), minimum=1)
        require_int("lora_r", self.lora_r, minimum=0)
        for name, kinds in (("device_type", DEVICE_TYPES), ("optimizer", OPTIMIZER_KINDS),
                            ("quantize", QUANTIZE_KINDS)):
            if getattr(self, name) not in kinds:
                raise ValueError(f"{name} must be one of {', '.join(kinds)}, got {getattr(self, name)!r}")
        if self.quantize != "none" and (self.lora_r == 0 or self.tensor_parallel > 1):
            raise ValueError("a 4-bit base (quantize='nf4') trains LoRA adapters (lora_r > 0) in one process "
                             "(tensor_parallel=1)")


@dataclass(frozen=True)
class MemoryLimits:
    """The memory a plan must fit in (None: not checked)."""

    gpu_bytes: int | None = None
    host_bytes: int | None = None


def with_changes(options: StepOptions, shape: RunShape, change: dict) -> tuple[StepOptions, RunShape]:
    """``options`` and ``shape`` with the fields ``change`` names replaced (each name is a field of one of them):
    an alternative setting of a run, as the planner tries them."""
    fields = {f.name for f in dataclasses.fields(StepOptions)}
    unknown = sorted(set(change) - fields - {f.name for f in dataclasses.fields(RunShape)})
    if unknown:
        raise ValueError(f"no StepOptions or RunShape field is named {', '.join(unknown)}")
    return (dataclasses.replace(options, **{k: v for k, v in change.items() if k in fields}),
            dataclasses.replace(shape, **{k: v for k, v in change.items() if k not in fields}))
