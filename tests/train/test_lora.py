"""LoRA in `oomb train`: lora.targets=all-linear as peft reads it, planned as built, and an adapter export
that names its base model by an absolute path, so it loads from any working directory."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_model

from oomb.cli import main
from oomb.engine.sizes import count_parameters
from oomb.train.config.settings import load_config
from oomb.train.data.inputs import model_config
from oomb.train.loop.model import build, lora_target_names
from oomb.train.runfolder.checkpoint import find_checkpoint

peft = pytest.importorskip("peft")

RUN = ["data.seq_len=256", "train.chunk_size=128", "train.page_size=64", "train.device=cpu", "train.lr=0.01",
       "train.warmup_steps=1", "lora.r=4"]
LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_all_linear_adapts_every_linear_but_the_head_and_the_plan_counts_them():
    cfg = load_config(None, ["lora.r=4", "lora.targets=all-linear"])
    model = build(cfg, torch.device("cpu"), torch.float32)
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == LINEARS  # not lm_head
    counted = count_parameters(model_config(cfg), 4, lora_target_names(cfg))
    assert set(counted.lora_modules) == LINEARS  # the plan adapts what the run adapts
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(counted.lora) == trainable
    default = load_config(None, ["lora.r=4"])
    assert lora_target_names(default) == ("q_proj", "k_proj", "v_proj", "o_proj")  # the default, unchanged


def test_adapter_export_names_its_base_by_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_model("llama", vocab_size=300).save_pretrained("models/base")
    assert main(["train", "out_dir=run", "model.path=models/base", "lora.targets=all-linear",
                 "lora.merge_on_export=false", "train.steps=2", *RUN]) == 0
    adapter = json.loads((tmp_path / "run" / "export" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tmp_path.resolve() / "models" / "base")
    assert {name.rsplit(".", 1)[-1] for name in adapter["target_modules"]} == LINEARS
    trained = load_file(find_checkpoint(tmp_path / "run") / "model.safetensors")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)  # the relative path the run was given means nothing here
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "run" / "export")
    state = loaded.state_dict()
    for name, value in trained.items():  # the adapters as trained, on the base the export names
        torch.testing.assert_close(state[name.replace(".lora_B.weight", ".lora_B.default.weight")
                                         .replace(".lora_A.weight", ".lora_A.default.weight")], value)
