"""chunked_eval equals a full-sequence transformers forward: per-token NLL and argmax (fp32, CPU)."""

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import oomb
import oomb.engine.evaluate as evaluate
from oomb.engine import chunked_eval, store_for_model

TOL = 1e-5


def _reference(model, input_ids, labels):
    """Full-sequence forward with the model's own attention; [B, N] NLL (NaN = no target) and argmax hits."""
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.double()  # [B, N, V]
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    valid = targets != -100
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    nll = torch.where(valid, nll, torch.full_like(nll, float("nan")))
    correct = (logits.argmax(-1) == targets) & valid
    return nll, correct


@pytest.mark.parametrize(
    "family,attn", [("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager"), ("gpt_oss", "eager")]
)
def test_equals_full_sequence_forward(family, attn):
    # qwen2: one sliding-window layer (window 37) over 5 chunks; gpt_oss: sinks and a window;
    # 150 tokens = ragged last chunk and page.
    model = tiny_model(family, attn_implementation=attn)
    ids = torch.randint(0, VOCAB, (2, 150))
    labels = ids.clone()
    labels[0, :40] = -100  # a prompt without targets
    labels[1, 100:] = -100
    ref_nll, ref_correct = _reference(model, ids, labels)
    out = chunked_eval(model, ids, labels, chunk_size=32, page_size=16)
    assert out.nll.dtype == torch.float32 and out.nll.shape == (2, 150)
    assert torch.equal(torch.isnan(out.nll), torch.isnan(ref_nll))
    assert torch.equal(out.has_target, ~torch.isnan(ref_nll))
    valid = ~torch.isnan(ref_nll)
    err = (out.nll.double() - ref_nll)[valid].abs().max().item()
    assert err <= TOL, f"max NLL error {err:.2e}"
    assert torch.equal(out.correct, ref_correct)
    assert abs(out.mean_nll() - ref_nll[valid].mean().item()) <= TOL
    store = store_for_model(model)
    assert store.num_used_pages == 0 and store.num_tokens == 0
    assert model.config._attn_implementation == attn  # restored


def test_entropy_only_when_asked_and_equal_to_the_full_sequence_softmax_s():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 150))
    labels = ids.clone()
    labels[0, :40] = -100
    assert chunked_eval(model, ids, labels, chunk_size=32, page_size=16).entropy is None
    out = chunked_eval(model, ids, labels, chunk_size=32, page_size=16, entropy=True)
    with torch.no_grad():
        log_p = torch.log_softmax(model.eval()(input_ids=ids).logits.double(), dim=-1)
    want = -(log_p.exp() * log_p).sum(-1)
    valid = out.has_target
    assert torch.isnan(out.entropy[~valid]).all() and valid.sum() == 110  # positions 39..148 have a target
    assert (out.entropy.double() - want)[valid].abs().max() <= 1e-5


def test_an_evaluation_allocates_no_gradient_pages_but_reuses_a_training_step_s_store():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 150))
    alone = chunked_eval(model, ids, chunk_size=32, page_size=16)
    store = store_for_model(model)
    assert not store.spec.gradients and store.layer(0).dk.numel() == 0  # K and V alone: half the pages' bytes
    # a training step then gets a store with gradient pages, and its gradients are a fresh model's
    fresh = tiny_model("llama")
    oomb.chunked_backward(fresh, ids, chunk_size=32, page_size=16)
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    trained = store_for_model(model)
    assert trained.spec.gradients and trained is not store
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    # an evaluation after it (a validation between steps) reuses that store: nothing reallocated
    after = chunked_eval(model, ids, chunk_size=32, page_size=16)
    assert store_for_model(model) is trained
    assert torch.equal(after.nll.isnan(), alone.nll.isnan())
    valid = ~alone.nll.isnan()
    assert torch.equal(after.nll[valid], alone.nll[valid])


def test_default_labels_and_model_mode_restored():
    model = tiny_model("llama")
    model.train()
    ids = torch.randint(0, VOCAB, (1, 70))
    ref_nll, _ = _reference(model.eval(), ids, ids)
    model.train()
    out = chunked_eval(model, ids, chunk_size=64, page_size=16)
    assert model.training
    assert torch.isnan(out.nll[0, -1]) and not torch.isnan(out.nll[0, :-1]).any()
    assert (out.nll[0, :-1].double() - ref_nll[0, :-1]).abs().max() <= TOL


def test_head_blocks_merge_exactly(monkeypatch):
    # Small row and vocabulary blocks, so the online log-sum-exp and argmax cross block edges.
    monkeypatch.setattr(evaluate, "_ROW_BLOCK", 7)
    monkeypatch.setattr(evaluate, "_VOCAB_BLOCK", 10)
    hidden = torch.randn(30, 16, dtype=torch.float64)
    weight = torch.randn(53, 16, dtype=torch.float64)
    bias = torch.randn(53, dtype=torch.float64)
    targets = torch.randint(0, 53, (30,))
    logits = hidden @ weight.T + bias
    targets[:10] = logits[:10].argmax(-1)  # some rows right, so the argmax check is not vacuous
    nll, correct, entropy = evaluate.head_nll_and_argmax(hidden, weight, bias, targets, entropy=True)
    log_p = torch.log_softmax(logits, -1)
    ref = -log_p.gather(1, targets[:, None]).squeeze(1)
    assert (nll.double() - ref).abs().max() <= 1e-6
    assert (entropy.double() - -(log_p.exp() * log_p).sum(-1)).abs().max() <= 1e-6  # TRL's entropy
    assert torch.equal(correct, logits.argmax(-1) == targets)
    assert correct[:10].all()


def test_argmax_ties_take_the_first_maximum(monkeypatch):
    monkeypatch.setattr(evaluate, "_VOCAB_BLOCK", 4)
    hidden = torch.ones(1, 2)
    weight = torch.zeros(10, 2)  # every logit equal: argmax is id 0, in the first block
    _, correct = evaluate.head_nll_and_argmax(hidden, weight, None, torch.tensor([0]))
    assert correct.item()
    _, correct = evaluate.head_nll_and_argmax(hidden, weight, None, torch.tensor([5]))
    assert not correct.item()


def test_refuses_bad_input_before_work():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="multiple of page_size"):
        chunked_eval(model, torch.zeros(1, 8, dtype=torch.long), chunk_size=24, page_size=16)
    with pytest.raises(ValueError, match="labels must have the shape"):
        chunked_eval(model, torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long))


def test_eval_with_documents_and_pages_matches_training_loss():
    # chunked_eval with doc_ids and a page budget scores the same loss chunked_backward trains on.
    import oomb
    from oomb.sparse import PageSelection

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 200))
    doc_ids = torch.zeros_like(ids)
    doc_ids[:, 90:] = 1
    kw = dict(chunk_size=32, page_size=8, doc_ids=doc_ids, selection=PageSelection(page_budget=4, block=16))
    loss = oomb.chunked_backward(model, ids, **kw)
    result = chunked_eval(model, ids, **kw)
    assert abs(result.mean_nll() - loss.item()) <= 1e-5 * loss.item()
