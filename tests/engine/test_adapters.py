"""LoRA as a run adds it and as the plan counts it (oomb.surgery.adapters): all-linear covers fused experts."""

import peft
import torch
from helpers import rel_err
from tiny_models import VOCAB, tiny_config, tiny_model

import oomb
from oomb.engine.sizes import count_parameters
from oomb.surgery.adapters import ALL_LINEAR, expert_weights, lora_config


def test_fused_experts_are_found_and_plain_models_have_none():
    assert expert_weights(tiny_model("gpt_oss")) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert expert_weights(tiny_model("llama")) == []


def test_lora_on_every_linear_map_of_gpt_oss_trains_as_peft_s_own_step():
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_model("gpt_oss"), lora_config(tiny_model("gpt_oss"), 4, 8, ALL_LINEAR))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in trained) and any("q_proj" in n for n in trained)
    with torch.no_grad():  # B starts at zero: move it so the adapters' paths matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids = torch.randint(0, VOCAB, (1, 100))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16)
    assert rel_err(loss, out.loss) <= 1e-5
    assert {n for n, p in model.named_parameters() if p.grad is not None} == ref.keys() == trained
    for n, p in model.named_parameters():
        if n in ref:
            assert rel_err(p.grad, ref[n]) <= 1e-5, n


def test_the_plan_counts_the_adapters_peft_adds():
    for family, targets in (("gpt_oss", ALL_LINEAR), ("llama", ALL_LINEAR), ("llama", ["q_proj", "v_proj"])):
        wrapped = peft.get_peft_model(tiny_model(family), lora_config(tiny_model(family), 8, 16, targets))
        added = sorted(p.numel() for n, p in wrapped.named_parameters() if "lora_" in n)
        names = (ALL_LINEAR,) if targets == ALL_LINEAR else tuple(targets)
        assert sorted(count_parameters(tiny_config(family), 8, names).lora) == added, (family, targets)
