"""LoRA under torchrun: two CPU ranks (gloo) train the adapters of the tiny preset on their own sequences with FSDP2
and match one process training both ranks' sequences: the same losses, a checkpoint of the adapters alone that
resumes exactly, and the export one process writes (the adapters merged into the base, or the adapter folder)."""

from __future__ import annotations

import json
import pickle

import pytest
from launch import DP_RUN, DP_STEPS, assert_resumes_exactly, assert_same_losses, torchrun, two_ranks_and_one
from safetensors.torch import load_file

STEPS = DP_STEPS
RUN = [*DP_RUN, "lora.r=4", "lora.targets=all-linear"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(2-rank run, 1-process run) of the same 4 LoRA steps, checkpoints at steps 2 and 4, each with its export."""
    return two_ranks_and_one(tmp_path_factory.mktemp("lora-dp"), RUN)


def test_two_ranks_train_the_adapters_like_one_process_and_export_the_same_merged_model(runs):
    two, one = runs
    assert_same_losses(two, one, STEPS)
    a, b = load_file(two / "export" / "model.safetensors"), load_file(one / "export" / "model.safetensors")
    assert a.keys() == b.keys() and not [k for k in a if "lora" in k or "base_layer" in k]  # a plain model
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-5, worst


def test_the_checkpoint_holds_the_adapters_alone_and_resumes_exactly(runs, tmp_path):
    ckpt = runs[0] / "checkpoints" / "step-00000002" / "dcp"
    saved = pickle.loads((ckpt / ".metadata").read_bytes()).state_dict_metadata  # DCP's index (our own files)
    weights = [k for k in saved if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights[:5]
    assert len(weights) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers
    assert_resumes_exactly(runs[0], tmp_path, STEPS, world_size=2, format="dcp-fsdp2")


def test_the_adapter_folder_is_exported_where_merging_is_off(tmp_path):
    out = tmp_path / "adapters"
    keys = [k for k in RUN if not k.startswith(("train.steps=", "train.save_every="))]
    torchrun("-m", "oomb.cli", "train", *keys, "train.steps=1", "train.save_every=0", "lora.merge_on_export=false",
             f"out_dir={out}")
    files = {p.name for p in (out / "export").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    adapters = load_file(out / "export" / "adapter_model.safetensors")
    assert len(adapters) == 2 * 7 * 2 and all("lora_" in k for k in adapters)
    assert json.loads((out / "export" / "adapter_config.json").read_text())["r"] == 4
