"""Join a model's attention call to the paged store.

Stage 1 (fill, no autograd): write the chunk's K/V to its pages and attend.
Stage 2 (recompute, autograd): ``PagedAttention`` writes the recomputed K/V, attends,
and in backward adds dK/dV of every attended page into the gradient pages, then
returns the chunk's own K/V gradient FROM its gradient pages: by then they hold the
contributions of every later chunk (which ran its backward first) plus this one's.
"""

from __future__ import annotations

import torch

from oomb.attention.context import StepContext
from oomb.sparse import select_pages


def visibility(step: StepContext, layer_idx: int, q: torch.Tensor, sliding_window: int | None) -> dict:
    """Keyword arguments for the kernels: the chunk's document starts and its page lists.

    A layer's page lists for a chunk are chosen the first time the chunk runs (stage 1, or
    stage 2 for the last chunk) and reused afterwards (``step.page_lists``), so every pass
    attends the same pages. Sliding-window layers stay dense: they read only the pages inside
    their window anyway.
    """
    store = step.store
    kv_len, c = store.num_tokens, q.shape[2]
    q0 = kv_len - c
    doc_start = None if step.doc_start is None else step.doc_start[:, q0:kv_len]
    kwargs = {"doc_start": doc_start}
    policy = step.selection
    if policy is not None and sliding_window is None:
        def choose():
            return select_pages(q, store.mean_keys(layer_idx), store.page_table, q0 // store.spec.page_size,
                                store.spec.page_size, policy, doc_start, group=step.tp_group)

        page_select = step.page_lists.chosen(layer_idx, q0, choose)
        if page_select is not None:
            kwargs.update(page_select=page_select, select_block=policy.block)
            if policy.chunk_pages is not None:  # a row's lists name at most this many pages: fa4 gathers no more
                kwargs.update(page_union=policy.pages_per_list(c) * page_select.shape[1])
    return kwargs


def profiler_range(direction: str, sliding_window: int | None, vis: dict):
    """A torch.profiler range around a layer's attention kernels, named by what the layer attends: e.g.
    ``oomb.attention.forward.window`` (a sliding layer), ``.full`` or ``.sparse`` (its chosen pages). A profile
    groups the kernels by it (benchmarks/timeline.py): a sliding layer's cost against a full one's."""
    kind = "window" if sliding_window is not None else "sparse" if "page_select" in vis else "full"
    return torch.profiler.record_function(f"oomb.attention.{direction}.{kind}")


def _attend(step: StepContext, layer_idx: int, q, k, v, sinks, scale, sliding_window):
    """Fetch the layer's working set, write the chunk's K/V, attend; returns (out, lse, vis)."""
    store = step.store
    vis = visibility(step, layer_idx, q, sliding_window)
    past = step.page_lists.layer_ran(store, layer_idx, sliding_window, vis.get("page_select"))
    # A layer rebuilt alone in stage 2 runs its backward next: fetch what that reads (the gradient pages too), so
    # an offloaded store fills the layer's slot once, as the backward of the layer after it prefetched it.
    rebuilt = step.by_layer and step.stage == "recompute"
    pools, table = store.fetch(layer_idx, past, grads=rebuilt)
    store.write(layer_idx, k, v)
    with profiler_range("forward", sliding_window, vis):
        out, lse = step.backend.forward(
            q, pools.k, pools.v, table, store.num_tokens,
            scale=scale, sliding_window=sliding_window, sinks=sinks, **vis,
        )
    store.writeback(layer_idx, grads=False)
    if rebuilt:
        return out, lse, vis  # no next layer's forward follows: this layer's backward prefetches the one before
    known, pages = step.page_lists.past_pages(store, layer_idx + 1)
    if known:
        if step.selection is not None:  # its selection reads its page summaries first: queued before its pages
            store.prefetch_mean_keys(layer_idx + 1)
        store.prefetch(layer_idx + 1, pages, grads=False)  # the next layer's pages, while this one computes
    else:  # a sparse layer chooses its pages when it runs: bring what it chooses them by
        store.prefetch_mean_keys(layer_idx + 1)
    return out, lse, vis


class PagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, step: StepContext, layer_idx: int, scale: float, sliding_window):
        cached = step.attention_outputs.pop((layer_idx, step.store.last_chunk().start), None)
        if cached is not None:
            # Stage 1 attended these queries over these pages already (the chunk's K/V are in its
            # pages since then): reuse its output instead of attending again.
            out, lse = cached
            vis = visibility(step, layer_idx, q, sliding_window)
            step.store.refill(layer_idx, k, v)  # K/V pages a sliding layer gave up after stage 1, for the backward
        else:
            out, lse, vis = _attend(step, layer_idx, q, k, v, sinks, scale, sliding_window)
        ctx.vis = vis
        ctx.save_for_backward(q, out, lse, sinks)
        ctx.step, ctx.layer_idx, ctx.scale, ctx.sliding_window = step, layer_idx, scale, sliding_window
        ctx.record = step.store.last_chunk()
        ctx.kv_len = step.store.num_tokens
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, out, lse, sinks = ctx.saved_tensors
        step, layer_idx = ctx.step, ctx.layer_idx
        store = step.store
        if store.last_chunk() != ctx.record:
            raise RuntimeError("the paged store changed between this chunk's forward and backward")
        pools, table = store.fetch(layer_idx, step.page_lists.past_pages(store, layer_idx)[1], grads=True)
        # d_out as autograd hands it ([B, H, C, D], a view of the [B, C, H, D] gradient of the layer's output): every
        # backend reads strided rows, and FA4 wants exactly that layout, so a copy here would be one more pass
        with profiler_range("backward", ctx.sliding_window, ctx.vis):
            dq, d_sinks = step.backend.backward(
                d_out, q, out, lse, pools.k, pools.v, pools.dk, pools.dv,
                table, ctx.kv_len,
                scale=ctx.scale, sliding_window=ctx.sliding_window, sinks=sinks, **ctx.vis,
            )
        dk, dv = store.read_grad(layer_idx, ctx.record)
        store.writeback(layer_idx, grads=True)
        known, pages = step.page_lists.past_pages(store, layer_idx - 1)
        if known and layer_idx > 0:
            store.prefetch(layer_idx - 1, pages, grads=True)  # backward runs the layers in reverse
        if d_sinks is not None:
            d_sinks = d_sinks.to(sinks.dtype)
        return dq, dk.to(q.dtype), dv.to(q.dtype), d_sinks, None, None, None, None


def paged_attention(
    q: torch.Tensor,  # [B, H, C, D], after RoPE
    k: torch.Tensor,  # [B, H_kv, C, D], after RoPE
    v: torch.Tensor,  # [B, H_kv, C, D]
    step: StepContext,
    layer_idx: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:
    """The chunk's attention output [B, H, C, D_v] over everything stored before it and itself."""
    if step.stage == "fill":
        # Stage 1 runs under no_grad: write and attend; nothing saved unless outputs are cached.
        out, lse, _ = _attend(step, layer_idx, q, k, v, sinks, scale, sliding_window)
        if step.cache_attention:
            step.attention_outputs[(layer_idx, step.store.last_chunk().start)] = (out, lse)
    else:
        out = PagedAttention.apply(q, k, v, sinks, step, layer_idx, scale, sliding_window)
    if step.attended is not None:  # padding attends nothing: zero output (and no gradient into it)
        record = step.store.last_chunk()
        out = out * step.attended[:, None, record.start : record.end, None].to(out.dtype)
    return out
