"""An exactness oracle for page-sparse training: record -> mask -> full-sequence reference.

Page-sparse attention changes WHICH keys a query sees, not how it attends them. So once the
pages each query block attended are known, the chunked sparse step must equal ordinary
full-sequence training of the same model under the equivalent boolean attention mask:
loss and every parameter gradient, up to floating-point order.

1. ``record_page_lists()`` observes a ``chunked_backward`` run: every page list handed to the
   kernels, per (layer, chunk start) and per call (stage 1's forward, stage 2's recompute and
   its backward reuse the forward's keyword arguments). It wraps
   ``oomb.attention.function.visibility``, the one function that turns the step's state into
   the kernels' ``page_select`` / ``select_block`` arguments, so what is recorded is what the
   kernels were given (the engine's own ``StepContext.page_lists`` holds the same tensors).
   A page list is ``[B, H_sel, ceil(C / block), page_budget]`` int32 of LOGICAL page indices of
   the sequence (page p holds tokens [p * page_size, (p + 1) * page_size)), not page ids of
   the store's pool; H_sel is 1 (shared) or H_kv (``per_head``); no padding: every entry is a
   distinct page before the chunk. None means the chunk attends its whole past (the history
   held no more than ``page_budget`` pages), and sliding-window layers never get a list.
2. ``attention_masks()`` turns the record into one [B, H_sel, N, N] boolean mask per layer:
   query i sees key j iff j <= i, i and j are in the same document, i - j < the layer's
   window, and j is either in i's own chunk or in a page selected for i's block.
3. ``full_sequence_step()`` runs the model over the whole sequence once, with an attention
   function registered with transformers as ``"oomb_oracle"`` that applies that mask (and
   GPT-OSS's sinks as transformers' eager attention does), and returns loss and gradients.

``check_selection()`` adds an independent check of the lists themselves: recomputed from the
full run's queries and keys, each list holds the sink and local pages and the top-scoring others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from transformers import AttentionInterface, PreTrainedModel

from oomb.attention import function as attention_function
from oomb.sparse import PageSelection

ORACLE_NAME = "oomb_oracle"
ORACLE_KWARG = "oomb_oracle"  # the keyword argument that carries OracleInputs to every layer
IGNORE_INDEX = -100


@dataclasses.dataclass
class AttentionCall:
    """What one attention call of one chunk was given."""

    stage: str  # the step's stage: "fill" or "recompute"
    chunk_len: int
    page_select: torch.Tensor | None  # [B, H_sel, blocks, budget] int32 logical page indices (a copy)
    select_block: int | None
    sliding_window: int | None


@dataclasses.dataclass
class PageRecord:
    page_size: int = 0
    calls: dict[tuple[int, int], list[AttentionCall]] = dataclasses.field(default_factory=dict)

    def chunk_views(self) -> dict[tuple[int, int], AttentionCall]:
        """One call per (layer, chunk start), after checking that every call of it saw the same pages."""
        views = {}
        for key, calls in self.calls.items():
            first = calls[0]
            for other in calls[1:]:
                same = (other.select_block == first.select_block and other.sliding_window == first.sliding_window
                        and (other.page_select is None) == (first.page_select is None)
                        and (first.page_select is None or torch.equal(other.page_select, first.page_select)))
                if not same:
                    raise AssertionError(f"layer {key[0]}, chunk at {key[1]}: stage {other.stage!r} attended other "
                                         f"pages than stage {first.stage!r}")
            views[key] = first
        return views

    def windows(self) -> dict[int, int | None]:
        return {layer: view.sliding_window for (layer, _), view in self.chunk_views().items()}


@contextlib.contextmanager
def record_page_lists():
    """Record the page lists the kernels get during the block (test-only wrap of ``visibility``)."""
    record = PageRecord()
    real = attention_function.visibility

    def observed(step, layer_idx, q, sliding_window):
        kwargs = real(step, layer_idx, q, sliding_window)
        record.page_size = step.store.spec.page_size
        start = step.store.num_tokens - q.shape[2]  # q is the newest chunk's queries
        chosen = kwargs.get("page_select")
        record.calls.setdefault((layer_idx, start), []).append(AttentionCall(
            step.stage, q.shape[2], None if chosen is None else chosen.detach().clone(),
            kwargs.get("select_block"), sliding_window))
        return kwargs

    attention_function.visibility = observed
    try:
        yield record
    finally:
        attention_function.visibility = real


def selected_past(view: AttentionCall, start: int, page_size: int) -> torch.Tensor:
    """[B, H_sel, chunk_len, start] bool: the past keys each query of the chunk attends, from its list."""
    chosen = view.page_select.long()
    n_past = start // page_size
    bitmap = torch.zeros(*chosen.shape[:3], n_past, dtype=torch.bool)
    bitmap.scatter_(-1, chosen, True)
    block_of_query = torch.arange(view.chunk_len) // view.select_block
    return bitmap[:, :, block_of_query].repeat_interleave(page_size, dim=-1)


def attention_masks(record: PageRecord, batch: int, seq_len: int,
                    doc_ids: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """layer -> [B, H_sel, N, N] bool mask equivalent to what the chunked sparse run attended."""
    views = record.chunk_views()
    pos = torch.arange(seq_len)
    causal = pos[None, :] <= pos[:, None]  # [query, key]
    same_doc = torch.ones(batch, seq_len, seq_len, dtype=torch.bool)
    if doc_ids is not None:
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    masks = {}
    for layer in sorted({layer for layer, _ in views}):
        chunks = sorted((start, view) for (lay, start), view in views.items() if lay == layer)
        covered = sum(view.chunk_len for _, view in chunks)
        if covered != seq_len or chunks[0][0] != 0:
            raise AssertionError(f"layer {layer}: the record covers {covered} of {seq_len} tokens")
        window = chunks[0][1].sliding_window
        mask = causal & same_doc
        if window is not None:
            mask = mask & ((pos[:, None] - pos[None, :]) < window)
        heads = max((v.page_select.shape[1] for _, v in chunks if v.page_select is not None), default=1)
        mask = mask.unsqueeze(1).repeat(1, heads, 1, 1)  # [B, H_sel, N, N]
        for start, view in chunks:
            if view.page_select is not None:
                end = start + view.chunk_len
                mask[:, :, start:end, :start] &= selected_past(view, start, record.page_size)
        masks[layer] = mask
    return masks


def drop_one_page(masks: dict[int, torch.Tensor], record: PageRecord) -> dict[int, torch.Tensor]:
    """A deliberately wrong copy of ``masks``: in the last sparse chunk of the last sparse layer, the
    first query block of row 0 (first KV head's list) loses the first selected page it can see."""
    views = record.chunk_views()
    (layer, start), view = max(((k, v) for k, v in views.items() if v.page_select is not None), key=lambda kv: kv[0])
    wrong = {lay: m.clone() for lay, m in masks.items()}
    p = record.page_size
    rows = slice(start, start + min(view.select_block, view.chunk_len))
    for page in view.page_select[0, 0, 0].tolist():
        if wrong[layer][0, 0, rows, page * p:(page + 1) * p].any():
            wrong[layer][0, 0, rows, page * p:(page + 1) * p] = False
            return wrong
    raise AssertionError("no selected page is visible to the first block: nothing to drop")


@dataclasses.dataclass
class OracleInputs:
    masks: dict[int, torch.Tensor]  # layer -> [B, H_sel, N, N] bool
    windows: dict[int, int | None]  # layer -> the sliding window the masks were built with
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     s_aux=None, **kwargs):
    """Eager attention over the whole sequence under a given mask (transformers' AttentionInterface)."""
    inputs: OracleInputs = kwargs[ORACLE_KWARG]
    layer = module.layer_idx
    if attention_mask is not None or dropout:
        raise AssertionError("the oracle applies its own mask and no dropout")
    if inputs.windows[layer] != sliding_window:
        raise AssertionError(f"layer {layer}: the mask was built for window {inputs.windows[layer]}, "
                             f"the model uses {sliding_window}")
    inputs.captured[layer] = (query.detach(), key.detach())
    b, h, n, _ = query.shape
    groups = h // key.shape[1]
    keys = key.repeat_interleave(groups, dim=1)  # query head h reads KV head h // groups (repeat_kv)
    values = value.repeat_interleave(groups, dim=1)
    mask = inputs.masks[layer]
    mask = mask.repeat_interleave(h // mask.shape[1], dim=1)  # [B, H, N, N]
    logits = (query @ keys.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~mask, -math.inf)
    if s_aux is not None:  # GPT-OSS: a per-head logit in the softmax denominator, with no value
        logits = torch.cat([logits, s_aux.reshape(1, h, 1, 1).expand(b, h, n, 1)], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)  # every row sees at least its own key
    probs = torch.softmax(logits, dim=-1)
    if s_aux is not None:
        probs = probs[..., :-1]
    return (probs @ values).transpose(1, 2).contiguous(), None


AttentionInterface.register(ORACLE_NAME, oracle_attention)


def full_sequence_step(model: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor | None,
                       inputs: OracleInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(mean loss over target tokens, parameter gradients) of one forward/backward over the whole sequence."""
    labels = input_ids if labels is None else labels
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    model.zero_grad(set_to_none=True)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ORACLE_NAME)
    try:
        positions = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)
        logits = model(input_ids=input_ids, position_ids=positions, use_cache=False, **{ORACLE_KWARG: inputs}).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                 ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss / (targets != IGNORE_INDEX).sum()
        loss.backward()
    finally:
        model.set_attn_implementation(previous)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def gradient_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """||got - ref|| / ||ref|| per parameter (the absolute norm where ref is zero), in float64."""
    if got.keys() != ref.keys():
        raise AssertionError(f"parameters with gradients differ: {sorted(got.keys() ^ ref.keys())}")
    errors = {}
    for name, g in got.items():
        diff, norm = (g.double() - ref[name].double()).norm(), ref[name].double().norm()
        errors[name] = float(diff / norm) if norm > 0 else float(diff)
    return errors


def check_selection(record: PageRecord, captured: dict[int, tuple[torch.Tensor, torch.Tensor]],
                    policy: PageSelection, doc_ids: torch.Tensor | None = None, rel_tol: float = 1e-4) -> int:
    """Check every recorded list against scores recomputed from the full run's queries and keys.

    Each list must hold distinct pages before its chunk, every sink and local page, and otherwise
    the top-scoring pages (no page left out scores above one kept, up to ``rel_tol`` of the score
    scale: the full run's queries differ from the chunked run's by rounding). Pages that end before
    the block's first query's document start score -inf. Returns the number of lists checked.
    """
    checked = 0
    for (layer, start), view in record.chunk_views().items():
        if view.page_select is None:
            continue
        chosen = view.page_select.long()
        n_past = start // record.page_size
        if chosen.shape[-1] != policy.page_budget or view.select_block != policy.block:
            raise AssertionError(f"layer {layer}, chunk at {start}: list shape {tuple(chosen.shape)}, block "
                                 f"{view.select_block} do not match {policy}")
        if not ((chosen >= 0) & (chosen < n_past)).all() or not (chosen[..., 1:] > chosen[..., :-1]).all():
            raise AssertionError(f"layer {layer}, chunk at {start}: pages out of range or not ascending: {chosen}")
        scores, hidden = _page_scores(captured[layer], start, view, record.page_size, policy, doc_ids)
        forced = torch.zeros(n_past, dtype=torch.bool)
        forced[:policy.sink_pages] = True
        if policy.local_pages:
            forced[n_past - policy.local_pages:] = True
        # What the policy ranks by: kept by rule above all, invisible to the block below all.
        ranked = scores.masked_fill(forced, math.inf).masked_fill(hidden, -math.inf)
        kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        if (forced & ~hidden & ~kept).any():
            raise AssertionError(f"layer {layer}, chunk at {start}: a sink or local page is missing")
        finite = scores[torch.isfinite(ranked)]
        slack = rel_tol * (float(finite.abs().max()) if finite.numel() else 1.0)
        if policy.chunk_pages is not None and n_past > policy.chunk_pages and ranked.shape[2] > 1:
            # The chunk's candidates: the chunk_pages pages with the best score for any block. Its lists name no
            # more between them, nothing outside them, and each block ranks only them (pages within the slack of
            # the cut may fall either side of it: left out of the comparison).
            best = ranked.amax(dim=2, keepdim=True)
            cut = best.topk(policy.chunk_pages, dim=-1).values[..., -1:]
            if (kept.any(dim=2).sum(-1) > policy.chunk_pages).any():
                raise AssertionError(f"layer {layer}, chunk at {start}: the lists name more than "
                                     f"{policy.chunk_pages} pages between them")
            if (kept & (best < cut - slack)).any():
                raise AssertionError(f"layer {layer}, chunk at {start}: a page outside the chunk's candidates "
                                     "was chosen")
            ranked = ranked.masked_fill((best <= cut + slack) & ~kept, -math.inf)
        lowest_kept = ranked.masked_fill(~kept, math.inf).amin(dim=-1)
        highest_left = ranked.masked_fill(kept, -math.inf).amax(dim=-1)
        bad = highest_left > lowest_kept + slack
        if bad.any():
            where = tuple(torch.nonzero(bad)[0].tolist())
            raise AssertionError(f"layer {layer}, chunk at {start}, (batch, head, block) {where}: a page scoring "
                                 f"{float(highest_left[where]):.6g} was left out for one scoring "
                                 f"{float(lowest_kept[where]):.6g}")
        checked += chosen.shape[0] * chosen.shape[1] * chosen.shape[2]
    return checked


def _page_scores(qk, start: int, view: AttentionCall, page_size: int, policy: PageSelection,
                 doc_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Page scores [B, H_sel, blocks, n_past] float64 of one chunk, written from the definition, and
    which pages end before the block's first query's document ([B, 1, blocks, n_past] bool)."""
    query, key = (x.double() for x in qk)  # [B, H, N, D], [B, H_kv, N, D]
    b, h, _, d = query.shape
    h_kv, n_past = key.shape[1], start // page_size
    q = query[:, :, start:start + view.chunk_len].reshape(b, h_kv, h // h_kv, view.chunk_len, d)
    blocks = torch.arange(view.chunk_len).split(view.select_block)
    q_mean = torch.stack([q[:, :, :, rows].mean(dim=(2, 3)) for rows in blocks], dim=2)  # [B, H_kv, blocks, D]
    pages = key[:, :, :start].reshape(b, h_kv, n_past, page_size, d)
    if policy.score == "mean":
        scores = torch.einsum("bhqd,bhpd->bhqp", q_mean, pages.mean(dim=3))
    else:  # the largest q_mean . k over any k in the page's per-channel box
        lo, hi = pages.amin(dim=3), pages.amax(dim=3)
        scores = torch.maximum(q_mean[:, :, :, None] * lo[:, :, None], q_mean[:, :, :, None] * hi[:, :, None]).sum(-1)
    if not policy.per_head:
        scores = scores.sum(dim=1, keepdim=True)
    hidden = torch.zeros(b, 1, len(blocks), n_past, dtype=torch.bool)
    if doc_ids is not None:
        first_query = torch.tensor([start + rows[0] for rows in blocks])  # [blocks]
        block_doc = doc_ids[:, first_query]  # [B, blocks]
        page_last_doc = doc_ids[:, page_size - 1:start:page_size]  # [B, n_past]: a page's last token's document
        hidden = (page_last_doc[:, None, :] != block_doc[:, :, None]).unsqueeze(1)  # ids only grow along N
    return scores, hidden
