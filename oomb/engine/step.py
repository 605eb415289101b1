"""The chunk-recurrent training step (docs/design.md, "The step").

    stage 1 (no autograd)   c_0 -> c_1 -> ... -> c_{m-2}     fill the paged store
    stage 2 (autograd)      c_{m-1} -> ... -> c_1 -> c_0     recompute, loss, backward, free

Stage 1 skips the last chunk: nothing after it reads its K/V, and stage 2 starts by
recomputing it. Only one chunk's activations are alive at any time; what grows with
the sequence is the store (K, V and their gradient pages).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Unpack

import torch
from transformers import PreTrainedModel

from oomb.attention import StepContext
from oomb.engine.host_stash import HostAttentionCache
from oomb.engine.layer_recompute import LayerInputs, check_layer_recompute, layer_recompute
from oomb.engine.loss import IGNORE_INDEX, linear_cross_entropy_sum
from oomb.engine.options import StepKeywords, StepOptions, options_from_keywords
from oomb.engine.prepare import prepare_step, unwrap_peft
from oomb.engine.support import ArchitectureCheck, config_support


def chunked_backward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    doc_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    loss_divisor: float | None = None,
    before_last_backward: Callable[[], None] | None = None,
    on_chunk: Callable[[str, int, int], None] | None = None,
    options: StepOptions | None = None,
    **step_keywords: Unpack[StepKeywords],
) -> torch.Tensor:
    """Exact loss and parameter gradients of a long sequence, one chunk of activations at a time.

    Args:
        model: a transformers causal LM whose attention goes through AttentionInterface.
        input_ids: [B, N] token ids, N >= 2.
        labels: [B, N] integer targets aligned with ``input_ids`` as in transformers (shifted inside);
            -100 marks positions without a target. None = next-token prediction on ``input_ids``.
        chunk_size: tokens per chunk (a multiple of ``page_size``).
        page_size: tokens per page of the K/V store.
        backend: attention kernels: "auto" (fa4 on Hopper/Blackwell with flash-attn-4, else Triton on CUDA,
            PyTorch elsewhere), "fa4", "triton" or "torch".
        grad_dtype: dtype of the gradient pages (default: the model's dtype); a floating-point dtype.
        loss_impl: fused linear cross-entropy: "auto", "liger" or "torch".
        doc_ids: [B, N] document id of each token, non-decreasing along N (packed documents):
            tokens of different documents never attend to each other. Positions stay those of
            the packed sequence (RoPE is relative, so a document sees the same attention as alone).
            Labels are not changed: mark the first token of each document -100 in ``labels`` if
            the previous document's last token should not predict it.
        attention_mask: [B, N] 1 for tokens, 0 for padding (left or right, as transformers' collators pad):
            padding is attended by nothing and attends nothing (its attention output is zero, as
            transformers' SDPA attention gives it). Labels on padding are the caller's (collators set -100).
        page_budget: page-sparse attention: each block of queries attends this many pages of the
            chunk's past (plus the chunk itself); None = dense (exact). See oomb.sparse.
        selection: how pages are chosen (block size, sink/local pages, per-head lists);
            ``page_budget`` overrides its budget when both are given.
        offload: keep K, V and their gradient pages in (pinned) host memory, with only the layer
            being computed and the next one on the device (oomb.offload). Same gradients.
        offload_gpu_bytes: with ``offload``, GPU memory the store may use to keep whole layers'
            pages on the device (the first layers that fit; no copies for them). 0 = none.
        cache_attention: True or "host": keep every chunk's attention outputs (and log-sum-exps) from stage 1 for
            stage 2, which then skips attending again: one attention forward less per chunk and
            layer (the same result), for H * (D * itemsize + 4) bytes per token per layer of device
            memory until the chunk's backward (Qwen2.5-7B in bf16: 200 KiB per token, 1.8x the
            paged store); "host": in pinned host memory instead, copied out in stage 1 and back one
            layer ahead of stage 2 (oomb.engine.host_stash). With ``offload`` only "host".
        recompute: how stage 2 rebuilds a chunk's activations for its backward: "chunk" (all layers
            with autograd at once: the chunk's activations of every layer alive together), "layer"
            (stage 1 keeps every layer's input, (L + 1) x hidden values per token of the sequence on
            the device, and stage 2 rebuilds one layer at a time: one layer's activations alive) or
            "layer-host" (the same with the kept inputs in pinned host memory). The same gradients;
            "layer" runs one more forward of the last chunk (oomb.engine.layer_recompute). With ``offload``
            each layer's pages are brought once per chunk for its forward and backward together.
        loss_divisor: what the summed token loss is divided by (default: the number of target
            tokens of ``input_ids``). Data parallel training passes the target count of every
            rank's batches, so that the gradients of all ranks add up to the global mean's.
        before_last_backward: called once, just before the backward of the step's last chunk
            (c_0, stage 2's final backward): data parallel training turns gradient
            reduction on there, so gradients cross the network once per step, not per chunk.
        on_chunk: called as each chunk starts with (stage, i, n): "fill" (stage 1) or "backward" (stage 2), the
            chunk's place in its stage (1 = the stage's first; stage 2 runs the newest chunk first) and the
            stage's number of chunks: the progress of a step of minutes (`oomb train`'s progress line).
        options: the settings from ``chunk_size`` to ``cache_attention`` as one
            ``oomb.engine.StepOptions`` (then leave those keywords at their defaults). The same
            object given to ``locate_nonfinite`` and ``chunked_eval`` runs them like this step.

    Accumulates d(loss)/d(param) into ``.grad`` like ``loss.backward()`` and returns the
    mean loss over target tokens as a detached scalar. A peft model (LoRA) is accepted:
    its adapters live inside the wrapped transformers model, which is what runs here.
    A model split by ``oomb.surgery.tensor_parallel`` runs on every rank of its group with the
    same inputs; each rank's store holds its own KV heads only.
    """
    options = options_from_keywords(options, step_keywords, caller="chunked_backward")
    if loss_divisor is not None and not loss_divisor > 0:
        raise ValueError(f"loss_divisor must be positive, got {loss_divisor}")
    check_model_architecture(model)
    prepared = prepare_step(model, input_ids, labels, doc_ids, options, attention_mask=attention_mask)
    model, targets, store, step = prepared.model, prepared.targets, prepared.store, prepared.context
    bounds, counts = prepared.bounds, prepared.target_counts
    divisor = sum(counts) if loss_divisor is None else loss_divisor
    head, transform = model.get_output_embeddings(), prepared.support.transform

    def run_decoder(start: int, end: int) -> torch.Tensor:
        return run_chunk(model, step, input_ids, start, end)

    by_layer = options.recompute != "chunk"
    if by_layer:
        check_layer_recompute(model)
        if options.recompute == "layer-host":
            embeddings = model.get_input_embeddings().weight
            inputs = LayerInputs.on_host(model, model.config.num_hidden_layers, bounds, input_ids.shape[0],
                                         embeddings.shape[1], embeddings.dtype, input_ids.device)
        else:
            inputs = LayerInputs()
        layers = layer_recompute(model, inputs, step.layers_seen)
    else:
        layers = contextlib.nullcontext()

    total = torch.zeros((), dtype=torch.float32, device=input_ids.device)
    try:
        with prepared.running(), layers as replay:
            # Stage 1: fill the store with the K/V of every chunk but the last (recompute="layer": of every
            # chunk, keeping each layer's input).
            step.stage = "fill"
            with torch.no_grad():
                filled = bounds if by_layer else bounds[:-1]
                for i, (start, end) in enumerate(filled, 1):
                    if on_chunk is not None:
                        on_chunk("fill", i, len(filled))
                    store.append_chunk(end - start)
                    if by_layer:
                        replay.begin_chunk("fill", start, end)
                    run_decoder(start, end)

            # Stage 2: newest chunk first; recompute with autograd, loss, backward, free.
            step.stage = "recompute"
            if not by_layer:
                store.append_chunk(bounds[-1][1] - bounds[-1][0])
            first_layer = model.config.num_hidden_layers - 1 if by_layer else 0  # the first whose attention is read
            for i, ((start, end), count) in enumerate(zip(reversed(bounds), reversed(counts), strict=True), 1):
                if on_chunk is not None:
                    on_chunk("backward", i, len(bounds))
                if by_layer:
                    replay.begin_chunk("recompute", start, end)
                if isinstance(step.attention_outputs, HostAttentionCache):
                    step.attention_outputs.prefetch((first_layer, start))
                hidden = run_decoder(start, end)
                hidden = hidden.reshape(-1, hidden.shape[-1])
                chunk_targets = targets[:, start:end].reshape(-1)
                rows = target_rows(chunk_targets, count)
                if rows is not None:  # the LM head only where there is a target (answer-only losses)
                    hidden, chunk_targets = hidden.index_select(0, rows), chunk_targets.index_select(0, rows)
                loss = linear_cross_entropy_sum(
                    hidden, head.weight, head.bias, chunk_targets, impl=options.loss_impl, transform=transform
                ) / divisor
                if start == 0 and before_last_backward is not None:
                    before_last_backward()
                loss.backward()
                total += loss.detach()
                if by_layer:
                    inputs.release(start)
                step.drop_page_lists(start)
                store.free_last_chunk()
    finally:
        store.clear()  # pool usage returns to zero, also after an error mid-step
    return total


def check_model_architecture(model: torch.nn.Module) -> None:
    """``check_architecture`` of a model's config (a peft model's base), in its training mode."""
    model = unwrap_peft(model)
    if isinstance(model, PreTrainedModel):  # anything else is refused by prepare_step, saying so
        remote = not type(model).__module__.startswith("transformers.")  # a model class from its folder's code
        check_architecture(model.config, training=model.training, trust_remote_code=remote)


def check_architecture(config, *, training: bool = True, trust_remote_code: bool = False) -> ArchitectureCheck:
    """Raise UnsupportedModel (a ValueError naming why) where oomb cannot train the architecture ``config``
    describes: ``oomb.engine.support.config_support`` with this step's self-test on the architecture's tiny copy.
    Once per config; the entry points call it before any work."""
    return config_support(config, _self_test, training=training, trust_remote_code=trust_remote_code)


SELF_TEST_TOKENS = 96  # the tiny copy's windows are 24 tokens: chunks of 32 cross them
SELF_TEST_TOL = 1e-3  # relative error of the tiny copy's chunked step against its full-sequence step (float32)


def _self_test(model: PreTrainedModel) -> str | None:
    """Train the tiny copy one step both ways (transformers' full sequence, oomb in chunks of 32 tokens) and say
    what differs (None: the same within SELF_TEST_TOL, far above float32 rounding and far below a real
    difference, which is of order 1)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(min(3, vocab - 1), vocab, (1, SELF_TEST_TOKENS), generator=generator)
    model.zero_grad(set_to_none=True)
    try:
        ref_loss = model(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_loss = ref_loss.detach()
    except RuntimeError:  # the copy does not train as transformers runs it: nothing to compare (not checked)
        model.zero_grad(set_to_none=True)
        return None
    ref = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = chunked_backward(model, ids, chunk_size=32, page_size=16, backend="torch", loss_impl="torch")
    floor = 1e-3 * max(float(g.norm()) for g in ref.values())
    worst, name = 0.0, ""
    for n, p in model.named_parameters():
        if n in ref:
            err = float((p.grad - ref[n]).norm()) / max(float(ref[n].norm()), floor) if p.grad is not None else 1.0
            worst, name = max((worst, name), (err, n))
    loss_err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    if loss_err <= SELF_TEST_TOL and worst <= SELF_TEST_TOL:
        return None
    return f"loss off by {loss_err:.1e}, the gradient of {name} by {worst:.1e}"


def run_chunk(model: PreTrainedModel, step: StepContext, input_ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The decoder's hidden states [B, end - start, hidden] of tokens [start, end), attention through oomb.

    The store must already hold the chunk's pages (append_chunk). Raises if a layer's attention
    bypassed oomb (a model computing attention outside transformers' AttentionInterface).
    """
    step.layers_seen.clear()
    positions = torch.arange(start, end, device=input_ids.device).expand(input_ids.shape[0], -1)
    hidden = model.get_decoder()(
        input_ids=input_ids[:, start:end], position_ids=positions, use_cache=False).last_hidden_state
    expected = set(step.site_layers)
    if step.layers_seen != expected:
        missing = sorted(expected - step.layers_seen)
        raise RuntimeError(
            f"attention layers {missing[:8]} did not go through oomb's attention: this model computes "
            "attention outside transformers' AttentionInterface and cannot be run by oomb"
        )
    return hidden


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
