"""The chunk-recurrent training step (shared/DESIGN.md, "One training step").

    stage 1 (no autograd)   c_0 -> c_1 -> ... -> c_{m-2}     fill the paged store
    stage 2 (autograd)      c_{m-1} -> ... -> c_1 -> c_0     recompute, loss, backward, free

Stage 1 skips the last chunk: nothing after it reads its K/V, and stage 2 starts by
recomputing it. Only one chunk's activations are alive at any time; what grows with
the sequence is the store (K, V and their gradient pages).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from oomb.attention import STEP_KWARG, StepContext, check_attention_support, oomb_attention
from oomb.cache import KVStore, PagedKVStore
from oomb.engine.loss import IGNORE_INDEX, linear_cross_entropy_sum
from oomb.engine.plan import store_spec
from oomb.engine.tensor_parallel import tensor_parallel_group
from oomb.kernels import get_backend
from oomb.offload import OffloadedKVStore
from oomb.sparse import PageSelection, store_key_summary

# One store per model, reused across steps so the pools are allocated once.
_STORES: weakref.WeakKeyDictionary[torch.nn.Module, KVStore] = weakref.WeakKeyDictionary()


def chunked_backward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    chunk_size: int = 4096,
    page_size: int = 128,
    backend: str = "auto",
    grad_dtype: torch.dtype | None = None,
    loss_impl: str = "auto",
    doc_ids: torch.Tensor | None = None,
    page_budget: int | None = None,
    selection: PageSelection | None = None,
    offload: bool = False,
    offload_gpu_bytes: int = 0,
    cache_attention: bool = False,
    loss_divisor: float | None = None,
    before_last_backward: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Exact loss and parameter gradients of a long sequence, one chunk of activations at a time.

    Args:
        model: a transformers causal LM whose attention goes through AttentionInterface.
        input_ids: [B, N] token ids, N >= 2.
        labels: [B, N] targets aligned with ``input_ids`` as in transformers (shifted inside);
            -100 marks positions without a target. None = next-token prediction on ``input_ids``.
        chunk_size: tokens per chunk (a multiple of ``page_size``).
        page_size: tokens per page of the K/V store.
        backend: attention kernels: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".
        grad_dtype: dtype of the gradient pages (default: the model's dtype).
        loss_impl: fused linear cross-entropy: "auto", "liger" or "torch".
        doc_ids: [B, N] document id of each token, non-decreasing along N (packed documents):
            tokens of different documents never attend to each other. Positions stay those of
            the packed sequence (RoPE is relative, so a document sees the same attention as alone).
            Labels are not changed: mark the first token of each document -100 in ``labels`` if
            the previous document's last token should not predict it.
        page_budget: page-sparse attention: each block of queries attends this many pages of the
            chunk's past (plus the chunk itself); None = dense (exact). See oomb.sparse.
        selection: how pages are chosen (block size, sink/local pages, per-head lists);
            ``page_budget`` overrides its budget when both are given.
        offload: keep K, V and their gradient pages in (pinned) host memory, with only the layer
            being computed and the next one on the device (oomb.offload). Same gradients.
        offload_gpu_bytes: with ``offload``, GPU memory the store may use to keep whole layers'
            pages on the device (the first layers that fit; no copies for them). 0 = none.
        cache_attention: keep every chunk's attention outputs (and log-sum-exps) from stage 1 for
            stage 2, which then skips attending again: one attention forward less per chunk and
            layer (the same result), for H * (D * itemsize + 4) bytes per token per layer of device
            memory until the chunk's backward (Qwen2.5-7B in bf16: 200 KiB per token, 1.8x the
            paged store). Not with ``offload``.
        loss_divisor: what the summed token loss is divided by (default: the number of target
            tokens of ``input_ids``). Data parallel training passes the target count of every
            rank's batches, so that the gradients of all ranks add up to the global mean's.
        before_last_backward: called once, just before the backward of the step's last chunk
            (c_0, stage 2's final backward): data parallel training turns gradient
            reduction on there, so gradients cross the network once per step, not per chunk.

    Accumulates d(loss)/d(param) into ``.grad`` like ``loss.backward()`` and returns the
    mean loss over target tokens as a detached scalar. A peft model (LoRA) is accepted:
    its adapters live inside the wrapped transformers model, which is what runs here.
    A model split by ``oomb.engine.tensor_parallel`` runs on every rank of its group with the
    same inputs; each rank's store holds its own KV heads only.
    """
    model = _unwrap_peft(model)
    targets = _validate(model, input_ids, labels, chunk_size, page_size)
    doc_start = document_starts(doc_ids, input_ids) if doc_ids is not None else None
    selection = selection_policy(page_budget, selection)
    batch, seq_len = input_ids.shape
    bounds = [(s, min(s + chunk_size, seq_len)) for s in range(0, seq_len, chunk_size)]
    counts = chunk_target_counts(targets, chunk_size)  # host sync, once per step
    n_targets = sum(counts)
    if n_targets == 0:
        raise ValueError("no position has a target: every label is -100 (or the sequence has one token)")
    if loss_divisor is not None and not loss_divisor > 0:
        raise ValueError(f"loss_divisor must be positive, got {loss_divisor}")
    divisor = n_targets if loss_divisor is None else loss_divisor
    if offload_gpu_bytes and not offload:
        raise ValueError("offload_gpu_bytes sets how much of an offloaded store stays on the GPU: "
                         "it needs offload=True")
    if cache_attention and offload:
        raise ValueError("cache_attention=True keeps attention outputs on the device, against offload=True's "
                         "purpose: choose one")

    store = _store_for(model, input_ids.device, page_size, grad_dtype, offload, offload_gpu_bytes, selection)
    store.reserve(batch, seq_len)
    step = StepContext(store=store, backend=get_backend(backend, input_ids.device.type), doc_start=doc_start,
                       selection=selection, cache_attention=cache_attention, tp_group=tensor_parallel_group(model))
    head = model.get_output_embeddings()

    def run_decoder(start: int, end: int) -> torch.Tensor:
        return run_chunk(model, step, input_ids, start, end)

    total = torch.zeros((), dtype=torch.float32, device=input_ids.device)
    try:
        with oomb_attention(model):
            # Stage 1: fill the store with the K/V of every chunk but the last.
            step.stage = "fill"
            with torch.no_grad():
                for start, end in bounds[:-1]:
                    store.append_chunk(end - start)
                    run_decoder(start, end)

            # Stage 2: newest chunk first; recompute with autograd, loss, backward, free.
            step.stage = "recompute"
            store.append_chunk(bounds[-1][1] - bounds[-1][0])
            for (start, end), count in zip(reversed(bounds), reversed(counts), strict=True):
                hidden = run_decoder(start, end)
                hidden = hidden.reshape(-1, hidden.shape[-1])
                chunk_targets = targets[:, start:end].reshape(-1)
                rows = target_rows(chunk_targets, count)
                if rows is not None:  # the LM head only where there is a target (answer-only losses)
                    hidden, chunk_targets = hidden.index_select(0, rows), chunk_targets.index_select(0, rows)
                loss = linear_cross_entropy_sum(
                    hidden, head.weight, head.bias, chunk_targets, impl=loss_impl
                ) / divisor
                if start == 0 and before_last_backward is not None:
                    before_last_backward()
                loss.backward()
                total += loss.detach()
                step.drop_page_lists(start)
                store.free_last_chunk()
    finally:
        store.clear()  # pool usage returns to zero, also after an error mid-step
    return total


def run_chunk(model: PreTrainedModel, step: StepContext, input_ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The decoder's hidden states [B, end - start, hidden] of tokens [start, end), attention through oomb.

    The store must already hold the chunk's pages (append_chunk). Raises if a layer's attention
    bypassed oomb (a model computing attention outside transformers' AttentionInterface).
    """
    step.layers_seen.clear()
    positions = torch.arange(start, end, device=input_ids.device).expand(input_ids.shape[0], -1)
    hidden = model.get_decoder()(
        input_ids=input_ids[:, start:end], position_ids=positions, use_cache=False, **{STEP_KWARG: step}
    ).last_hidden_state
    expected = set(range(model.config.num_hidden_layers))
    if step.layers_seen != expected:
        missing = sorted(expected - step.layers_seen)
        raise RuntimeError(
            f"attention layers {missing[:8]} did not go through oomb's attention: this model computes "
            "attention outside transformers' AttentionInterface and cannot be run by oomb"
        )
    return hidden


def chunk_target_counts(targets: torch.Tensor, chunk_size: int) -> list[int]:
    """Targets (labels other than -100) in each chunk of ``targets`` [B, N], read with one host sync."""
    valid = (targets != IGNORE_INDEX).sum(dim=0)  # [N]
    pad = -valid.shape[0] % chunk_size
    return torch.nn.functional.pad(valid, (0, pad)).view(-1, chunk_size).sum(dim=1).tolist()


def target_rows(chunk_targets: torch.Tensor, count: int) -> torch.Tensor | None:
    """Indices of the rows of a chunk's flat targets that have a target, in order; None where most do.

    ``count`` is their number (chunk_target_counts), so no host sync is needed. Where fewer than half
    the rows have a target (a loss on answers only, prompts masked), the LM head and its cross-entropy
    run on those rows alone: the head is a [vocab, hidden] matmul per row (Qwen2.5-0.5B: 136M of its
    494M parameters). A chunk without targets keeps one (ignored) row, so its backward still runs and carries
    the gradients of its K/V pages into the chunk.
    """
    if 2 * count >= chunk_targets.shape[0]:
        return None
    return torch.nonzero_static(chunk_targets != IGNORE_INDEX, size=max(count, 1), fill_value=0).squeeze(1)


def selection_policy(page_budget: int | None, selection: PageSelection | None) -> PageSelection | None:
    """The page-selection policy of a step: ``page_budget`` overrides the budget of ``selection``."""
    if page_budget is not None:
        return dataclasses.replace(selection or PageSelection(), page_budget=page_budget)
    return selection


def document_starts(doc_ids: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, N] int32 position of the first token of each token's document, from document ids."""
    if not isinstance(doc_ids, torch.Tensor) or tuple(doc_ids.shape) != tuple(input_ids.shape):
        raise ValueError(f"doc_ids must have the shape of input_ids {tuple(input_ids.shape)}, got {_describe(doc_ids)}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    doc_ids = doc_ids.to(input_ids.device)
    if bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
        raise ValueError("doc_ids must be non-decreasing along each sequence (documents packed one after another)")
    batch, seq_len = doc_ids.shape
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    positions = torch.arange(seq_len, device=doc_ids.device).expand(batch, -1)
    return torch.where(is_start, positions, 0).cummax(dim=1).values.to(torch.int32)


def _unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """A peft PeftModel -> the transformers model it wraps (with the adapter layers injected)."""
    if not isinstance(model, PreTrainedModel) and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def release_memory(model: torch.nn.Module) -> None:
    """Free the paged store's memory kept for ``model`` (its pools are otherwise reused by the next step)."""
    store = _STORES.pop(_unwrap_peft(model), None)
    if store is not None:
        store.release()  # frees the pools even if something else still references the store


def store_for_model(model: torch.nn.Module) -> KVStore | None:
    """The store oomb keeps for ``model`` between steps, if any (for memory accounting)."""
    return _STORES.get(_unwrap_peft(model))


def _store_for(
    model: PreTrainedModel, device: torch.device, page_size: int, grad_dtype: torch.dtype | None,
    offload: bool = False,
    offload_gpu_bytes: int = 0,
    selection: PageSelection | None = None,
) -> KVStore:
    group = tensor_parallel_group(model)
    split = 1 if group is None else torch.distributed.get_world_size(group)  # each rank stores its KV heads
    # The planner's spec, so what is planned is what is allocated.
    spec = store_spec(model.config, page_size=page_size, dtype=model.get_input_embeddings().weight.dtype,
                      grad_dtype=grad_dtype, device=device, tensor_parallel=split,
                      key_summary=store_key_summary(selection.score if selection is not None else None))
    kind = OffloadedKVStore if offload else PagedKVStore
    store = _STORES.get(model)
    if store is None or store.spec != spec or type(store) is not kind:
        release_memory(model)  # free the old pools before allocating new ones
        store = kind(spec)
        _STORES[model] = store
    if offload:
        if offload_gpu_bytes < 0:
            raise ValueError(f"offload_gpu_bytes must be >= 0, got {offload_gpu_bytes}")
        store.gpu_bytes = offload_gpu_bytes  # applied by the next reserve()
    return store


def _validate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    chunk_size: int,
    page_size: int,
) -> torch.Tensor:
    """Check everything before any work starts; return the shifted targets [B, N]."""
    check_attention_support(model)
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
    if page_size <= 0 or chunk_size <= 0:
        raise ValueError(f"chunk_size and page_size must be positive, got {chunk_size} and {page_size}")
    if chunk_size % page_size:
        raise ValueError(
            f"chunk_size={chunk_size} is not a multiple of page_size={page_size}: chunks must start on a page; "
            f"try chunk_size={max(page_size, chunk_size // page_size * page_size)}"
        )
    vocab = model.get_input_embeddings().weight.shape[0]
    lo, hi = int(input_ids.min()), int(input_ids.max())  # host sync, once per step
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}) (the model's vocabulary), found ids in [{lo}, {hi}]")
    param = next(model.parameters())
    if input_ids.device != param.device:
        raise ValueError(f"input_ids are on {input_ids.device} but the model is on {param.device}")
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None):
        raise ValueError("final logit soft-capping is not supported by oomb's fused cross-entropy")
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
    labels = labels.to(input_ids.device, torch.int64)
    # Position t predicts labels[t + 1]; the last position predicts nothing.
    pad = torch.full((batch, 1), IGNORE_INDEX, dtype=torch.int64, device=labels.device)
    targets = torch.cat([labels[:, 1:], pad], dim=1)
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= head_vocab(model)))
    if bool(bad.any()):
        raise ValueError(f"labels must be -100 or lie in [0, {head_vocab(model)}) (the LM head's vocabulary)")
    return targets


def head_vocab(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
