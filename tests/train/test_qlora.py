"""QLoRA (model.quantize=nf4) on CPU: the same 4-bit layers from a folder and a preset, the planned bytes as the
model holds them, adapter gradients through chunked_backward as a full-sequence backward gives them, a run that
learns and resumes exactly, and exports that load back into transformers and peft."""

import json
import shutil

import pytest
import torch
from helpers import rel_err
from planning import plan_of
from tiny_models import FAMILIES, tiny_model

import oomb
from oomb.cli import main
from oomb.planning.plan import LoraShape, ModelShape, measure_saved_activations, saved_bytes_per_token
from oomb.surgery.quantize import nf4_weight_bytes, quantized_linear_names
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.data.inputs import model_config
from oomb.train.loop.model import build, lora_target_names
from oomb.train.loop.quantize import bnb_config, check_quantize_runs, quantize_linears
from oomb.train.runfolder.checkpoint import find_checkpoint, load_weights

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

FAST = ["data.seq_len=256", "train.chunk_size=128", "train.page_size=64", "train.device=cpu", "train.lr=0.01",
        "train.warmup_steps=1"]
QLORA = ["model.quantize=nf4", "lora.r=8", "lora.targets=all-linear"]


def _load_4bit(folder, dtype=torch.float32, attention="eager"):
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config(dtype), dtype=dtype,
                                                device_map={"": "cpu"}, attn_implementation=attention)


def _four_bit_state(model) -> dict[str, tuple]:
    """Each 4-bit layer's packed codes and quantization constants, by module name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            qs = module.weight.quant_state
            out[name] = (module.weight.data, qs.absmax, qs.offset, qs.state2.absmax, qs.code, qs.state2.code)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_preset_quantizes_the_layers_and_bytes_transformers_does(tmp_path, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "m")
    loaded = _four_bit_state(_load_4bit(tmp_path / "m"))
    with torch.device("meta"):
        planned = quantized_linear_names(AutoModelForCausalLM.from_config(model.config))
    assert quantize_linears(model, torch.float32) == planned
    ours = _four_bit_state(model)
    assert sorted(ours) == sorted(loaded) == sorted(planned) and "lm_head" not in ours
    for name in ours:
        for a, b in zip(ours[name], loaded[name], strict=True):
            assert torch.equal(a, b), name


def _storage_bytes(model) -> int:
    """Bytes the parameters and the 4-bit layers' quantization constants hold (each storage once)."""
    seen = {}

    def add(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

    for p in model.parameters():
        add(p)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            qs = module.weight.quant_state
            for t in (qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code):
                add(t)
    return sum(seen.values())


@pytest.mark.parametrize("source", ["preset", "folder"])
def test_planned_parameter_bytes_are_what_the_quantized_model_holds(tmp_path, source):
    if source == "folder":
        tiny_model("qwen2").save_pretrained(tmp_path / "m")  # q/k/v biases stay in the model dtype
    where = f"model.path={tmp_path / 'm'}" if source == "folder" else "model.preset=tiny"
    cfg = load_config(None, [where, *QLORA, "train.device=cpu"])
    model = build(cfg, torch.device("cpu"), torch.float32)
    plan = plan_of(model_config(cfg), seq_len=256, chunk_size=128, page_size=64, dtype=torch.float32,
                       device_type="cpu", lora_r=8, lora_targets=lora_target_names(cfg), quantize="nf4")
    params = {i.name: i.host_bytes for i in plan.items}["parameters"]
    assert params == _storage_bytes(model)
    full = plan_of(model_config(cfg), seq_len=256, chunk_size=128, page_size=64, dtype=torch.float32,
                       device_type="cpu", lora_r=8, lora_targets=lora_target_names(cfg))
    assert params < {i.name: i.host_bytes for i in full.items}["parameters"]
    assert nf4_weight_bytes(64 * 64) == 2048 + 64 + 4 + 16 * 4 + 256 * 4 + 4  # codes, absmax, nested, tables


@pytest.mark.parametrize("fused", [False, True], ids=["peft", "fused-lora"])
def test_saved_activations_are_lora_s(fused):
    # bitsandbytes' 4-bit matmul keeps no activation of its own: the plan's LoRA formula holds, fused or not.
    from oomb.surgery.lora import use_fused_lora

    model = tiny_model("llama").to(torch.bfloat16)
    quantize_linears(model, torch.bfloat16)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model.is_loaded_in_4bit = True
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=list(targets))).get_base_model()
    if fused:
        assert use_fused_lora(model)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 96))
    per_layer, per_model = saved_bytes_per_token(ModelShape.from_config(model.config), torch.bfloat16,
                                                 LoraShape(8, targets, torch.float32, fused=fused))
    assert measure_saved_activations(model, ids) == 2 * 96 * (model.config.num_hidden_layers * per_layer + per_model)


def _adapter_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,checkpointing,recompute", [
    ("llama", False, "chunk"), ("qwen2", False, "chunk"), ("qwen3", True, "chunk"), ("gpt_oss", False, "chunk"),
    # one layer rebuilt at a time (oomb train's default on one GPU) through the 4-bit layers
    ("qwen2", False, "layer-host"), ("gpt_oss", False, "layer")])
def test_adapter_gradients_through_chunked_backward_equal_the_full_sequence(tmp_path, family, checkpointing,
                                                                            recompute):
    tiny_model(family).save_pretrained(tmp_path / "m")
    model = peft.get_peft_model(_load_4bit(tmp_path / "m"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))  # B nonzero: every grad counts
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, model.config.vocab_size, (2, 150))
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    ref_grads = _adapter_grads(model)
    assert ref_grads and all("lora_" in n for n in ref_grads)  # only the adapters train
    model.zero_grad(set_to_none=True)
    loss = oomb.chunked_backward(model, ids, chunk_size=32, page_size=16, recompute=recompute)
    grads = _adapter_grads(model)
    assert rel_err(loss, ref.loss.detach()) <= 1e-6
    assert grads.keys() == ref_grads.keys()
    errors = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: relative gradient error {errors[worst]:.2e}"


def test_an_evaluation_pass_leaves_training_gradients_intact():
    # bitsandbytes would move a weight into its CPU inference layout on an eval-mode pass without gradients,
    # through which no gradient flows (oomb.train.loop.quantize.finish_quantized turns that off).
    cfg = load_config(None, [*QLORA, "train.device=cpu"])
    model = build(cfg, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 64, (1, 128))
    model.train()
    oomb.chunked_backward(model, ids, chunk_size=64, page_size=32)
    before = _adapter_grads(model)
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    oomb.chunked_backward(model, ids, chunk_size=64, page_size=32)
    after = _adapter_grads(model)
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)


def test_fused_ops_keep_the_4_bit_projections():
    # liger's modules (their kernels need CUDA: tests/engine/test_gpu_qlora.py runs them) call the same projections.
    from oomb.surgery.fused_ops import liger_available, swap_fused_modules

    if not liger_available():
        pytest.skip("liger-kernel is not installed")
    model = build(load_config(None, QLORA), torch.device("cpu"), torch.float32)
    before = dict(model.named_parameters())
    mlps = {name: (m.gate_proj, m.up_proj, m.down_proj) for name, m in model.named_modules() if name.endswith("mlp")}
    assert swap_fused_modules(model)
    assert dict(model.named_parameters()).keys() == before.keys()
    for name, projections in mlps.items():
        swapped = model.get_submodule(name)
        assert type(swapped).__name__ == "LigerSwiGLUMLP"
        assert (swapped.gate_proj, swapped.up_proj, swapped.down_proj) == projections
        assert isinstance(swapped.up_proj.get_base_layer(), bnb.nn.Linear4bit)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _trained(run):
    """The run's model as it trained: built from its config, its last checkpoint's adapters loaded."""
    cfg = load_config(run / "config.json")
    model = build(cfg, torch.device("cpu"), torch.float32)
    load_weights(find_checkpoint(run), model)
    return model.eval()


def test_a_preset_run_learns_resumes_exactly_and_exports_a_plain_model(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", *QLORA, "train.steps=3", "train.save_every=1", *FAST]) == 0
    losses = [r["loss"] for r in _metrics(run)]
    assert losses[-1] < losses[0]
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "export")
    assert main(["train", f"resume={copy / 'checkpoints' / 'step-00000001'}"]) == 0
    assert [r["loss"] for r in _metrics(copy)] == losses
    final = "checkpoints/step-00000003/model.safetensors"
    assert (copy / final).read_bytes() == (run / final).read_bytes()
    config = json.loads((run / "export" / "config.json").read_text())
    assert "quantization_config" not in config
    exported = AutoModelForCausalLM.from_pretrained(run / "export")
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in exported.modules())
    ids = torch.randint(0, 64, (1, 64))
    with torch.no_grad():  # the tied embeddings and LM head included
        assert rel_err(exported(input_ids=ids).logits, _trained(run)(input_ids=ids).logits) <= 1e-5


@pytest.mark.parametrize("merge", [True, False])
def test_a_folder_run_exports_what_it_trained(tmp_path, merge):
    tiny_model("qwen2", vocab_size=300).save_pretrained(tmp_path / "base")
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", f"model.path={tmp_path / 'base'}", *QLORA, "train.steps=2",
                 f"lora.merge_on_export={str(merge).lower()}", *FAST]) == 0
    ids = torch.randint(0, 257, (1, 64))
    with torch.no_grad():
        want = _trained(run)(input_ids=ids).logits
        if merge:  # a plain model: the dequantized base with the adapters merged, no bitsandbytes needed
            got = AutoModelForCausalLM.from_pretrained(run / "export")(input_ids=ids).logits
            assert rel_err(got, want) <= 1e-5
        else:  # the adapters alone, on the base loaded in 4 bits as the run loaded it: the same model
            base = _load_4bit(tmp_path / "base", attention="sdpa")  # transformers' default, as the run built it
            for module in base.modules():  # as in training: not bitsandbytes' CPU inference layout (bf16 scales)
                if isinstance(module, bnb.nn.Linear4bit):
                    module.support_avx512bf16_for_cpu = False
            got = peft.PeftModel.from_pretrained(base, run / "export").eval()(input_ids=ids).logits
            assert torch.equal(got, want)


@pytest.mark.parametrize("args,match", [
    (["model.quantize=nf4"], "only LoRA adapters can train on them. Set lora.r"),
    (["model.quantize=int4", "lora.r=8"], "model.quantize='int4': use none, or nf4"),
    (["model.quantize=nf4", "lora.r=8", "train.tensor_parallel=2"], "4-bit weights are packed blocks"),
])
def test_settings_that_cannot_work_are_refused(tmp_path, capsys, args, match):
    assert main(["train", f"out_dir={tmp_path / 'out'}", *args, *FAST]) == 2
    assert match in capsys.readouterr().out.replace("\n", "")
    assert not (tmp_path / "out").exists()


def test_without_bitsandbytes_or_accelerate_the_run_is_refused(monkeypatch, tmp_path):
    import importlib.util
    import sys

    cfg = load_config(None, [*QLORA, f"model.path={tmp_path}"])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate"
                        else find_spec(name, *a))
    with pytest.raises(ConfigError, match="needs accelerate: pip install accelerate"):
        check_quantize_runs(cfg, torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    with pytest.raises(ConfigError, match="needs the bitsandbytes package: pip install bitsandbytes"):
        check_quantize_runs(cfg, torch.device("cpu"))


def test_a_run_that_fits_only_in_4_bits_is_told_so(monkeypatch):
    import oomb.train.loop.memory as memory

    lora = ["model.preset=qwen2.5-0.5b", "data.seq_len=4096", "train.chunk_size=1024", "train.device=cpu",
            "lora.r=16", "lora.targets=all-linear", "train.cache_attention=false"]
    qlora = load_config(None, [*lora, "model.quantize=nf4"])
    need = memory.plan_for_config(qlora, "cpu", torch.float32, gpu_bytes=None, host_bytes=None)[0].host_bytes
    monkeypatch.setattr(memory, "available_memory", lambda device: (None, need + 2**20))
    with pytest.raises(ConfigError, match=r"set .*model\.quantize=nf4"):
        memory.check_memory(load_config(None, lora), torch.device("cpu"), torch.float32)
