"""chunked_backward equals full-sequence training: loss and every parameter gradient (fp32, CPU)."""

import pytest
import torch
from helpers import rel_err
from tiny_models import FAMILIES, VOCAB, tiny_model

import oomb
from oomb.engine import store_for_model

TOL = 1e-5


def _full_sequence_grads(model, input_ids, labels):
    """The reference: one forward over the whole sequence with eager attention, one backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_training(model, input_ids, labels=None, **kw):
    ref_loss, ref_grads = _full_sequence_grads(model, input_ids, input_ids if labels is None else labels)
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, input_ids, labels, **kw)
    assert loss.requires_grad is False and loss.dim() == 0
    assert rel_err(loss, ref_loss) <= TOL, f"loss {loss.item()} vs {ref_loss.item()}"
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    errors = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{worst}: relative gradient error {errors[worst]:.2e}"
    store = store_for_model(model)
    assert store.num_used_pages == 0 and store.num_tokens == 0  # the pool is empty after the step
    assert model.config._attn_implementation == "eager"  # restored


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_equals_full_sequence(family):
    # 150 tokens: 5 chunks of 32 with a ragged last chunk and a ragged last page (page 16).
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 150))
    _assert_same_training(model, ids, chunk_size=32, page_size=16)


@pytest.mark.parametrize(
    "seq_len,chunk,page,batch",
    [
        (128, 32, 16, 1),  # lengths that are multiples of the chunk and the page
        (97, 16, 16, 1),  # chunk of one page, ragged
        (200, 128, 8, 2),  # chunk of many pages, ragged last chunk, batch 2
        (40, 64, 16, 1),  # one chunk only (stage 1 is empty)
        (2, 16, 16, 1),  # the shortest sequence
    ],
)
def test_lengths_chunks_and_pages(seq_len, chunk, page, batch):
    model = tiny_model("qwen2")  # one sliding-window layer, q/k/v biases
    ids = torch.randint(0, VOCAB, (batch, seq_len))
    _assert_same_training(model, ids, chunk_size=chunk, page_size=page)


def test_labels_with_ignored_positions():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 90))
    labels = torch.randint(0, VOCAB, (2, 90))
    labels[:, :50] = -100  # prompt positions carry no loss
    labels[1, 70:] = -100
    _assert_same_training(model, ids, labels, chunk_size=32, page_size=8)


@pytest.mark.parametrize("recompute", ["chunk", "layer"])
def test_on_chunk_tells_each_chunk_s_start_in_step_order(recompute):
    # 3 chunks (the last ragged): stage 1 fills all but the last (recompute=layer: all, keeping each layer's input),
    # stage 2 runs them newest first; each call comes before its chunk's work, so it sees the store without it.
    model = tiny_model("llama")
    store_pages = []

    def seen(stage, i, n):
        calls.append((stage, i, n))
        store_pages.append(store_for_model(model).num_tokens)

    calls = []
    oomb.chunked_backward(model, torch.randint(0, VOCAB, (1, 40)), chunk_size=16, page_size=4, recompute=recompute,
                          on_chunk=seen)
    filled = 3 if recompute == "layer" else 2
    assert calls == [("fill", i, filled) for i in range(1, filled + 1)] + [("backward", i, 3) for i in (1, 2, 3)]
    assert store_pages[:filled] == [0, 16, 32][:filled]  # before each fill chunk's pages were added


def test_gradients_accumulate_like_backward():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 70))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    for n, p in model.named_parameters():
        assert rel_err(p.grad, 2 * once[n]) <= 1e-6, n


def test_sliding_window_reaches_the_attention():
    # The window must change the result; if oomb ignored it the two models would agree.
    ids = torch.randint(0, VOCAB, (1, 120))
    windowed = tiny_model("mistral")
    loss_w = oomb.chunked_backward(windowed, ids, chunk_size=32, page_size=16)
    unwindowed = tiny_model("mistral", sliding_window=None)  # same weights (same seed), no window
    loss_u = oomb.chunked_backward(unwindowed, ids, chunk_size=32, page_size=16)
    assert abs(loss_w.item() - loss_u.item()) > 1e-4


def test_frozen_parameters_get_no_gradient():
    model = tiny_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_("layers.1" in name)
    ids = torch.randint(0, VOCAB, (1, 64))
    oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    for name, p in model.named_parameters():
        assert (p.grad is not None) == ("layers.1" in name), name


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_layer_checkpointing_inside_chunks_changes_nothing(family):
    # transformers' own gradient checkpointing re-runs each layer (and its paged attention,
    # which rewrites the same K/V) during backward: less activation memory, same gradients.
    model = tiny_model(family)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, VOCAB, (2, 150))
    _assert_same_training(model, ids, chunk_size=32, page_size=16)


@pytest.mark.parametrize("family", ["qwen2", "gpt_oss"])
def test_triton_backend_equals_full_sequence(family):
    # On CPU the Triton kernels run in the interpreter (fp32): the same bound as the torch path.
    pytest.importorskip("triton")
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 83))  # ragged last chunk and page; qwen2/gpt_oss have a window
    _assert_same_training(model, ids, chunk_size=32, page_size=16, backend="triton")


def test_lora_through_peft_equals_full_sequence():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_model("qwen3"),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False),  # nonzero B, so every adapter gets a gradient
    )
    ids = torch.randint(0, VOCAB, (1, 100))
    ref_loss, ref_grads = _full_sequence_grads(model, ids, ids)
    assert ref_grads and all("lora_" in n for n in ref_grads)  # only adapters train
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    assert rel_err(loss, ref_loss) <= TOL
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    assert max(rel_err(grads[n], ref_grads[n]) for n in grads) <= TOL


def test_answer_only_labels_run_the_head_on_their_rows_only(monkeypatch):
    # A passkey-style loss: two answer positions in 150 tokens. The LM head must see only rows with a
    # target (one ignored row for a chunk without any), and training must still equal the full sequence.
    from oomb.engine import step as step_module

    seen = []
    real = step_module.linear_cross_entropy_sum

    def recording(hidden, weight, bias, targets, **kw):
        seen.append(targets.clone())
        return real(hidden, weight, bias, targets, **kw)

    monkeypatch.setattr(step_module, "linear_cross_entropy_sum", recording)
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 150))
    labels = torch.full_like(ids, -100)
    labels[0, 120] = ids[0, 120]
    labels[1, 40] = ids[1, 40]
    _assert_same_training(model, ids, labels, chunk_size=32, page_size=16)
    # 5 chunks, newest first: [128, 150) none, [96, 128) one (row 0's position 119), [64, 96) none,
    # [32, 64) one (row 1's position 39), [0, 32) none
    assert [t.tolist() for t in seen] == [[-100], [ids[0, 120].item()], [-100], [ids[1, 40].item()], [-100]]


def test_target_rows():
    from oomb.engine.prepare import chunk_target_counts
    from oomb.engine.step import target_rows

    targets = torch.tensor([[-100, 5, -100, -100, -100, 7], [-100, -100, -100, -100, 3, -100]])
    assert chunk_target_counts(targets, 4) == [1, 2]  # the last chunk is [4, 6): padded
    flat = targets[:, :4].reshape(-1)
    assert target_rows(flat, 1).tolist() == [1]
    assert target_rows(torch.full((6,), -100), 0).tolist() == [0]  # no target: one ignored row
    assert target_rows(torch.tensor([1, -100, 2, 3]), 3) is None  # most rows have one: all rows
