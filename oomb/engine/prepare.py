"""What every chunk-recurrent pass over a sequence sets up first, in one place.

    StepOptions (how the pass runs: oomb/engine/options.py) + model, input_ids, labels, doc_ids
        -> prepare_step -> PreparedStep: the transformers model (peft unwrapped), the shifted
           targets and their count per chunk, the chunk bounds, the model's store reserved for
           the batch, and the StepContext every attention layer receives

``chunked_backward`` (step.py), ``chunked_eval`` (evaluate.py) and ``locate_nonfinite``
(diagnose.py) all start here. Given the same options, they share one store per model (kept
between calls, so evaluating or diagnosing after a step reallocates nothing) and attend the
same pages: the NaN locator after an offloaded sparse step stays offloaded and sparse.

Everything is checked before the store is touched: a refused call leaves ``.grad``, the
store and the model as they were, with a message that says what to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from oomb.attention import StepContext, oomb_attention
from oomb.cache import KVStore, PagedKVStore, StoreSpec
from oomb.engine import host_stash
from oomb.engine.host_stash import HostAttentionCache
from oomb.engine.loss import IGNORE_INDEX
from oomb.engine.options import StepOptions
from oomb.engine.rope import length_held
from oomb.engine.support import ModelSupport, model_support
from oomb.kernels import get_backend
from oomb.offload import OffloadedKVStore
from oomb.sparse import store_key_summary
from oomb.surgery.tensor_parallel import tensor_parallel_group

# One store per model, reused across steps so the pools are allocated once.
_STORES: weakref.WeakKeyDictionary[torch.nn.Module, KVStore] = weakref.WeakKeyDictionary()


@dataclass
class PreparedStep:
    """What a pass over the chunks of one batch needs, ready to run."""

    model: PreTrainedModel  # the transformers model (a peft model's base, adapters injected)
    targets: torch.Tensor  # [B, N] int64: position t's target, labels[t + 1]; -100 = none
    target_counts: list[int]  # targets per chunk
    bounds: list[tuple[int, int]]  # [start, end) of each chunk, in order
    store: KVStore  # the model's store, empty, reserved for [B, N]
    context: StepContext  # found by every attention call; stage "fill"
    support: ModelSupport  # the model's attention sites and its logit transform (oomb.engine.support)

    @contextlib.contextmanager
    def running(self):
        """The model's attention routed through oomb in this pass's context, and its length-dependent rotary
        frequencies held at the whole sequence's (oomb.engine.rope), for the duration of the block."""
        with oomb_attention(self.model, self.context), length_held(self.model, self.bounds[-1][1]):
            yield


def prepare_step(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    doc_ids: torch.Tensor | None,
    options: StepOptions,
    *,
    forward_only: bool = False,
    attention_mask: torch.Tensor | None = None,
) -> PreparedStep:
    """Check the inputs, then reserve the model's store and build the step's context.

    ``forward_only``: a pass of stage 1 alone (evaluation, the NaN locator): a batch without any
    target is allowed and attention outputs are not kept for a stage 2 that does not come.
    ``attention_mask``: [B, N] 1 for tokens, 0 for padding (``padding_mask``).
    """
    if not isinstance(options, StepOptions):
        raise TypeError(f"options must be an oomb.engine.StepOptions, got {type(options).__name__}")
    model = unwrap_peft(model)
    targets = validate_inputs(model, input_ids, labels)
    support = model_support(model)  # once per model: probes its forward on a few tokens
    padding = padding_mask(attention_mask, input_ids)
    doc_start = document_starts(doc_ids, input_ids, padding) if doc_ids is not None or padding is not None else None
    counts = chunk_target_counts(targets, options.chunk_size)  # host sync, once per step
    if not forward_only and sum(counts) == 0:
        raise ValueError("no position has a target: every label is -100 (or the sequence has one token)")
    device = input_ids.device
    backend = get_backend(options.backend, device.type)
    batch, seq_len = input_ids.shape
    store = _store_for(model, support, device, options, forward_only=forward_only)
    store.reserve(batch, seq_len, options.chunk_size)
    cache = bool(options.cache_attention) and not forward_only
    context = StepContext(store=store, backend=backend, stage="fill", by_layer=options.recompute != "chunk",
                          doc_start=doc_start,
                          selection=options.selection, cache_attention=cache, tp_group=tensor_parallel_group(model),
                          sites=support.site_map(model), site_layers=support.site_layers,
                          attended=None if padding is None else ~padding)
    bounds = [(s, min(s + options.chunk_size, seq_len)) for s in range(0, seq_len, options.chunk_size)]
    if cache and options.cache_attention == "host":
        layers = [(site.heads, site.page.value_dim) for site in support.sites]
        context.attention_outputs = HostAttentionCache.on_host(
            model, layers, bounds, batch, model.get_input_embeddings().weight.dtype, device,
            step=-1 if options.recompute != "chunk" else 1)
    return PreparedStep(model=model, targets=targets, target_counts=counts, bounds=bounds, store=store,
                        context=context, support=support)


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """A peft PeftModel -> the transformers model it wraps (with the adapter layers injected)."""
    if not isinstance(model, PreTrainedModel) and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def release_memory(model: torch.nn.Module) -> None:
    """Free the paged store's memory kept for ``model`` (its pools are otherwise reused by the next step), and
    the host buffers of recompute="layer-host" and cache_attention="host"."""
    host_stash.release(unwrap_peft(model))  # kept layer inputs / attention outputs in host memory
    store = _STORES.pop(unwrap_peft(model), None)
    if store is not None:
        store.release()  # frees the pools even if something else still references the store


def store_for_model(model: torch.nn.Module) -> KVStore | None:
    """The store oomb keeps for ``model`` between steps, if any (for memory accounting)."""
    return _STORES.get(unwrap_peft(model))


def _store_for(model: PreTrainedModel, support: ModelSupport, device: torch.device, options: StepOptions, *,
               forward_only: bool = False) -> KVStore:
    """The model's store for these options: the kept one where its spec and kind match, else a new one. A
    forward-only pass reuses a training step's store where one matches (a validation between steps reallocates
    nothing), else takes one without gradient pages (half the K/V bytes; not with offload)."""
    selection = options.selection
    dtype = model.get_input_embeddings().weight.dtype
    # One layer per attention call, shaped as the probe saw it (a tensor parallel rank: its own KV heads).
    spec = StoreSpec(layers=support.page_shapes, page_size=options.page_size, dtype=dtype,
                     grad_dtype=options.grad_dtype or dtype, device=torch.device(device),
                     key_summary=store_key_summary(selection.score if selection is not None else None),
                     windows=support.windows)
    kind = OffloadedKVStore if options.offload else PagedKVStore
    store = _STORES.get(model)
    if forward_only and not options.offload and (store is None or store.spec != spec or type(store) is not kind):
        spec = dataclasses.replace(spec, gradients=False)
    if store is None or store.spec != spec or type(store) is not kind:
        release_memory(model)  # free the old pools before allocating new ones
        store = kind(spec)
        _STORES[model] = store
    if options.offload:
        store.gpu_bytes = options.offload_gpu_bytes  # applied by the next reserve()
    return store


def validate_inputs(model: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Check the batch (and what of the model it needs) before any work starts; return the shifted targets [B, N]."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"oomb needs a transformers PreTrainedModel (e.g. AutoModelForCausalLM), got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, seq_len] tensor, got {_describe(input_ids)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    batch, seq_len = input_ids.shape
    if batch == 0 or seq_len < 2:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)}: need at least 1 sequence of at least 2 tokens "
            "(a 1-token sequence has nothing to predict)"
        )
    vocab = model.get_input_embeddings().weight.shape[0]
    lo, hi = int(input_ids.min()), int(input_ids.max())  # host sync, once per step
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}) (the model's vocabulary), found ids in [{lo}, {hi}]")
    param = next(model.parameters())
    if input_ids.device != param.device:
        raise ValueError(f"input_ids are on {input_ids.device} but the model is on {param.device}")
    cfg = model.config
    if getattr(cfg, "output_router_logits", False):
        raise ValueError(
            "output_router_logits=True adds a router auxiliary loss that oomb does not compute; "
            "set model.config.output_router_logits = False"
        )
    if model.training and getattr(cfg, "attention_dropout", 0.0):
        raise ValueError(
            f"attention_dropout={cfg.attention_dropout}: dropout makes the recomputed forward differ from "
            "the first one; set model.config.attention_dropout = 0"
        )
    if model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (LM head): use a *ForCausalLM model")

    if labels is None:
        labels = input_ids
    elif not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {_describe(labels)}"
        )
    elif labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        # A float or bool tensor would be cast to ids silently: 0.7 -> 0, True -> token 1.
        raise TypeError(f"labels must be an integer tensor of token ids (-100 where there is no target), "
                        f"got {labels.dtype}")
    labels = labels.to(input_ids.device, torch.int64)
    # Position t predicts labels[t + 1]; the last position predicts nothing.
    pad = torch.full((batch, 1), IGNORE_INDEX, dtype=torch.int64, device=labels.device)
    targets = torch.cat([labels[:, 1:], pad], dim=1)
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= head_vocab(model)))
    if bool(bad.any()):
        raise ValueError(f"labels must be -100 or lie in [0, {head_vocab(model)}) (the LM head's vocabulary)")
    return targets


def padding_mask(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, N] bool, True on padding, from transformers' ``attention_mask`` (1 = token, 0 = padding); None where
    there is no padding. Padding is a document of its own that nothing else attends, and its queries attend
    nothing: their attention output is zero, as transformers' SDPA attention gives a query whose every key is
    masked. (Its eager attention spreads such a query over every key of the row instead.)"""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
                         f"{_describe(attention_mask)}")
    mask = attention_mask.to(input_ids.device)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold 1 for tokens and 0 for padding")
    mask = mask.bool()
    switches = mask[:, 1:] != mask[:, :-1]
    runs_of_ones = (switches & mask[:, 1:]).sum(dim=1) + mask[:, 0].long()  # 0 -> 1 switches, and a first 1
    if bool((runs_of_ones > 1).any()):  # host sync, once per step
        raise ValueError("attention_mask has a row whose ones are not one run (padding inside the sequence): oomb "
                         "takes left or right padding only; pack samples with doc_ids instead")
    return None if bool(mask.all()) else ~mask


def document_starts(doc_ids: torch.Tensor | None, input_ids: torch.Tensor,
                    padding: torch.Tensor | None = None) -> torch.Tensor:
    """[B, N] int32 position of the first token of each token's document, from document ids and padding (a run of
    padding is a document)."""
    batch, seq_len = input_ids.shape
    is_start = torch.zeros_like(input_ids, dtype=torch.bool)
    is_start[:, 0] = True
    if doc_ids is not None:
        if not isinstance(doc_ids, torch.Tensor) or tuple(doc_ids.shape) != tuple(input_ids.shape):
            raise ValueError(f"doc_ids must have the shape of input_ids {tuple(input_ids.shape)}, got "
                             f"{_describe(doc_ids)}")
        if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
            raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
        doc_ids = doc_ids.to(input_ids.device)
        if bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
            raise ValueError("doc_ids must be non-decreasing along each sequence (documents packed one after another)")
        is_start[:, 1:] |= doc_ids[:, 1:] != doc_ids[:, :-1]
    if padding is not None:
        is_start[:, 1:] |= padding[:, 1:] != padding[:, :-1]
    positions = torch.arange(seq_len, device=input_ids.device).expand(batch, -1)
    return torch.where(is_start, positions, 0).cummax(dim=1).values.to(torch.int32)


def chunk_target_counts(targets: torch.Tensor, chunk_size: int) -> list[int]:
    """Targets (labels other than -100) in each chunk of ``targets`` [B, N], read with one host sync."""
    valid = (targets != IGNORE_INDEX).sum(dim=0)  # [N]
    pad = -valid.shape[0] % chunk_size
    return torch.nn.functional.pad(valid, (0, pad)).view(-1, chunk_size).sum(dim=1).tolist()


def head_vocab(model: PreTrainedModel) -> int:
    """Rows of the model's LM head: the ids a target may take."""
    return model.get_output_embeddings().weight.shape[0]


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
