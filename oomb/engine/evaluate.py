"""Forward-only evaluation of a long sequence, one chunk at a time.

    fill (no autograd)   c_0 -> c_1 -> ... -> c_{m-1}    append K/V, attend, LM head on the chunk

This is stage 1 of the training step (engine/step.py) run over EVERY chunk, with the
LM head applied to each chunk's hidden states as it goes. What grows with the sequence
is the paged store; the per-token results are two [B, N] tensors.

The head never builds [N, vocab] logits, nor [C, vocab] fp32 logits for a chunk: it
walks the chunk's rows in blocks of ``_ROW_BLOCK`` and the vocabulary in blocks of
``_VOCAB_BLOCK``, merging log-sum-exp, the target's logit and the argmax online. The
largest temporaries are one [rows, vocab block] fp32 logit tile and the same block of
the head's weight in fp32: 2048 * 8192 * 4 B = 64 MiB and 8192 * hidden * 4 B (29 MiB
at hidden 896, 112 MiB at hidden 3584).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Unpack

import torch
from transformers import PreTrainedModel

from oomb.engine.loss import IDENTITY, IGNORE_INDEX, LogitTransform
from oomb.engine.options import EVAL_KEYWORDS, StepKeywords, StepOptions, options_from_keywords
from oomb.engine.prepare import prepare_step, unwrap_peft
from oomb.engine.step import check_model_architecture, run_chunk

_ROW_BLOCK = 2048
_VOCAB_BLOCK = 8192


@dataclass
class EvalResult:
    """Per-position results, aligned like transformers' logits: position t predicts token t + 1.

    ``nll[b, t]`` is -log p(target | tokens 0..t) in fp32, NaN where position t has no
    target (label -100, and always the last position); ``correct[b, t]`` says whether the
    argmax of the logits equals the target (False where there is none); ``targets[b, t]``
    is the target id or -100; ``entropy[b, t]``, where asked for (``chunked_eval(entropy=True)``, else None), is
    the entropy of the predicted distribution in nats (what TRL's SFTTrainer logs as ``entropy``), NaN where there
    is no target.
    """

    nll: torch.Tensor  # [B, N] float32
    correct: torch.Tensor  # [B, N] bool
    targets: torch.Tensor  # [B, N] int64
    entropy: torch.Tensor | None = None  # [B, N] float32, where asked for

    @property
    def has_target(self) -> torch.Tensor:
        return self.targets != IGNORE_INDEX

    def mean_nll(self) -> float:
        """Mean NLL over every target of the batch (what transformers' loss would report)."""
        return float(self.nll[self.has_target].double().mean())


def chunked_eval(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    doc_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    options: StepOptions | None = None,
    entropy: bool = False,
    **step_keywords: Unpack[StepKeywords],
) -> EvalResult:
    """Per-token NLL, argmax correctness (and entropy) of a long sequence, one chunk of activations at a time.

    Args:
        model: a transformers causal LM (or a peft model wrapping one).
        input_ids: [B, N] token ids, N >= 2.
        labels: [B, N] integer targets aligned with ``input_ids`` as in transformers (shifted inside);
            -100 marks positions without a target. None = next-token prediction on ``input_ids``.
        chunk_size: tokens per chunk (a multiple of ``page_size``).
        page_size: tokens per page of the K/V store.
        backend: attention kernels: "auto" (fa4 on Hopper/Blackwell with flash-attn-4, else Triton on CUDA,
            PyTorch elsewhere), "fa4", "triton" or "torch".
        doc_ids, attention_mask, page_budget, selection, offload, offload_gpu_bytes: packed documents,
            padding, page-sparse attention and pages in host memory, as in ``chunked_backward`` (evaluate a
            model the way it was trained).
        options: the training step's ``oomb.engine.StepOptions`` instead of the keywords from
            ``chunk_size`` to ``offload_gpu_bytes`` (leave those at their defaults): the same store and
            the same attention as the step (its ``cache_attention`` and ``loss_impl`` do not apply).
        entropy: also each target position's entropy of the predicted distribution (one more pass over the
            logits of each block of rows on the head; off by default, as only TRL's metrics report it).

    Runs under ``torch.no_grad`` with the model in eval mode (its mode is restored after).
    Positions without a target skip the LM head, so an evaluation that scores a few
    tokens (retrieval answers) pays for the head on those tokens only.
    """
    options = options_from_keywords(options, step_keywords, caller="chunked_eval", allowed=EVAL_KEYWORDS)
    model = unwrap_peft(model)
    was_training = model.training
    model.eval()  # no dropout: evaluation is deterministic
    check_model_architecture(model)
    try:
        return _chunked_eval(model, input_ids, labels, doc_ids, attention_mask, options, entropy)
    finally:
        model.train(was_training)


@torch.no_grad()
def _chunked_eval(model, input_ids, labels, doc_ids, attention_mask, options: StepOptions,
                  with_entropy: bool) -> EvalResult:
    # A training step's store is shared where one matches (evaluating between steps reallocates nothing);
    # else the pass gets a store of K and V alone (prepare._store_for).
    prepared = prepare_step(model, input_ids, labels, doc_ids, options, forward_only=True,
                            attention_mask=attention_mask)
    targets, store, step = prepared.targets, prepared.store, prepared.context
    batch, seq_len = input_ids.shape
    device = input_ids.device
    head, transform = model.get_output_embeddings(), prepared.support.transform

    nll = torch.full((batch, seq_len), float("nan"), dtype=torch.float32, device=device)
    correct = torch.zeros((batch, seq_len), dtype=torch.bool, device=device)
    entropy = torch.full_like(nll, float("nan")) if with_entropy else None
    try:
        with prepared.running():
            for start, end in prepared.bounds:
                store.append_chunk(end - start)
                hidden = run_chunk(model, step, input_ids, start, end)
                chunk_targets = targets[:, start:end]
                rows = (chunk_targets != IGNORE_INDEX).nonzero(as_tuple=True)  # host sync, once per chunk
                if rows[0].numel():
                    found = head_nll_and_argmax(hidden[rows], head.weight, head.bias, chunk_targets[rows], transform,
                                                entropy=with_entropy)
                    nll[:, start:end][rows] = found[0]
                    correct[:, start:end][rows] = found[1]
                    if with_entropy:
                        entropy[:, start:end][rows] = found[2]
                step.drop_page_lists(start)  # each chunk runs once: its page lists are not needed again
    finally:
        store.clear()  # pool usage returns to zero, also after an error
    return EvalResult(nll=nll, correct=correct, targets=targets, entropy=entropy)


def head_nll_and_argmax(
    hidden: torch.Tensor,  # [T, Dm]
    weight: torch.Tensor,  # [V, Dm]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [T] int64, every entry a valid id
    transform: LogitTransform = IDENTITY,
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, ...]:
    """-log softmax(logits)[target] (fp32 [T]) and argmax == target ([T] bool), logits = ``transform`` of
    hidden @ weight.T + bias (the model's own logits); with ``entropy`` also the softmax's entropy (fp32 [T]),
    log-sum-exp minus the softmax-weighted mean logit, kept online like the sum.

    Blocks of rows x blocks of the vocabulary with an online log-sum-exp, so neither the
    [T, V] logits nor an fp32 copy of the whole head weight exist at once. The argmax
    takes the first of equal maxima, like ``torch.argmax``.
    """
    acc = torch.promote_types(weight.dtype, torch.float32)  # fp32 math (fp64 for fp64 models)
    vocab = weight.shape[0]
    nll = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    ent = torch.empty_like(nll) if entropy else None
    for r0 in range(0, hidden.shape[0], _ROW_BLOCK):
        h = hidden[r0 : r0 + _ROW_BLOCK].to(acc) * transform.hidden_scale
        t = targets[r0 : r0 + _ROW_BLOCK]
        run_max = torch.full((h.shape[0],), float("-inf"), dtype=acc, device=h.device)
        run_sum = torch.zeros_like(run_max)
        run_weighted = torch.zeros_like(run_max)  # sum of e^(logit - run_max) * logit
        arg = torch.zeros_like(t)
        picked = torch.zeros_like(run_max)
        for v0 in range(0, vocab, _VOCAB_BLOCK):
            v1 = min(v0 + _VOCAB_BLOCK, vocab)
            logits = h @ weight[v0:v1].to(acc).T  # [rows, vocab block]
            if bias is not None:
                logits += bias[v0:v1].to(acc)
            logits *= transform.logit_scale
            if transform.softcap is not None:
                logits = transform.softcap * torch.tanh(logits / transform.softcap)
            block_max, block_arg = logits.max(dim=-1)
            new_max = torch.maximum(run_max, block_max)
            rescale, weights = torch.exp(run_max - new_max), torch.exp(logits - new_max[:, None])
            run_sum = run_sum * rescale + weights.sum(-1)
            if entropy:
                run_weighted = run_weighted * rescale + (weights * logits).sum(-1)
            better = block_max > run_max  # strict: an earlier block keeps a tie
            arg = torch.where(better, block_arg + v0, arg)
            run_max = new_max
            inside = (t >= v0) & (t < v1)
            local = (t - v0).clamp(0, v1 - v0 - 1)
            picked = torch.where(inside, logits.gather(1, local[:, None]).squeeze(1), picked)
        lse = run_max + torch.log(run_sum)
        nll[r0 : r0 + _ROW_BLOCK] = (lse - picked).float()
        correct[r0 : r0 + _ROW_BLOCK] = arg == t
        if entropy:
            ent[r0 : r0 + _ROW_BLOCK] = (lse - run_weighted / run_sum).float()
    return (nll, correct) if not entropy else (nll, correct, ent)
