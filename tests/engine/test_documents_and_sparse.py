"""Packed documents (doc_ids) and page-sparse attention (page_budget) through chunked_backward."""

import pytest
import torch
from helpers import rel_err
from tiny_models import VOCAB, tiny_model

import oomb
from oomb.attention import function as attention_function
from oomb.engine import store_for_model
from oomb.engine.prepare import document_starts
from oomb.sparse import PageSelection

TOL = 1e-5


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,overrides,page", [
    ("llama", {}, 8), ("qwen2", {}, 8), ("gpt_oss", {}, 8),
    ("gpt_oss", {"sliding_window": 9}, 4),  # windows shorter than a chunk: its sliding layers give pages up
])
def test_packed_documents_equal_documents_run_separately(family, overrides, page):
    model = tiny_model(family, **overrides)
    lengths = [37, 50, 41]
    docs = [torch.randint(0, VOCAB, (1, n)) for n in lengths]

    # Reference: each document alone, full sequence, loss summed over all documents' targets.
    n_targets = sum(n - 1 for n in lengths)
    model.zero_grad(set_to_none=True)
    ref_total = 0.0
    for doc in docs:
        out = model(input_ids=doc, labels=doc)
        loss = out.loss * (doc.shape[1] - 1) / n_targets
        loss.backward()
        ref_total += loss.item()
    ref = _grads(model)

    ids = torch.cat(docs, dim=1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    labels = ids.clone()
    labels[0, lengths[0]] = -100  # the last token of a document does not predict the next document's first
    labels[0, lengths[0] + lengths[1]] = -100
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, labels, chunk_size=32, page_size=page, doc_ids=doc_ids)
    assert abs(loss.item() - ref_total) <= TOL * ref_total
    got = _grads(model)
    errors = {n: rel_err(got[n], ref[n]) for n in ref}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: {errors[worst]:.2e}"


def test_document_starts_and_bad_doc_ids():
    ids = torch.zeros(2, 6, dtype=torch.long)
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert document_starts(doc_ids, ids).tolist() == [[0, 0, 2, 2, 2, 5], [0] * 6]
    with pytest.raises(ValueError, match="non-decreasing"):
        document_starts(torch.tensor([[0, 1, 0, 1, 1, 1]] * 2), ids)
    with pytest.raises(ValueError, match="shape"):
        document_starts(doc_ids[:, :5], ids)
    with pytest.raises(TypeError, match="integer"):
        document_starts(doc_ids.float(), ids)


def _record_kernel_calls(monkeypatch):
    """Record (stage, layer, chunk start, page_select) of every attention forward, and selection calls."""
    calls, selections = [], []
    real_visibility, real_select = attention_function.visibility, attention_function.select_pages

    def visibility(step, layer_idx, q, sliding_window):
        kw = real_visibility(step, layer_idx, q, sliding_window)
        calls.append((step.stage, layer_idx, step.store.num_tokens - q.shape[2], kw.get("page_select")))
        return kw

    def select(*args, **kwargs):
        selections.append(args[3])
        return real_select(*args, **kwargs)

    monkeypatch.setattr(attention_function, "visibility", visibility)
    monkeypatch.setattr(attention_function, "select_pages", select)
    return calls, selections


def test_large_budget_equals_dense_exactly():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 128))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=8)
    dense = _grads(model)
    model.zero_grad(set_to_none=True)
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=8, page_budget=12)  # 12 >= 96 / 8 past pages
    for n, g in _grads(model).items():
        assert torch.equal(g, dense[n]), n


def test_selection_is_made_once_and_reused_in_stage_two(monkeypatch):
    calls, selections = _record_kernel_calls(monkeypatch)
    model = tiny_model("gpt_oss")  # layer 0 slides (dense window), layer 1 is full attention (sparse)
    ids = torch.randint(0, VOCAB, (1, 160))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=8,
                          selection=PageSelection(page_budget=3, block=16, sink_pages=1, local_pages=1))
    by_stage = {}
    for stage, layer, start, sel in calls:
        by_stage.setdefault((layer, start), {})[stage] = sel
        if layer == 0:
            assert sel is None  # the sliding-window layer is never sparse
    sparse_chunks = [start for (layer, start), s in by_stage.items() if layer == 1 and s.get("recompute") is not None]
    assert sorted(sparse_chunks) == [32, 64, 96, 128]  # every chunk with more than 3 past pages
    for (layer, start), stages in by_stage.items():
        if "fill" in stages:  # the last chunk only runs in stage 2
            assert stages["fill"] is stages["recompute"], (layer, start)
        sel = stages["recompute"]
        if sel is not None:
            assert sel.shape == (1, 1, 2, 3)
            assert (sel[..., 0] == 0).all()  # the sink page
            assert (sel[..., -1] == start // 8 - 1).all()  # the most recent past page
            assert (sel[..., 1:] > sel[..., :-1]).all()  # ascending, distinct
    assert len(selections) == len({(layer, start) for (layer, start) in by_stage if layer == 1})


def test_sparse_budget_changes_gradients_but_stays_close():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 256))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=8)
    dense = torch.cat([g.flatten() for g in _grads(model).values()])
    model.zero_grad(set_to_none=True)
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=8, page_budget=8, selection=PageSelection(block=16))
    sparse = torch.cat([g.flatten() for g in _grads(model).values()])
    assert not torch.equal(sparse, dense)  # some pages were left out
    cos = torch.nn.functional.cosine_similarity(sparse, dense, dim=0)
    assert cos > 0.9, cos  # a random tiny model attends almost uniformly; most gradient remains


def test_bound_score_finds_a_lone_matching_key_the_mean_misses():
    """One page holds one key along the query among keys against it; another page is mildly along it.
    The mean key ranks the mild page first; the upper bound ranks the page with the lone match first."""
    from oomb.cache.spec import page_key_summary
    from oomb.sparse import select_pages

    d, page = 8, 16
    q = torch.zeros(1, 1, page, d)
    q[..., 0] = 1.0  # every query along channel 0
    needle = torch.full((page, d), 0.0)
    needle[:, 0] = -1.0  # 15 keys against the query ...
    needle[3, 0] = 10.0  # ... and one strongly along it: mean key -0.3125, below the mild page's 0.5
    mild = torch.zeros(page, d)
    mild[:, 0] = 0.5
    noise = torch.zeros(page, d)
    tiles = torch.stack([noise, needle, mild, noise]).view(4, 1, page, d)  # [pages, H_kv, P, D]
    valid = torch.full((4,), float(page))
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    mean = page_key_summary(tiles, valid, "mean")
    bounds = page_key_summary(tiles, valid, "bounds")
    assert torch.equal(bounds[..., :d], mean)
    assert torch.equal(bounds[1, 0, d:2 * d][0], torch.tensor(-1.0)) and bounds[1, 0, 2 * d:][0] == 10.0
    by_mean = select_pages(q, mean, table, 4, page, PageSelection(page_budget=1, block=page, score="mean"))
    by_bound = select_pages(q, bounds, table, 4, page, PageSelection(page_budget=1, block=page, score="bound"))
    assert by_mean.flatten().tolist() == [2] and by_bound.flatten().tolist() == [1]
    # A bound store also answers mean scoring (its first D channels), identically.
    assert torch.equal(select_pages(q, bounds, table, 4, page, PageSelection(page_budget=1, block=page, score="mean")),
                       by_mean)
    with pytest.raises(ValueError, match="key_summary='bounds'"):
        select_pages(q, mean, table, 4, page, PageSelection(page_budget=1, block=page, score="bound"))


def test_bound_summary_ignores_padding_slots():
    from oomb.cache.spec import page_key_summary

    tiles = torch.full((2, 1, 4, 2), 5.0)
    tiles[1, :, 2:] = 0.0  # a ragged last page: 2 valid slots, 2 zero-padded
    got = page_key_summary(tiles, torch.tensor([4.0, 2.0]), "bounds")
    assert torch.equal(got[1, 0], torch.tensor([5.0, 5.0, 5.0, 5.0, 5.0, 5.0]))  # mean, min, max: not 0


def test_bound_score_through_chunked_backward():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 128))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=8)
    dense = _grads(model)
    model.zero_grad(set_to_none=True)  # a budget covering every past page: dense, whatever the score
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=8,
                          selection=PageSelection(page_budget=12, score="bound"))
    for n, g in _grads(model).items():
        assert torch.equal(g, dense[n]), n
    model.zero_grad(set_to_none=True)
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=8,
                          selection=PageSelection(page_budget=2, block=16, score="bound"))
    assert store_for_model(model).spec.key_summary == "bounds"
    sparse = torch.cat([g.flatten() for g in _grads(model).values()])
    assert torch.isfinite(sparse).all() and not torch.equal(sparse, torch.cat([g.flatten() for g in dense.values()]))


def test_bad_selection_settings():
    with pytest.raises(ValueError, match="page score"):
        PageSelection(score="max")
    with pytest.raises(ValueError, match="count towards the budget"):
        PageSelection(page_budget=4, sink_pages=3, local_pages=2)
    with pytest.raises(ValueError, match="page_budget"):
        PageSelection(page_budget=0)


def _random_summaries(n_past, h_kv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_past, h_kv, 16, d, generator=g)
    from oomb.cache.spec import page_key_summary

    return page_key_summary(keys, torch.full((n_past,), 16.0), "bounds"), torch.arange(n_past, dtype=torch.int32)[None]


@pytest.mark.parametrize("per_head", [False, True])
def test_a_chunks_blocks_choose_among_its_best_pages_for_any_block(per_head):
    """chunk_pages: the candidates are the pages with the best score for any block; each block's list is its
    own top budget among them; the lists name no more than chunk_pages pages between them (per list); sinks
    stay; a cap that covers the past or a lone block changes nothing."""
    from oomb.sparse import select_pages

    n_past, budget, cap, block = 40, 4, 6, 16
    summary, table = _random_summaries(n_past)
    q = torch.randn(1, 4, 128, 8, generator=torch.Generator().manual_seed(1))  # 8 blocks
    free = PageSelection(page_budget=budget, block=block, per_head=per_head)
    capped = PageSelection(page_budget=budget, block=block, per_head=per_head, chunk_pages=cap)
    lists = select_pages(q, summary, table, n_past, 16, capped)
    uncapped = select_pages(q, summary, table, n_past, 16, free)
    # the scores the selection ranks by, from the lists of a budget covering every page
    assert lists.shape == uncapped.shape == (1, 2 if per_head else 1, 8, budget)
    scores = _block_scores(q, summary, block, per_head)  # [1, H_sel, 8, n_past]
    candidates = scores.amax(dim=2).topk(cap, dim=-1).indices.sort(dim=-1).values  # [1, H_sel, cap]
    for h in range(lists.shape[1]):
        named = set(lists[0, h].flatten().tolist())
        assert named <= set(candidates[0, h].tolist()) and len(named) <= cap
        for qb in range(8):
            among = candidates[0, h]
            want = among[scores[0, h, qb, among].topk(budget).indices].sort().values
            assert lists[0, h, qb].tolist() == want.tolist()
    assert len(set(uncapped.flatten().tolist())) > cap  # without the cap the blocks name more pages
    # one budget of candidates: every block gets the same list, the pages best for some block
    same = select_pages(q, summary, table, n_past, 16, PageSelection(page_budget=budget, block=block,
                                                                       per_head=per_head, chunk_pages=budget))
    assert (same == same[:, :, :1]).all()
    sinks = select_pages(q, summary, table, n_past, 16, PageSelection(page_budget=budget, block=block, sink_pages=2,
                                                                        per_head=per_head, chunk_pages=budget))
    assert (sinks[..., :2] == torch.tensor([0, 1], dtype=torch.int32)).all()
    for policy in (PageSelection(page_budget=budget, block=block, per_head=per_head, chunk_pages=n_past),
                   PageSelection(page_budget=budget, block=128, per_head=per_head, chunk_pages=budget)):
        plain = PageSelection(page_budget=budget, block=policy.block, per_head=per_head)
        assert torch.equal(select_pages(q, summary, table, n_past, 16, policy),
                           select_pages(q, summary, table, n_past, 16, plain))


def _block_scores(q, summary, block, per_head):
    """The bound score of each block's mean query against each page, written out (selection's definition)."""
    b, h, c, d = q.shape
    h_kv = summary.shape[1]
    q_mean = q.reshape(b, h_kv, h // h_kv, c // block, block, d).mean(dim=(2, 4))  # [B, H_kv, blocks, D]
    lo, hi = summary[..., d:2 * d], summary[..., 2 * d:]  # [n_past, H_kv, D]
    scores = torch.maximum(q_mean[..., None, :] * lo.permute(1, 0, 2)[None, :, None],
                           q_mean[..., None, :] * hi.permute(1, 0, 2)[None, :, None]).sum(-1)
    return scores if per_head else scores.sum(dim=1, keepdim=True)


def test_a_cap_below_the_budget_is_refused():
    with pytest.raises(ValueError, match="chunk_pages .3. must be at least page_budget .4."):
        PageSelection(page_budget=4, chunk_pages=3)
    assert PageSelection(page_budget=4, block=16, chunk_pages=6).pages_per_list(64) == 6  # 4 blocks x 4 > 6
    assert PageSelection(page_budget=4, block=16, chunk_pages=6).pages_per_list(16) == 4  # one block
    assert PageSelection(page_budget=4, block=16).pages_per_list(64) == 16


def test_triton_kernels_equal_torch_path_with_documents_and_pages():
    # The Triton kernels (interpreter on CPU) against the PyTorch path through the whole step.
    model = tiny_model("qwen3")  # head_dim 16
    ids = torch.randint(0, VOCAB, (1, 160))
    doc_ids = torch.zeros(1, 160, dtype=torch.long)
    doc_ids[:, 70:] = 1
    doc_ids[:, 131:] = 2
    kw = dict(chunk_size=32, page_size=16, doc_ids=doc_ids, selection=PageSelection(page_budget=2, block=16))
    results = {}
    for backend in ("torch", "triton"):
        model.zero_grad(set_to_none=True)
        loss = oomb.chunked_backward(model, ids, backend=backend, **kw)
        results[backend] = (loss, _grads(model))
    assert rel_err(results["triton"][0], results["torch"][0]) <= TOL
    for n, g in results["torch"][1].items():
        assert rel_err(results["triton"][1][n], g) <= TOL, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_pages_summarise_as_masked_ones_do(dtype):
    """A chunk that ends on a page boundary skips the padding mask (valid None): the same summaries."""
    from oomb.cache.spec import page_key_summary

    tiles = torch.randn(5, 2, 8, 4).to(dtype)
    full = torch.full((5,), 8.0)
    for kind in ("mean", "bounds"):
        assert torch.allclose(page_key_summary(tiles, None, kind), page_key_summary(tiles, full, kind), rtol=1e-6,
                              atol=1e-6), kind
    got = page_key_summary(tiles, None, "bounds")
    assert torch.equal(got[..., 4:8], tiles.float().amin(dim=2)) and torch.equal(got[..., 8:], tiles.float().amax(2))
