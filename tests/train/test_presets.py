"""Built-in architectures: each builds (on the meta device, no memory) with its published size."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from oomb.train.config.presets import preset_config, preset_names

# Parameter counts in billions (bf16 weights, no MXFP4), as the published configs give them.
PUBLISHED_B = {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-7b": 7.62, "llama-3-8b": 8.03,
               "qwen3-8b": 8.19, "gpt-oss-20b": 20.91, "gemma-3-12b": 11.77, "granite-3.3-8b": 8.17}


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_preset_has_the_published_size(name):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name), dtype=torch.bfloat16)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert billions == pytest.approx(PUBLISHED_B[name], abs=0.01)


def test_every_preset_is_listed():
    assert set(PUBLISHED_B) | {"tiny"} == set(preset_names())


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'qwen9'"):
        preset_config("qwen9")
