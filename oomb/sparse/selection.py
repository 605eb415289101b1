"""Page selection for page-level top-k sparse attention (docs/design.md, "Page-sparse attention").

Past the first ``page_budget`` pages, each block of ``block`` queries of a chunk
attends only ``page_budget`` of the pages stored before the chunk (plus the chunk
itself, always). Which pages: the highest scores

    score(block, page) = mean over the block's queries and the GQA group's heads of q . k_mean(page)
                       = q_mean(block) . k_mean(page)          (linear, so one dot per pair)

per KV head, summed over KV heads unless ``per_head`` (one page list per KV head).
``score="bound"`` ranks pages instead by an upper bound of the block's mean query against any
key of the page, q_mean+ . k_max + q_mean- . k_min with per-channel key minima and maxima
(as Quest does for decoding): a page holding one strongly matching key among many others is
diluted in its mean key, not in its bound. It needs the store's ``key_summary="bounds"``.
``sink_pages`` first pages and ``local_pages`` most recent pages can be kept always;
they count towards the budget. ``chunk_pages`` caps the distinct pages a chunk's blocks choose
among: the ``chunk_pages`` pages whose best score over the chunk's blocks is highest, each block
then ranking those alone, so the lists of a chunk name at most ``chunk_pages`` pages (per list)
between them. That is what an offloaded store moves for the chunk, per layer: with blocks of 128
and no cap, the union of a chunk's lists is most of the past at long contexts.

The result feeds the kernels' ``page_select``: [B, H_sel, ceil(C / block), page_budget] int32,
ascending page indices.

A chunk's selection is made once, in stage 1, and reused in stage 2 (``oomb.cache.PageLists``
keeps a step's page lists), so the recomputed forward and the backward see exactly the pages
stage 1 saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed

SCORES = ("mean", "bound")
# The default page score. "bound" rather than the paper's "mean": in the retrieval study (docs/sparse.md,
# on an H200) sparse training at 64 pages learned like dense training with it (100% at 32K, +0.0 points)
# and 87.5% with "mean" (-12.5), and a step of Qwen2.5-7B at 128K took the same time with either.
DEFAULT_SCORE = "bound"


def store_key_summary(score: str | None) -> str:
    """The paged store's per-page key summary (StoreSpec.key_summary) that a page score needs:
    min and max beside the mean for "bound", the mean alone otherwise (also for dense, None)."""
    return "bounds" if score == "bound" else "mean"


@dataclass(frozen=True)
class PageSelection:
    """How past pages are chosen; ``page_budget`` pages per query block in all."""

    page_budget: int = 64
    block: int = 128  # queries per selection block (a multiple of 16 keeps kernel tiles whole)
    sink_pages: int = 0  # the sequence's first pages, always kept
    local_pages: int = 0  # the pages just before the chunk, always kept
    per_head: bool = False  # one page list per KV head instead of one for all heads
    score: str = DEFAULT_SCORE  # "bound": an upper bound of q_mean . k over the page; "mean": q_mean . k_mean
    chunk_pages: int | None = None  # the most distinct pages one chunk's blocks choose among, per list (None: any)

    def __post_init__(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"the page score must be one of {SCORES}, got {self.score!r}")
        if self.page_budget < 1:
            raise ValueError(f"page_budget must be >= 1 (or None for dense attention), got {self.page_budget}")
        if self.block < 1:
            raise ValueError(f"the selection block must be >= 1 query, got {self.block}")
        if self.sink_pages < 0 or self.local_pages < 0:
            raise ValueError("sink_pages and local_pages must be >= 0")
        if self.sink_pages + self.local_pages > self.page_budget:
            raise ValueError(
                f"sink_pages ({self.sink_pages}) + local_pages ({self.local_pages}) exceed page_budget "
                f"({self.page_budget}): the always-kept pages count towards the budget"
            )
        if self.chunk_pages is not None and self.chunk_pages < self.page_budget:
            raise ValueError(f"chunk_pages ({self.chunk_pages}) must be at least page_budget ({self.page_budget}): "
                             "every block chooses page_budget pages among them")

    def pages_per_list(self, queries: int) -> int:
        """The most distinct past pages one list row of a chunk of ``queries`` queries names (every block's
        budget, or the chunk's cap): what an offloaded store may be asked for, per list."""
        named = -(-queries // self.block) * self.page_budget
        return named if self.chunk_pages is None else min(named, self.chunk_pages)


@torch.no_grad()
def select_pages(
    q: torch.Tensor,  # [B, H, C, D] the chunk's queries (after RoPE)
    mean_k: torch.Tensor,  # [num_pages, H_kv, D or 3D] per-page key summary (the store's: mean | min | max)
    page_table: torch.Tensor,  # [B, >= n_past] int32
    n_past: int,  # pages stored before the chunk
    page_size: int,
    policy: PageSelection,
    doc_start: torch.Tensor | None = None,  # [B, C] first key of each query's document
    group: torch.distributed.ProcessGroup | None = None,
) -> torch.Tensor | None:
    """[B, H_sel, ceil(C / block), page_budget] int32 ascending past-page indices, or None when the
    history holds no more than ``page_budget`` pages (then attention is dense).

    ``group``: tensor parallel ranks that each hold some of the KV heads (``q`` and ``mean_k``
    are this rank's heads). Shared lists (not ``per_head``) sum the scores of every rank's heads,
    gathered in rank order so the sum runs in one process's order: every rank picks the pages
    one process would. Per-head lists need no communication.
    """
    budget = policy.page_budget
    if n_past <= budget:
        return None
    b, h, c, d = q.shape
    h_kv = mean_k.shape[1]
    n_qb = -(-c // policy.block)

    # Mean query of each block and GQA group: [B, H_kv, n_qb, D] (a ragged last block averages what it has).
    # summed in float32 as read: no float32 copy of the chunk's queries first
    qf = q.reshape(b, h_kv, h // h_kv, c, d).sum(dim=2, dtype=torch.float32)  # [B, H_kv, C, D]
    pad = n_qb * policy.block - c
    if pad:
        qf = torch.nn.functional.pad(qf, (0, 0, 0, pad))
    counts = torch.full((n_qb,), float(policy.block), device=q.device)
    counts[-1:].fill_(c - (n_qb - 1) * policy.block)  # the number as a kernel argument, no host copy
    q_mean = qf.view(b, h_kv, n_qb, policy.block, d).sum(dim=3) / (counts.view(1, 1, n_qb, 1) * (h // h_kv))

    summary = mean_k[page_table[:, :n_past].long()].float()  # [B, n_past, H_kv, D or 3D]
    if policy.score == "bound":
        if summary.shape[-1] != 3 * d:
            raise ValueError("score='bound' needs a store built with key_summary='bounds' (per-page key min and max)")
        # max over the page's keys k of q . k <= sum_d max(q_d min_d, q_d max_d) = q+ . max + q- . min
        k_min, k_max = summary[..., d : 2 * d], summary[..., 2 * d :]
        scores = (torch.einsum("bhqd,bphd->bhqp", q_mean.clamp(min=0), k_max)
                  + torch.einsum("bhqd,bphd->bhqp", q_mean.clamp(max=0), k_min))
    else:
        scores = torch.einsum("bhqd,bphd->bhqp", q_mean, summary[..., :d])  # [B, H_kv, n_qb, n_past]
    if not policy.per_head:
        if group is not None and torch.distributed.get_world_size(group) > 1:
            # [B, H_kv_local, n_qb, n_past] fp32 from every rank: B * H_kv * n_qb * n_past * 4 bytes.
            parts = [torch.empty_like(scores) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(parts, scores.contiguous(), group=group)
            scores = torch.cat(parts, dim=1)
        scores = scores.sum(dim=1, keepdim=True)

    if policy.sink_pages or policy.local_pages:  # else three launches and a pass over the scores for nothing
        forced = torch.zeros(n_past, dtype=torch.bool, device=q.device)
        forced[: policy.sink_pages] = True
        if policy.local_pages:
            forced[n_past - policy.local_pages:] = True
        scores = scores.masked_fill(forced, float("inf"))
    if doc_start is not None:
        # A page that ends before the block's first document start is invisible to the whole block.
        block_first_doc = doc_start[:, :: policy.block].long()  # [B, n_qb] (starts are non-decreasing)
        page_end = (torch.arange(n_past, device=q.device) + 1) * page_size  # exclusive
        hidden = page_end.view(1, 1, n_past) <= block_first_doc.unsqueeze(-1)  # [B, n_qb, n_past]
        scores = scores.masked_fill(hidden.unsqueeze(1), float("-inf"))
    if policy.chunk_pages is not None and n_past > policy.chunk_pages and n_qb > 1:
        # The chunk's candidates: the pages with the best score for any of its blocks (a page one block needs
        # badly stays in), then each block's budget among them alone. Forced pages score inf, so they stay.
        candidates = scores.amax(dim=2).topk(policy.chunk_pages, dim=-1, sorted=False).indices  # [B, H_s, cap]
        among = scores.gather(3, candidates.unsqueeze(2).expand(-1, -1, n_qb, -1))  # [B, H_s, n_qb, cap]
        picked = candidates.unsqueeze(2).expand(-1, -1, n_qb, -1).gather(
            3, among.topk(budget, dim=-1, sorted=False).indices)
    else:  # one block per chunk is its own cap
        picked = scores.topk(budget, dim=-1, sorted=False).indices
    return picked.sort(dim=-1).values.to(torch.int32)

