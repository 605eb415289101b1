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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_merged_from_a_gathered_state_are_peft_merge_and_unload(dtype):
    """Under torchrun the export merges from the state gathered off the ranks (no whole Parameters to merge in
    place): the base model's state dict peft's merge_and_unload gives, key for key."""
    import copy

    from oomb.surgery.lora import merged_state_dict

    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model("llama").to(dtype), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: a trained adapter has B != 0
            torch.nn.init.normal_(p, std=0.1)
    merged = merged_state_dict(model, dict(model.state_dict()))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(merged[key], tensor, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        merged_state_dict(model, {**model.state_dict(), "base_model.model.lm_head.modules_to_save.default.weight":
                                  torch.zeros(1)})
