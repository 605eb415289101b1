"""A NaN/inf loss or gradient is caught before the optimizer step and located (step, chunk, layer,
parameter); train.on_nonfinite=stop leaves the checkpoints alone, skip drops the update and logs it."""

import json

import pytest
import torch
from faultrun import RUN, STEPS, assert_resumes_exactly, losses, run_process
from safetensors.torch import load_file

from oomb.cli import main
from oomb.engine import StepOptions
from oomb.engine.diagnose import locate_nonfinite
from oomb.train.config.presets import build_model
from oomb.train.loop.faults import EXIT_NONFINITE
from oomb.train.runfolder.checkpoint import find_checkpoint, list_checkpoints

OPTIONS = StepOptions(chunk_size=128, page_size=64)
WHERE = "first non-finite value: the output of decoder layer 0 (model.layers.0) in chunk 1 of 2 (tokens 256..511)"


def test_nonfinite_stop_names_step_chunk_layer_and_parameter(tmp_path, straight):
    run = tmp_path / "run"
    proc = run_process("nan", f"out_dir={run}", "train.save_every=2", *RUN, fault_step=5)
    assert proc.returncode == EXIT_NONFINITE, (proc.stdout, proc.stderr)
    out = " ".join(proc.stdout.split())
    assert "non-finite loss in step 5" in out and WHERE in out
    assert "first parameter with a non-finite gradient: model.embed_tokens.weight" in out
    assert "no checkpoint was written or changed" in out and f"oomb train resume={run} train.lr=0.005" in out
    assert [c.name for c in list_checkpoints(run)] == ["step-00000002", "step-00000004"]
    assert find_checkpoint(run).name == "step-00000004"
    assert sorted(losses(run)) == [1, 2, 3, 4]
    assert_resumes_exactly(run, straight)  # the fault was in the data path of that run only


def test_nonfinite_skip_makes_no_update_and_logs_it(tmp_path, straight):
    run = tmp_path / "run"
    proc = run_process("nan", f"out_dir={run}", "train.save_every=1", "train.on_nonfinite=skip", *RUN,
                       fault_step=4)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "step skipped (no update)" in " ".join(proc.stderr.split())
    assert "non-finite steps skipped: 1;" in " ".join(proc.stdout.split())
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert records[4]["skipped"] == "non-finite" and records[4]["loss"] is None and records[4]["skipped_steps"] == 1
    assert WHERE.removeprefix("first non-finite value: ") == records[4]["nonfinite_at"]
    assert records[4]["nonfinite_grad"] == "model.embed_tokens.weight"
    expected = losses(straight)
    assert [records[s]["loss"] for s in (1, 2, 3)] == pytest.approx([expected[s] for s in (1, 2, 3)], rel=1e-6)
    ckpts = run / "checkpoints"
    before = load_file(ckpts / "step-00000003" / "model.safetensors")
    after = load_file(ckpts / "step-00000004" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)  # the skipped step changed no weight
    skipped_run = losses(run)
    # The checkpoint after the skip loads, and resuming from it repeats the skip run's own later steps.
    assert main(["train", f"resume={ckpts / 'step-00000004'}"]) == 0
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert [resumed[s] for s in (5, 6)] == pytest.approx([skipped_run[s] for s in (5, 6)], rel=1e-6)


def test_diagnosis_finds_the_first_layer_or_reports_a_finite_forward():
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 63, (1, 384))  # token 63 only where placed below
    assert locate_nonfinite(model, ids, options=OPTIONS) is None

    def poison(module, args, kwargs, output):
        if int(kwargs["position_ids"][0, 0]) == 256:
            output = output.clone()
            output[:, 3] = float("nan")
        return output

    handle = model.model.layers[1].register_forward_hook(poison, with_kwargs=True)
    site = locate_nonfinite(model, ids, options=OPTIONS)
    handle.remove()
    assert (site.chunk, site.num_chunks, site.start, site.end, site.layer, site.module) == (2, 3, 256, 384, 1,
                                                                                         "model.layers.1")
    with torch.no_grad():
        model.model.embed_tokens.weight[63] = float("inf")
    ids[0, 150] = 63
    site = locate_nonfinite(model, ids, options=OPTIONS)
    # The tiny preset ties the LM head to the embedding: chunk 0 never reads token 63, but its logits are inf.
    assert (site.chunk, site.layer, site.module) == (0, None, "loss (LM head and cross-entropy)")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone().nan_to_num(posinf=0.0))
    site = locate_nonfinite(model, ids, options=OPTIONS)
    assert (site.chunk, site.layer, site.module) == (1, None, "model.embed_tokens")


def test_a_stop_before_any_checkpoint_offers_a_command_that_runs(tmp_path, capsys):
    # Non-finite in step 1, no checkpoint yet: `resume=` starts the run again from step 1 with its config and
    # the lower learning rate the advice names, in the same folder.
    run = tmp_path / "run"
    proc = run_process("nan", f"out_dir={run}", *RUN, fault_step=1)
    assert proc.returncode == EXIT_NONFINITE, (proc.stdout, proc.stderr)
    out = " ".join(proc.stdout.split())
    advice = f"oomb train resume={run} train.lr=0.005"
    assert advice in out, out
    assert main([*advice.split()[1:]]) == 0
    assert sorted(losses(run)) == list(range(1, STEPS + 1))


def test_a_model_that_starts_non_finite_is_named_not_blamed_on_the_learning_rate(tmp_path, capsys):
    from tiny_models import tiny_model

    model = tiny_model("llama", vocab_size=300)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "model")
    run = tmp_path / "run"
    assert main(["train", f"model.path={tmp_path / 'model'}", f"out_dir={run}", *RUN]) == EXIT_NONFINITE
    out = " ".join(capsys.readouterr().out.split())
    assert "The weight model.layers.1.mlp.down_proj.weight is non-finite" in out
    assert "holds non-finite values; repair or replace it" in out and "Lower train.lr" not in out


def test_a_nan_that_arises_in_the_backward_pass_is_placed_at_its_layer():
    from oomb.train.loop.faults import nonfinite_grads

    model = build_model("tiny", dtype=torch.float32, device="cpu")
    layers = model.model.layers
    assert len(layers) == 2
    ids = torch.randint(0, 63, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    assert nonfinite_grads(model) == (None, None)
    model.zero_grad(set_to_none=True)

    def poison(module, grad_output):  # the gradient layer 0 gets from above goes NaN
        return (grad_output[0].clone().fill_(float("nan")),)

    handle = layers[0].register_full_backward_pre_hook(poison)
    model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    first, where = nonfinite_grads(model)
    assert first == "model.embed_tokens.weight"  # below it all, first in the model's order
    # Layer 1 (above) kept finite gradients; layer 0's own went NaN with what it got from its output's gradient.
    assert where.startswith("non-finite gradients in 1 of the 2 decoder layers with gradients, the highest layer 0 ")
    assert "layer 0's backward or in the input gradient layer 1 passed down" in where
    model.zero_grad(set_to_none=True)
    handle = layers[1].register_full_backward_pre_hook(poison)  # the last layer gets NaN from above it
    model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    assert "the highest layer 1 " in nonfinite_grads(model)[1]
    assert "or in what runs after the last layer (final norm, LM head, loss)" in nonfinite_grads(model)[1]


def test_a_backward_nan_from_a_zero_embedding_first_token_is_named(tmp_path, capsys):
    # A deep Gemma-3 whose embedding row 0 is zero (its padding row) but whose config no longer names 0 as its
    # padding id, so the passkey task begins every sequence with id 0: the forward is finite, the backward
    # overflows through the RMSNorms (docs/failures.md); the stop names the token, not the learning rate.
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from oomb.train.data.sources import PasskeyBatch
    from oomb.train.loop.faults import zero_embedding_starts

    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=32, max_position_embeddings=1024, rms_norm_eps=1e-6, pad_token_id=0,
                              bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert bool((model.get_input_embeddings().weight[0] == 0).all())
    ids = torch.tensor([[0, 5, 6, 0, 7], [5, 0, 6, 7, 8]])
    docs = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])
    assert zero_embedding_starts(model, [PasskeyBatch(ids, ids, torch.zeros(2, 1))]).startswith(
        "token id 0 begins a sequence or a document")
    assert zero_embedding_starts(model, [PasskeyBatch(ids[1:], ids[1:], torch.zeros(1, 1))]) is None  # 0 not first
    assert zero_embedding_starts(model, [PasskeyBatch(ids[1:], ids[1:], torch.zeros(1, 1), docs[:1])]) is None
    second_doc = torch.tensor([[0, 1, 1, 1, 1]])  # the 0 at position 1 begins a document
    assert zero_embedding_starts(model, [PasskeyBatch(ids[1:], ids[1:], torch.zeros(1, 1), second_doc)]) is not None
    padding = torch.tensor([[5, 6, 7, -100, -100]])  # ... a document without targets (trailing padding): no gradient
    assert zero_embedding_starts(model, [PasskeyBatch(torch.tensor([[5, 6, 7, 0, 0]]), padding, torch.zeros(1, 1),
                                                      torch.tensor([[0, 0, 0, 1, 1]]))]) is None
    model.config.pad_token_id = None
    model.save_pretrained(tmp_path / "model")
    run = tmp_path / "run"
    assert main(["train", f"model.path={tmp_path / 'model'}", f"out_dir={run}", *RUN]) == EXIT_NONFINITE
    out = " ".join(capsys.readouterr().out.split())
    assert "the first non-finite value arose in the backward pass" in out
    assert "likely cause: token id 0 begins a sequence or a document in this step" in out
    assert "Begin the sequences with the tokenizer's BOS" in out and "Lower train.lr" not in out
