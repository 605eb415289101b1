"""Tensor parallel on 2 CPU ranks (gloo, torchrun): the gradients, losses and checkpoints of one process.

The engine-level test runs tests/distributed/tp_gradients.py under torchrun: per case (model family x
dense / page-sparse / packed documents / offload / layer checkpointing) both ranks compute one process's
gradients and the same step with the model's heads split over the 2 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_close_rel
from launch import (
    assert_export_holds_the_trained_weights,
    assert_resumes_exactly,
    assert_same_losses,
    torchrun,
)
from planning import plan_of
from safetensors.torch import load_file
from tp_gradients import CASES

from oomb.cli import main

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def gradients(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "grads.pt"
    torchrun(str(HERE / "tp_gradients.py"), str(out))
    return [torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)]


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_gradients_equal_one_process(gradients, case):
    for rank, results in enumerate(gradients):
        got = results[case]
        assert got["ref_kv_heads"] == 2 and got["kv_heads"] == 1  # each rank's store holds half the KV heads
        assert float(got["loss"]) == pytest.approx(float(got["ref_loss"]), rel=1e-6)
        assert got["tp"].keys() == got["ref"].keys()
        for name, ref in got["ref"].items():
            assert ref.abs().max() > 0, name  # every parameter takes part
            assert_close_rel(got["tp"][name], ref, 1e-5, f"rank {rank} {case} {name}")
        assert float(got["norm"]) == pytest.approx(float(got["ref_norm"]), rel=1e-5)  # split, replicated, biases
    for name, g in gradients[0][case]["tp"].items():  # replicated parameters: the same update on both ranks
        assert torch.equal(g, gradients[1][case]["tp"][name]), name


def test_two_all_reduces_per_layer_in_each_forward_and_backward(gradients):
    """3 chunks: 5 forwards (2 fill, 3 recompute) and 3 backwards of 2 layers; per layer, one all-reduce
    after attention and one after the MLP in a forward, and one for each of their inputs in a backward."""
    layers, forwards, backwards = 2, 5, 3
    assert gradients[0]["llama-dense"]["all_reduces"] == layers * 2 * (forwards + backwards)
    assert gradients[0]["gpt_oss-dense"]["all_reduces"] == layers * 1 * (forwards + backwards)  # experts replicated


def test_sparse_cases_attend_fewer_pages_than_dense(gradients):
    """The page budget is in effect (else the sparse cases would test dense attention again)."""
    results = gradients[0]
    dense = float(results["llama-dense"]["ref_loss"])
    for case in ("llama-sparse", "llama-sparse-sinks-local", "llama-sparse-per-head", "llama-offload-sparse"):
        assert abs(float(results[case]["ref_loss"]) - dense) > 1e-5, case


# --- oomb train with train.tensor_parallel=2 --------------------------------------------------

STEPS = 4
RUN = ["data.seq_len=512", "train.chunk_size=128", "train.page_size=64", "train.lr=0.01", "train.warmup_steps=1",
       "train.device=cpu", f"train.steps={STEPS}", "train.grad_accum=2", "train.save_every=2", "train.keep_last=0",
       "train.page_budget=3", "train.select_block=64",  # page-sparse: the gathered page scores pick the pages
       "train.offload=true"]  # each rank's pages (its KV heads) in host memory


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(2-rank tensor parallel run, 1-process run) of the same 4 steps, checkpoints at steps 2 and 4, an export."""
    root = tmp_path_factory.mktemp("tp-train")
    torchrun("-m", "oomb.cli", "train", *RUN, "train.tensor_parallel=2", f"out_dir={root / 'two'}")
    assert main(["train", *RUN, f"out_dir={root / 'one'}"]) == 0
    return root / "two", root / "one"


def test_tensor_parallel_training_matches_one_process(runs):
    two, one = runs
    got = assert_same_losses(two, one, STEPS)
    assert got[STEPS] < got[1] - 0.1  # it trains
    a, b = load_file(two / "export" / "model.safetensors"), load_file(one / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:  # full tensors, not one rank's shard; AdamW turns fp32 rounding into ~1e-6 relative
        assert_close_rel(a[name], b[name], 1e-5, name)


def test_tensor_parallel_checkpoint_resumes_on_two_ranks(runs, tmp_path):
    assert_resumes_exactly(runs[0], tmp_path, STEPS, format="dcp-tp", world_size=2, tensor_parallel=2)


def test_tensor_parallel_export_loads_in_transformers_with_the_trained_weights(runs, tmp_path):
    assert_export_holds_the_trained_weights(runs[0], tmp_path, STEPS)


def test_one_process_refuses_a_tensor_parallel_checkpoint(runs, capsys):
    two, _ = runs
    assert main(["train", f"resume={two}"]) != 0
    assert "torchrun --nproc_per_node 2" in capsys.readouterr().out


# --- refusals ---------------------------------------------------------------------------------


def test_a_degree_that_does_not_divide_the_kv_heads_is_refused():
    from transformers import LlamaConfig

    from oomb.engine import TensorParallelError
    from oomb.surgery.tensor_parallel import check_tensor_parallel

    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192)
    check_tensor_parallel(config, 3)
    with pytest.raises(TensorParallelError, match=r"does not divide the model's 3 KV heads.*one of \[1, 3\]"):
        check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="does not divide the 3 KV heads"):
        plan_of(config, seq_len=1024, tensor_parallel=2)


def test_tensor_parallel_without_torchrun_or_with_other_settings_is_refused(monkeypatch, capsys):
    from oomb.train.config.settings import ConfigError, load_config
    from oomb.train.loop import distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "train.tensor_parallel=2", "train.device=cpu", "out_dir=/nonexistent/never"]) != 0
    assert "torchrun --nproc_per_node 2" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    for overrides, message in ((["train.tensor_parallel=3"], "train.tensor_parallel=3 does not divide the 4 ranks"),
                               (["train.tensor_parallel=4", "lora.r=8"], "LoRA runs data parallel under torchrun"),
                               (["lora.r=8", "model.quantize=nf4"], "FSDP2 cannot shard bitsandbytes' packed 4-bit"),
                               (["train.tensor_parallel=4", "train.optimizer=adamw8bit"], "only adamw")):
        with pytest.raises(ConfigError, match=message):  # before any process group starts
            distributed.setup(load_config(None, ["train.device=cpu", *overrides]))


def test_a_model_whose_kv_heads_the_ranks_cannot_split_is_refused_under_torchrun(tmp_path):
    from tiny_models import tiny_model

    folder = tmp_path / "model"
    tiny_model("llama", num_key_value_heads=1).save_pretrained(folder)  # one KV head: cannot split over 2
    proc = torchrun("-m", "oomb.cli", "train", "train.tensor_parallel=2", "train.device=cpu", f"model.path={folder}",
                    "data.seq_len=256", "train.chunk_size=128", f"out_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode != 0
    assert "train.tensor_parallel=2: tensor parallel degree 2 does not divide the model's 1 KV heads" in proc.stdout
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_plan_divides_the_page_memory_and_the_split_weights_by_the_tensor_parallel_degree():
    """One rank's plan: half the store, and the shards of the split weights (and their AdamW states)."""
    from oomb.train.config.settings import load_config
    from oomb.train.data.inputs import model_config

    config = model_config(load_config(None, ["model.preset=qwen2.5-7b"]))
    one = {i.name: i.gpu_bytes for i in plan_of(config, seq_len=1 << 17).items}
    two = {i.name: i.gpu_bytes for i in plan_of(config, seq_len=1 << 17, tensor_parallel=2).items}
    assert one["paged store"] > 10 * 2**30
    assert abs(two["paged store"] * 2 - one["paged store"]) <= one["paged store"] * 1e-3  # page table not split
    assert one["parameters"] / 2 < two["parameters"] < one["parameters"] * 0.7  # embeddings and head replicated
    assert two["optimizer states"] / one["optimizer states"] == pytest.approx(two["parameters"] / one["parameters"])
    assert two["saved activations"] == one["saved activations"]  # planned unsplit


@pytest.mark.parametrize("case", ["llama-dense", "qwen2-dense", "qwen3-sparse", "gpt_oss-dense"])
def test_the_planner_splits_the_tensors_apply_tensor_parallel_splits(gradients, case):
    from tiny_models import tiny_config

    from oomb.planning.plan import count_parameters

    got = gradients[0][case]
    counts = count_parameters(tiny_config(CASES[case][0]))
    planned = [name for name, split in zip(got["ref"], counts.split, strict=True) if split]
    assert planned == got["split"] and planned


# --- data parallel x tensor parallel: 4 ranks, 2 groups of 2 ----------------------------------


@pytest.fixture(scope="module")
def runs_2d(tmp_path_factory):
    """(4-rank run: FSDP2 over 2 groups x heads split over 2 ranks, 1-process run with both groups' sequences)."""
    root = tmp_path_factory.mktemp("dp-tp")
    run = [arg for arg in RUN if not arg.startswith("train.offload")]
    torchrun("-m", "oomb.cli", "train", *run, "train.tensor_parallel=2", f"out_dir={root / 'four'}", ranks=4)
    assert main(["train", *run, "train.batch_size=2", f"out_dir={root / 'one'}"]) == 0
    return root / "four", root / "one"


def test_data_parallel_over_tensor_parallel_groups_matches_one_process(runs_2d):
    four, one = runs_2d
    assert_same_losses(four, one, STEPS)
    grad_norms = [json.loads(line)["grad_norm"] for line in (four / "metrics.jsonl").read_text().splitlines()]
    expected_norms = [json.loads(line)["grad_norm"] for line in (one / "metrics.jsonl").read_text().splitlines()]
    assert grad_norms == pytest.approx(expected_norms, rel=1e-5)  # the clipping norm over 2-D shards
    a, b = load_file(four / "export" / "model.safetensors"), load_file(one / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert_close_rel(a[name], b[name], 1e-5, name)


def test_data_parallel_over_tensor_parallel_groups_resumes_on_four_ranks(runs_2d, tmp_path):
    assert_resumes_exactly(runs_2d[0], tmp_path, STEPS, ranks=4, format="dcp-tp", world_size=4, tensor_parallel=2)


def test_data_parallel_over_tensor_parallel_groups_refuses_qwen3_norms(tmp_path):
    """Qwen3's q/k norms need a gradient hook that FSDP2's parameter swap would lose: refused, clearly."""
    from tiny_models import tiny_model

    folder = tmp_path / "model"
    tiny_model("qwen3", vocab_size=300).save_pretrained(folder)
    proc = torchrun("-m", "oomb.cli", "train", "train.tensor_parallel=2", "train.device=cpu", f"model.path={folder}",
                    "data.seq_len=256", "train.chunk_size=128", f"out_dir={tmp_path / 'run'}", check=False, ranks=4)
    assert proc.returncode != 0
    assert ("with data parallel over 2 groups: not supported for this model (model.layers.0.self_attn.q_norm.weight"
            in proc.stdout)
    # the model's 2 KV heads do not split 4 ways: one tensor parallel group of every rank is no way out
    assert "use train.tensor_parallel=1" in proc.stdout and "tensor_parallel=4" not in proc.stdout
    assert not (tmp_path / "run").exists()  # refused before the model is built or the run folder made
