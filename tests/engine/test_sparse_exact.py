"""Page-sparse training is exact: chunked sparse steps against full-sequence training under the
equivalent attention mask (the oracle in sparse_oracle.py), loss and every parameter gradient."""

import pytest
import torch
from sparse_oracle import (
    OracleInputs,
    attention_masks,
    check_selection,
    drop_one_page,
    full_sequence_step,
    gradient_errors,
    record_page_lists,
)
from tiny_models import VOCAB, tiny_model

import oomb
from oomb.engine.step import check_model_architecture
from oomb.sparse import PageSelection

TOL = 1e-5  # fp32 on CPU: the chunked and the full run differ only in summation order
CHUNK, PAGE = 32, 8


def _chunked_step(model, ids, labels, selection, doc_ids, **step_kw):
    model.zero_grad(set_to_none=True)
    # The architecture check chunked_backward makes once per architecture in a process, first: its self-test runs
    # chunked steps on the architecture's tiny copy, whose attention calls would join the recording (run alone,
    # without an earlier test having checked the architecture, this file failed on them).
    check_model_architecture(model)
    with record_page_lists() as record:
        loss = oomb.chunked_backward(model, ids, labels, selection=selection, doc_ids=doc_ids, **step_kw)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss, grads, record


def _assert_exact(model, ids, selection, labels=None, doc_ids=None, **step_kw):
    """Run the chunked step and the oracle; assert they agree. Returns (record, masks, oracle inputs)."""
    step_kw = {"chunk_size": CHUNK, "page_size": PAGE, "backend": "torch", **step_kw}
    loss, grads, record = _chunked_step(model, ids, labels, selection, doc_ids, **step_kw)
    masks = attention_masks(record, *ids.shape, doc_ids)
    inputs = OracleInputs(masks, record.windows())
    ref_loss, ref_grads = full_sequence_step(model, ids, labels, inputs)

    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (loss.item(), ref_loss.item())
    errors = gradient_errors(grads, ref_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: relative error {errors[worst]:.2e} (all: {errors})"
    if selection is not None:
        assert check_selection(record, inputs.captured, selection, doc_ids) > 0
    return record, masks, inputs


def _dense_masks(batch, seq_len, windows, doc_ids=None):
    """What dense attention sees: the oracle's masks for a record without page lists."""
    pos = torch.arange(seq_len)
    causal = pos[None, :] <= pos[:, None]
    same_doc = torch.ones(batch, seq_len, seq_len, dtype=torch.bool) if doc_ids is None else (
        doc_ids[:, :, None] == doc_ids[:, None, :])
    return {layer: (causal & same_doc & ((pos[:, None] - pos[None, :]) < (w or seq_len))).unsqueeze(1)
            for layer, w in windows.items()}


def _assert_some_page_left_out(masks, batch, seq_len, windows, doc_ids=None):
    """The case is really sparse: some query does not see a key that dense attention would show it."""
    dense = _dense_masks(batch, seq_len, windows, doc_ids)
    assert any((dense[layer] & ~mask).any() for layer, mask in masks.items())


def _doc_ids(batch, seq_len, starts_per_row):
    doc_ids = torch.zeros(batch, seq_len, dtype=torch.long)
    for row, starts in enumerate(starts_per_row):
        for start in starts:
            doc_ids[row, start:] += 1
    return doc_ids


CASES = {
    # one round shape: batch 2, whole chunks, shared lists, the default (bound) score
    "round": dict(family="llama", batch=2, seq_len=160, selection=PageSelection(page_budget=3, block=16)),
    # one odd shape: a ragged last chunk, one block per chunk, every list option, the mean score
    "odd": dict(family="llama", batch=1, seq_len=147, selection=PageSelection(
        page_budget=5, block=CHUNK, sink_pages=1, local_pages=2, per_head=True, score="mean")),
    # biases, a sliding-window layer, blocks that do not divide the chunk, outputs cached from stage 1
    "qwen2_cached": dict(family="qwen2", batch=2, seq_len=131, step_kw=dict(cache_attention=True),
                         selection=PageSelection(page_budget=4, block=12, sink_pages=2, score="bound")),
    # packed documents (a start mid-page, one mid-block, one on a chunk boundary), offloaded store
    "documents": dict(family="llama", batch=2, seq_len=150, doc_starts=[[45, 70, 128], [19, 100]],
                      step_kw=dict(offload=True), selection=PageSelection(page_budget=2, block=16, local_pages=1)),
    # a cap on the pages a chunk's blocks choose among (train.chunk_pages), with offload and per-head lists
    "chunk_pages": dict(family="llama", batch=2, seq_len=170, step_kw=dict(offload=True), selection=PageSelection(
        page_budget=2, block=8, chunk_pages=3, per_head=True)),
    # GPT-OSS: per-head sinks, alternating sliding and full layers, documents, ragged
    "gpt_oss": dict(family="gpt_oss", batch=2, seq_len=133, doc_starts=[[90], []], selection=PageSelection(
        page_budget=3, block=16, sink_pages=1, local_pages=1, per_head=True, score="mean")),
    # GPT-OSS with windows shorter than a chunk: its sliding layers keep one page of each chunk (the rest given back
    # in stage 2), beside the sparse full layers, outputs cached from stage 1
    "gpt_oss_short_windows": dict(family="gpt_oss", overrides=dict(sliding_window=9), batch=2, seq_len=133,
                                  step_kw=dict(cache_attention=True),
                                  selection=PageSelection(page_budget=3, block=16, sink_pages=1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sparse_step_equals_full_sequence_under_the_recorded_mask(name):
    case = CASES[name]
    model = tiny_model(case["family"], **case.get("overrides", {}))
    batch, seq_len = case["batch"], case["seq_len"]
    ids = torch.randint(0, VOCAB, (batch, seq_len))
    doc_ids = labels = None
    if "doc_starts" in case:
        doc_ids = _doc_ids(batch, seq_len, case["doc_starts"])
        labels = ids.clone()
        labels[:, 1:][doc_ids[:, 1:] != doc_ids[:, :-1]] = -100  # no target across a document boundary
    record, masks, _ = _assert_exact(model, ids, case["selection"], labels, doc_ids, **case.get("step_kw", {}))
    _assert_some_page_left_out(masks, batch, seq_len, record.windows(), doc_ids)
    views = record.chunk_views()
    for (layer, start), view in views.items():
        calls = record.calls[(layer, start)]
        assert calls[0].stage == ("recompute" if start + view.chunk_len == seq_len else "fill")
        if view.sliding_window is not None:
            assert view.page_select is None  # sliding-window layers read their window densely
    if case["selection"].per_head:
        assert any(v.page_select is not None and v.page_select.shape[1] == 2 for v in views.values())  # H_kv = 2


def test_the_oracle_is_exact_for_dense_steps():
    """Without a page budget the record holds no lists and the oracle's mask is plain causal attention
    (GPT-OSS: sinks and windows): the reference the sparse cases build on."""
    model = tiny_model("gpt_oss")
    ids = torch.randint(0, VOCAB, (2, 101))
    record, masks, _ = _assert_exact(model, ids, None)
    assert all(v.page_select is None for v in record.chunk_views().values())
    dense = _dense_masks(2, 101, record.windows())
    assert all(torch.equal(masks[layer], dense[layer]) for layer in masks)
    assert record.windows() == {0: 29, 1: None}


def test_a_mask_missing_one_page_is_detected():
    """The oracle has teeth: one selected page hidden from one query block of one layer and chunk
    moves the gradients far beyond the tolerance."""
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 160))
    selection = CASES["round"]["selection"]
    loss, grads, record = _chunked_step(model, ids, None, selection, None, chunk_size=CHUNK, page_size=PAGE,
                                        backend="torch")
    masks = attention_masks(record, 2, 160)
    wrong = drop_one_page(masks, record)
    changed = sum(int((m != wrong[layer]).sum()) for layer, m in masks.items())
    assert changed == 16 * PAGE  # one block's queries x one page's keys
    _, ref_grads = full_sequence_step(model, ids, None, OracleInputs(wrong, record.windows()))
    errors = gradient_errors(grads, ref_grads)
    assert max(errors.values()) > 100 * TOL, errors


def test_a_wrong_selection_is_detected():
    """check_selection has teeth: a list that swaps a kept page for a left-out one fails."""
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 160))
    selection = PageSelection(page_budget=3, block=16, sink_pages=1)
    _, _, record = _chunked_step(model, ids, None, selection, None, chunk_size=CHUNK, page_size=PAGE,
                                 backend="torch")
    inputs = OracleInputs(attention_masks(record, 1, 160), record.windows())
    full_sequence_step(model, ids, None, inputs)
    assert check_selection(record, inputs.captured, selection) > 0
    key = max(k for k, v in record.chunk_views().items() if v.page_select is not None)
    view = record.calls[key][0]
    kept = set(view.page_select[0, 0, 0].tolist())
    view.page_select[0, 0, 0, -1] = max(set(range(key[1] // PAGE)) - kept)  # the last kept page -> a left-out one
    view.page_select[0, 0, 0] = view.page_select[0, 0, 0].sort().values
    for call in record.calls[key][1:]:
        call.page_select = view.page_select
    with pytest.raises(AssertionError, match="left out"):
        check_selection(record, inputs.captured, selection)


def test_lists_past_a_chunks_cap_are_detected():
    """check_selection holds a capped selection to its cap: the lists of uncapped blocks (each its own top
    pages) name more pages a chunk than chunk_pages allows, and fail against the capped policy they would
    have needed; the capped step's own lists pass."""
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 160))
    capped = PageSelection(page_budget=2, block=8, chunk_pages=2)
    for policy in (PageSelection(page_budget=2, block=8), capped):
        _, _, record = _chunked_step(model, ids, None, policy, None, chunk_size=CHUNK, page_size=PAGE,
                                     backend="torch")
        inputs = OracleInputs(attention_masks(record, 1, 160), record.windows())
        full_sequence_step(model, ids, None, inputs)
        if policy is capped:
            assert check_selection(record, inputs.captured, capped) > 0
        else:
            with pytest.raises(AssertionError, match="more than 2 pages"):
                check_selection(record, inputs.captured, capped)


def test_triton_interpreter_sparse_step_equals_the_oracle():
    """The Triton kernels (interpreter on CPU, fp32) through the whole sparse step, against the oracle."""
    model = tiny_model("qwen3")  # head_dim 16: whole kernel tiles
    ids = torch.randint(0, VOCAB, (1, 100))
    doc_ids = _doc_ids(1, 100, [[58]])
    selection = PageSelection(page_budget=2, block=16, sink_pages=1)
    record, masks, _ = _assert_exact(model, ids, selection, None, doc_ids, page_size=16, backend="triton")
    _assert_some_page_left_out(masks, 1, 100, record.windows(), doc_ids)
