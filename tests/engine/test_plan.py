"""The memory planner: hand-computed bytes, the activation formula against measured saved tensors,
and largest_context at its boundary."""

import itertools

import pytest
import torch
from planning import first_fitting, longest_of, plan_of
from tiny_models import FAMILIES, tiny_model

import oomb
from oomb.engine import store_for_model
from oomb.kernels.flash4 import KEY_SEGMENT
from oomb.planning.plan import (
    AUTO_GPU_MARGIN_BYTES,
    LoraShape,
    ModelShape,
    checkpointed_bytes_per_token,
    count_parameters,
    measure_saved_activations,
    optimizer_state_bytes,
    saved_bytes_per_token,
    store_spec,
)
from oomb.train.config.presets import preset_config

MiB = 2**20


def _items(plan, where="host_bytes"):
    return {i.name: getattr(i, where) for i in plan.items}


def _planned_gib(plan, *, with_optimizer: bool) -> float:
    """The planned GPU peak as max_memory_allocated sees it (no CUDA context allowance), without the optimizer's
    items for a step that ran without one."""
    items = _items(plan, "gpu_bytes")
    dropped = ("CUDA context",) + (() if with_optimizer else ("optimizer states", "optimizer update"))
    return (plan.gpu_bytes - sum(items[name] for name in dropped)) / 2**30


def test_breakdown_equals_hand_computed_bytes_for_the_tiny_preset():
    # tiny: llama, vocab 64, hidden 128, intermediate 256, 2 layers, 4 heads / 2 KV heads (d=32), tied head.
    cfg = preset_config("tiny")
    plan = plan_of(cfg, seq_len=4096, batch_size=1, chunk_size=1024, page_size=128, dtype=torch.float32,
                       optimizer="adamw", device_type="cpu")
    got = _items(plan)
    layer_params = 128 * 128 + 2 * (128 * 64) + 128 * 128 + 3 * (128 * 256) + 2 * 128
    n_params = 64 * 128 + 2 * layer_params + 128
    assert count_parameters(cfg).total == n_params == 303_744
    assert got["parameters"] == 4 * n_params
    assert got["gradients"] == 4 * n_params
    assert got["optimizer states"] == 8 * n_params  # AdamW: two fp32 moments (fp32 model)
    # 32 pages of 128 tokens; a page = 2 layers x 2 KV heads x 32 dims x 128 slots x (K, V, dK, dV: 4 x 4 B)
    # + the mean key of each layer and head (K's dtype: fp32 here); + the int32 page table.
    page = 2 * 2 * 32 * 128 * 16 + 2 * 2 * 32 * 4
    assert got["paged store"] == 32 * page + 32 * 4
    assert got["sparse page lists"] == 0
    # Per token and layer (s=4): 2 norms (4h + 4 + 4h) + 2*4h + 3*4*H*D + 4H + 4*4*I; per model: norm + ids + cos/sin.
    per_layer = 2 * (8 * 128 + 4) + 8 * 128 + 12 * 128 + 16 + 16 * 256
    per_model = 8 * 128 + 4 + 8 + 2 * 4 * 32
    assert (per_layer, per_model) == (8728, 1292)
    assert got["saved activations"] == 1024 * (2 * per_layer + per_model)
    # CPU loss (torch path, fp32 weight: no copy): grad_h [T, h] + grad_w [V, h] fp32 + a 64 MiB logits block.
    loss = 4 * 1024 * 128 + 4 * 64 * 128 + 64 * MiB
    assert got["chunk workspace"] == loss  # larger than a layer's backward (3 x [T, I] fp32 = 3 MiB)
    assert got["optimizer update"] == 0  # CPU AdamW updates one tensor at a time: 128 KiB < activations
    assert plan.gpu_bytes == 0 and plan.host_bytes == sum(got.values())


def test_sparse_page_lists_and_lora_and_8bit_states():
    cfg = preset_config("tiny")
    common = dict(seq_len=8192, chunk_size=1024, page_size=128, dtype=torch.bfloat16, device_type="cuda")
    sparse = _items(plan_of(cfg, **common, page_budget=4, select_block=256), "gpu_bytes")
    # Chunk k has 8k past pages: lists for k = 1..7 (8 > 4), [1, 1, 1024/256, 4] int32 x 2 layers each.
    assert sparse["sparse page lists"] == 7 * 2 * 4 * (1024 // 256) * 4
    lora = plan_of(cfg, **common, lora_r=8, optimizer="adamw8bit")
    got = _items(lora, "gpu_bytes")
    # Adapters on q, k, v, o of 2 layers: A [8, 128] and B [out, 8] each; peft keeps them in fp32.
    adapters = 2 * sum(8 * 128 + out * 8 for out in (128, 64, 64, 128))
    assert count_parameters(cfg, 8, ("q_proj", "k_proj", "v_proj", "o_proj")).lora.__len__() == 16
    assert got["gradients"] == 4 * adapters
    assert got["parameters"] == 2 * 303_744 + 4 * adapters
    # bitsandbytes: every adapter tensor is under 4096 values -> two fp32 states.
    assert got["optimizer states"] == 8 * adapters


def test_lora_counts_match_peft():
    peft = pytest.importorskip("peft")
    cfg = preset_config("tiny")
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainable = sorted(p.numel() for p in model.parameters() if p.requires_grad)
    assert sorted(count_parameters(model.config, 4, ("q_proj", "v_proj")).lora) == trainable
    assert count_parameters(cfg).total == 303_744


def _expected_saved(model, tokens, layer_checkpointing=False):
    shape = ModelShape.from_config(model.config)
    dtype = model.get_input_embeddings().weight.dtype
    formula = checkpointed_bytes_per_token if layer_checkpointing else saved_bytes_per_token
    per_layer, per_model = formula(shape, dtype)
    return tokens * (shape.num_layers * per_layer + per_model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", FAMILIES)
def test_activation_formula_matches_measured_saved_tensors(family, dtype):
    # The formulas were derived at hidden 48, intermediate 112, head_dim 20; this checks other sizes
    # (tiny_models: hidden 64, intermediate 96 (gpt_oss 32), head_dim 16), batch 2, 96 tokens.
    model = tiny_model(family).to(dtype)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 96))
    measured = measure_saved_activations(model, ids)
    expected = _expected_saved(model, 2 * 96)
    assert abs(measured - expected) <= 0.01 * measured, (family, measured, expected)


def test_activation_formula_with_layer_checkpointing():
    model = tiny_model("qwen2").to(torch.bfloat16)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, model.config.vocab_size, (1, 128))
    measured = measure_saved_activations(model, ids)
    assert measured == _expected_saved(model, 128, layer_checkpointing=True)


def test_largest_context_fits_at_the_boundary_and_grows_with_memory():
    cfg = preset_config("qwen2.5-0.5b")
    settings = dict(chunk_size=2048, page_size=128, dtype=torch.bfloat16, layer_checkpointing=True)
    previous = 0
    for gib in (8, 16, 40, 80):
        limit = gib * 2**30
        n = longest_of(cfg, device_total_bytes=limit, **settings)
        assert n % 128 == 0 and n >= previous
        assert plan_of(cfg, seq_len=n, device_total_bytes=limit, **settings).fits
        assert not plan_of(cfg, seq_len=n + 128, device_total_bytes=limit, **settings).fits
        previous = n
    assert previous > 0
    assert longest_of(cfg, device_total_bytes=2**30, **settings) == 0  # the parameters alone do not fit


def test_largest_context_over_choices_is_the_longest_of_any_whatever_their_order():
    # 7B on AdamW, 141 GiB GPU and 125.8 GiB host, pages offloaded with the "auto" GPU allowance: master
    # weights, the chunk and the attention cache each change the longest context, and not all one way.
    cfg = preset_config("qwen2.5-7b")
    settings = dict(page_size=128, dtype=torch.bfloat16, offload=True, offload_gpu_bytes="auto",
                    device_total_bytes=141 * 2**30, host_total_bytes=int(125.8 * 2**30))
    choices = [dict(master_weights=m, chunk_size=c) for m in (True, False) for c in (8192, 1024)]
    each = [longest_of(cfg, choices=[c], **settings) for c in choices]
    assert each[0] == each[1] == 0 and 0 < each[2] < each[3]  # masters never fit; a smaller chunk leaves more
    want = max(each)
    for order in itertools.permutations(choices):
        assert longest_of(cfg, choices=list(order), **settings) == want
    assert longest_of(cfg, **settings, **choices[3]) == want  # no choices: the settings as given
    # The choice at a length is the first that fits there, in the order given; else the last one's plan.
    plan, index = first_fitting(cfg, choices, seq_len=want, **settings)
    assert index == 3 and plan.fits and plan.settings["chunk_size"] == 1024
    plan, index = first_fitting(cfg, choices, seq_len=65536, **settings)
    assert index == 2 and plan.fits and plan.settings["chunk_size"] == 8192
    plan, index = first_fitting(cfg, choices, seq_len=want + 128, **settings)
    assert index == 3 and not plan.fits
    with pytest.raises(ValueError, match="at least one"):
        first_fitting(cfg, [], seq_len=4096, **settings)


def test_bad_settings_raise():
    cfg = preset_config("tiny")
    with pytest.raises(ValueError, match="seq_len must be positive"):
        plan_of(cfg, seq_len=0)
    with pytest.raises(ValueError, match="optimizer must be one of adamw, adamw8bit, paged_adamw8bit, got 'sgd'"):
        plan_of(cfg, seq_len=128, optimizer="sgd")
    # bools are ints in Python: chunk_size=True would plan chunks of one token
    for name, value in (("chunk_size", True), ("seq_len", 4096.0), ("page_budget", True), ("tensor_parallel", True),
                        ("offload_gpu_bytes", True)):
        with pytest.raises((TypeError, ValueError), match=f"{name} must be an? (integer|byte count)"):
            plan_of(cfg, **{"seq_len": 4096, name: value, "offload": name == "offload_gpu_bytes"})


@pytest.mark.parametrize("fused", [False, True], ids=["peft", "fused-lora"])
@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"),
                                     ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")])
@pytest.mark.parametrize("family", FAMILIES)
def test_activation_formula_with_lora_matches_measured(family, targets, fused):
    peft = pytest.importorskip("peft")
    from oomb.surgery.lora import use_fused_lora

    model = peft.get_peft_model(tiny_model(family).to(torch.bfloat16),
                                peft.LoraConfig(r=8, target_modules=list(targets))).get_base_model()
    adapter_dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    assert adapter_dtypes == {torch.float32}  # what plan_memory assumes for a bf16 model
    if fused:
        assert use_fused_lora(model)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 96))
    measured = measure_saved_activations(model, ids)
    per_layer, per_model = saved_bytes_per_token(ModelShape.from_config(model.config), torch.bfloat16,
                                                 LoraShape(8, targets, torch.float32, fused=fused))
    expected = 2 * 96 * (model.config.num_hidden_layers * per_layer + per_model)
    if family == "gpt_oss":  # its MoE term is full fine-tuning's: an upper bound under LoRA
        assert measured <= expected <= 1.25 * measured, (measured, expected)
    else:
        assert expected == measured


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("adapters", [None, "peft", "fused"])
def test_gemma3_activation_formula_matches_measured(adapters, dtype):
    # Gemma-3: sandwich norms, q/k norms and the (1 + weight) scale in fp32, GEGLU, a RoPE pair for its local and
    # one for its global layers. Beside the per-token bytes each norm keeps its (1 + weight) copy, h or D fp32
    # values whatever the length (and the embedding its scale): what the per-token formula leaves out.
    peft = pytest.importorskip("peft")
    from oomb.surgery.lora import use_fused_lora

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = tiny_model("gemma3_text").to(dtype)
    if adapters is not None:
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=list(targets))).get_base_model()
        if adapters == "fused":
            assert use_fused_lora(model)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 96))
    measured = measure_saved_activations(model, ids)
    shape = ModelShape.from_config(model.config)
    assert shape.rope_tables == 2
    lora = None if adapters is None else LoraShape(8, targets, torch.float32, fused=adapters == "fused")
    per_layer, per_model = saved_bytes_per_token(shape, dtype, lora)
    c = model.config
    weight_copies = c.num_hidden_layers * 4 * (4 * c.hidden_size + 2 * c.head_dim)
    if adapters is None:  # the final norm's copy and the embedding's scale
        weight_copies += 4 * c.hidden_size + dtype.itemsize
    assert measured == 2 * 96 * (c.num_hidden_layers * per_layer + per_model) + weight_copies


def test_optimizer_state_bytes_match_real_optimizers():
    model = tiny_model("llama")
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.ones_like(p)
    numels = tuple(p.numel() for p in params)
    kinds = {"adamw": lambda ps: torch.optim.AdamW(ps)}
    try:
        import bitsandbytes as bnb

        kinds["adamw8bit"] = lambda ps: bnb.optim.AdamW8bit(ps)
    except ImportError:
        pass
    for kind, make in kinds.items():
        opt = make(params)
        opt.step()
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for state in opt.state.values() for t in state.values() if torch.is_tensor(t) and t.numel() > 1}
        assert optimizer_state_bytes(kind, numels, torch.float32) == sum(held.values()), kind


def test_master_weights_bytes_and_their_no_op():
    cfg = preset_config("tiny")
    n = count_parameters(cfg).total
    common = dict(seq_len=4096, chunk_size=1024, page_size=128, dtype=torch.bfloat16, device_type="cuda")
    plain = _items(plan_of(cfg, **common), "gpu_bytes")
    on = plan_of(cfg, **common, master_weights=True)
    got = _items(on, "gpu_bytes")
    assert on.settings["master_weights"] is True and plain["master weights"] == 0
    assert got["master weights"] == 4 * n and got["gradients"] == plain["gradients"] == 2 * n
    assert got["optimizer states"] == 8 * n and plain["optimizer states"] == 4 * n  # fp32 moments on masters
    # CUDA AdamW (foreach): sqrt(exp_avg_sq) of every master at once + the step's fp32 gradients (2 B more each).
    assert got["optimizer update"] == max(0, 4 * n + 2 * n - got["saved activations"] - got["chunk workspace"])
    # 8-bit states do not depend on the stepped dtype; fp32 parameters and LoRA adapters (fp32) need no masters.
    bnb = [_items(plan_of(cfg, **common, optimizer="adamw8bit", master_weights=m), "gpu_bytes")
           for m in (False, True)]
    assert bnb[0]["optimizer states"] == bnb[1]["optimizer states"]
    for change in ({"dtype": torch.float32}, {"lora_r": 8}):
        with_masters = plan_of(cfg, **{**common, **change}, master_weights=True)
        assert with_masters.settings["master_weights"] is False
        assert with_masters.items == plan_of(cfg, **{**common, **change}).items


def test_planned_master_weights_are_what_the_optimizer_holds():
    from oomb.train.loop.faults import measure_memory
    from oomb.train.loop.optim import build_optimizer

    model = tiny_model("llama").to(torch.bfloat16)
    params = list(model.parameters())
    kinds = ["adamw"]
    try:
        import bitsandbytes  # noqa: F401

        kinds.append("adamw8bit")
    except ImportError:
        pass
    for kind in kinds:
        opt = build_optimizer(kind, params, lr=1e-3, weight_decay=0.0, master_weights=True)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        plan = _items(plan_of(model.config, seq_len=128, chunk_size=64, page_size=16, dtype=torch.bfloat16,
                                  optimizer=kind, master_weights=True, device_type="cpu"))
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for state in opt.state.values() for t in state.values() if torch.is_tensor(t) and t.numel() > 1}
        assert plan["optimizer states"] == sum(held.values()), kind
        assert plan["master weights"] == measure_memory(model, opt).master_weights == 4 * sum(p.numel() for p in params)


def test_planned_store_is_the_store_the_engine_allocates():
    model = tiny_model("qwen2")
    ids = torch.randint(0, model.config.vocab_size, (2, 300))  # 19 pages of 16 per sequence, the last ragged
    oomb.chunked_backward(model, ids, chunk_size=64, page_size=16)
    store = store_for_model(model)
    plan = plan_of(model.config, seq_len=300, batch_size=2, chunk_size=64, page_size=16, dtype=torch.float32,
                       device_type="cpu")
    assert store.spec == store_spec(model.config, page_size=16, dtype=torch.float32, grad_dtype=None, device="cpu")
    # Its second layer has a 37-token window: 3 pages of 16 a chunk of 64 keeps for the next, 4 while computed, in
    # ids and a block table of its own (+ its scratch page): 2 x (4 chunks x 3 + 4) + 1 ids against 2 x 19.
    assert store.spec.windows == (None, 37)
    page_table = 2 * (2 * 19 * 4)
    assert store.capacity_pages == 2 * 19 and [store.layer(i).k.shape[0] for i in (0, 1)] == [2 * 19, 33]
    assert _items(plan)["paged store"] == store.nbytes() + page_table
    mean_bytes = store.nbytes()
    # Selection by bounds: the store keeps per-page key min and max beside the mean, as planned.
    from oomb.sparse import PageSelection

    oomb.chunked_backward(model, ids, chunk_size=64, page_size=16,
                          selection=PageSelection(page_budget=2, block=16, score="bound"))
    bounds = store_for_model(model)
    planned = plan_of(model.config, seq_len=300, batch_size=2, chunk_size=64, page_size=16, dtype=torch.float32,
                          device_type="cpu", page_budget=2, select_block=16, select_score="bound")
    assert bounds.spec.key_summary == "bounds" and _items(planned)["paged store"] == bounds.nbytes() + page_table
    spec = bounds.spec
    assert bounds.nbytes() - mean_bytes == (2 * 19 + 33) * spec.num_kv_heads * 2 * spec.head_dim * 4
    oomb.release_memory(model)


def test_offload_moves_the_pages_to_the_host():
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20)
    kw = dict(seq_len=65536, chunk_size=4096, page_size=128, dtype=torch.bfloat16)
    on_gpu = plan_of(cfg, **kw)
    dense = plan_of(cfg, **kw, offload=True)
    pages = 65536 // 128
    page_bytes = 4 * 2 * 64 * 128 * 2 * 4  # layers x KV heads x head_dim x page x 2 B x (K, V, dK, dV)
    mean_bytes = 4 * 2 * 64 * 2  # layers x KV heads x head_dim x 2 B: a page's mean keys
    host = {i.name: i.host_bytes for i in dense.items}
    assert host["offloaded pages"] == pages * (page_bytes + mean_bytes)
    gpu = {i.name: i.gpu_bytes for i in dense.items}
    assert gpu["paged store (device part)"] < {i.name: i.gpu_bytes for i in on_gpu.items}["paged store"] / 1.5
    # Sparse slots hold at most (query blocks x budget + chunk) pages: below every page past ~260K here.
    long = {**kw, "seq_len": 1 << 20}
    sparse_long = plan_of(cfg, **long, offload=True, page_budget=64)
    assert sparse_long.gpu_bytes < plan_of(cfg, **long, offload=True).gpu_bytes / 2
    # Sparse + offload: past that, the device part grows only by the tables, page lists and the slots'
    # one-layer mean keys.
    longer = plan_of(cfg, **{**kw, "seq_len": 1 << 21}, offload=True, page_budget=64)
    grows = (longer.gpu_bytes - sparse_long.gpu_bytes) / (1 << 20) * 1e4
    assert grows < 0.05 * page_bytes / 128 * 1e4


def test_offload_gpu_allowance_keeps_whole_layers_on_the_gpu():
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 22)
    kw = dict(seq_len=1 << 20, chunk_size=4096, page_size=128, dtype=torch.bfloat16, offload=True, page_budget=64,
              select_score="mean")
    # One layer's K, V, dK, dV (tokens x KV heads x head_dim x 2 B x 4) and mean keys (a row per page).
    layer = (1 << 20) * 2 * 64 * 2 * 4 + (1 << 20) // 128 * 2 * 64 * 2
    none = plan_of(cfg, **kw)
    two = plan_of(cfg, **kw, offload_gpu_bytes=2 * layer + layer // 2)  # room for 2.5 layers: 2 kept
    assert two.settings["offload_resident_layers"] == 2
    host = {i.name: i.host_bytes for i in two.items}
    assert host["offloaded pages"] == 2 * layer
    assert two.host_bytes == none.host_bytes - 2 * layer
    assert 2 * layer <= two.gpu_bytes - none.gpu_bytes <= 2 * layer + layer // 100
    everything = plan_of(cfg, **kw, offload_gpu_bytes=10 * layer)  # every layer: no working slots either
    assert everything.settings["offload_resident_layers"] == 4
    assert {i.name: i.host_bytes for i in everything.items}["offloaded pages"] == 0
    # auto: what the GPU has left after everything else, less the margin.
    total = none.gpu_bytes + 3 * layer + AUTO_GPU_MARGIN_BYTES + 1
    auto = plan_of(cfg, **kw, offload_gpu_bytes="auto", device_total_bytes=total)
    assert auto.settings["offload_resident_layers"] == 3 and auto.fits
    assert auto.settings["offload_gpu_bytes"] == 3 * layer + 1
    # Host-bound contexts get longer with the allowance: pages spill from the host to the GPU.
    host_total = none.host_bytes
    longest = dict(chunk_size=4096, dtype=torch.bfloat16, offload=True, page_budget=64, select_score="mean",
                   host_total_bytes=host_total, device_total_bytes=total)
    assert longest_of(cfg, **longest, offload_gpu_bytes="auto") > longest_of(cfg, **longest) >= 1 << 20
    with pytest.raises(ValueError, match="offload_gpu_bytes"):
        plan_of(cfg, **kw, offload_gpu_bytes=-1)


def test_planned_attention_cache_is_what_the_engine_keeps(monkeypatch):
    from oomb.attention.context import StepContext

    model = tiny_model("qwen2")
    ids = torch.randint(0, model.config.vocab_size, (2, 300))  # chunks 64 x 4 + 44: stage 1 holds 4 chunks
    held = []
    original = StepContext.drop_page_lists

    def record(self, chunk_start):  # first called after the last chunk's backward: stage 1's outputs are all kept
        if not held:
            held.append(sum(t.numel() * t.element_size() for pair in self.attention_outputs.values() for t in pair))
        original(self, chunk_start)

    monkeypatch.setattr(StepContext, "drop_page_lists", record)
    oomb.chunked_backward(model, ids, chunk_size=64, page_size=16, cache_attention=True)
    plan = plan_of(model.config, seq_len=300, batch_size=2, chunk_size=64, page_size=16, dtype=torch.float32,
                       device_type="cpu", cache_attention=True)
    c = model.config
    heads, head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    assert held[0] == 2 * 256 * c.num_hidden_layers * heads * (head_dim * 4 + 4)  # out fp32 + lse fp32
    assert _items(plan)["attention output cache"] == held[0]
    off = plan_of(model.config, seq_len=300, batch_size=2, chunk_size=64, page_size=16, dtype=torch.float32,
                      device_type="cpu")
    assert _items(off)["attention output cache"] == 0
    oomb.release_memory(model)


# H200 peaks (torch.cuda.max_memory_allocated) of Qwen2.5-7B steps in benchmarks/results/, with liger's fused
# ops: (record, row, optimizer, attention backend). The core rows ran without an optimizer.
MEASURED_PEAKS = [
    ("core-7b-vs-transformers-64k.json", 1, None, "fa4"),
    ("core-7b-vs-transformers-64k.json", 2, None, "fa4"),
    ("core-7b-recompute-64k.json", 2, None, "fa4"),
    ("core-7b-recompute-64k.json", 3, None, "fa4"),
    ("core-7b-recompute-64k.json", 4, None, "fa4"),
    ("core-7b-recompute-64k.json", 5, None, "fa4"),
    ("core-7b-recompute-128k.json", 1, None, "fa4"),
    ("core-7b-recompute-128k.json", 2, None, "fa4"),
    ("core-7b-vs-transformers-128k.json", 2, None, "fa4"),
    ("core-7b-lean-64k.json", 2, None, "fa4"),
    ("core-7b-vs-transformers-256k.json", 1, None, "fa4"),
    ("train-7b-auto.json", 0, "adamw", "fa4"),
    ("train-7b-auto.json", 1, "adamw", "fa4"),
]


@pytest.mark.parametrize("record,row,optimizer,attention", MEASURED_PEAKS)
def test_the_plan_predicts_the_measured_h200_peaks(record, row, optimizer, attention):
    """The planned GPU peak, without the CUDA context allowance (max_memory_allocated does not see it),
    within -2% / +5% of the measured one: fused ops and fa4's gathered keys as the runs had them. The steps
    without an optimizer are within -0.2% / +1.7% (a layer's MLP gradients and FlashAttention-4's gathered keys
    planned as the larger of the two, not their sum: the MLP's backward is done before attention's begins);
    `oomb train`'s with AdamW and recompute=layer-host are +2.9% (64K) and +3.9% (128K). A likely reason, not
    measured: `oomb train` sets gradients to None between steps, so in the first chunk's backward they are made as
    the layers are reached while the attention cache is whole, and later chunks have freed their share of the
    cache; the benchmark keeps every gradient allocated, as the plan counts them."""
    import json
    from pathlib import Path

    r = json.loads((Path(__file__).parents[2] / "benchmarks/results" / record).read_text())["results"][row]
    if optimizer is None:
        options = r["options"]
        settings = dict(chunk_size=options["chunk_size"], cache_attention=options.get("cache_attention", False),
                        recompute=options.get("recompute", "chunk"))
        measured = r["peak_gpu_gib"]
    else:
        settings = dict(chunk_size=r["chunk_size"], cache_attention=r["cache_attention"],
                        recompute=r.get("recompute", "chunk"))
        measured = max(s["peak_gpu_gib"] for s in r["steps"])
    plan = plan_of(preset_config("qwen2.5-7b"), seq_len=r["seq_len"], optimizer=optimizer or "adamw",
                       master_weights=False, device_type="cuda", attention=attention, fused_ops=True, **settings)
    planned = _planned_gib(plan, with_optimizer=optimizer is not None)
    assert 0.98 <= planned / measured <= 1.05, (planned, measured, planned / measured)


# H100 peaks of the other presets' steps (benchmarks.core, no optimizer, fa4, the fused ops, LoRA layers and offload
# each record names): (record, row). LoRA rows are r=16 on every linear layer.
PRESET_PEAKS = [
    ("core-llama-3-8b-vs-transformers-64k.json", 1), ("core-llama-3-8b-vs-transformers-64k.json", 2),
    ("core-llama-3-8b-all-profile-64k.json", 0), ("core-llama-3-8b-offload-cached-64k.json", 1),
    ("core-llama-3-8b-lora-64k.json", 1), ("core-llama-3-8b-lora-auto-64k.json", 1),
    ("core-qwen3-8b-vs-transformers-64k.json", 1), ("core-qwen3-8b-vs-transformers-64k.json", 2),
    ("core-qwen3-8b-lora-auto-64k.json", 1),
    ("core-granite-3.3-8b-vs-transformers-64k.json", 1), ("core-granite-3.3-8b-vs-transformers-64k.json", 2),
    ("core-gemma-3-12b-vs-transformers-64k.json", 3),
]


@pytest.mark.parametrize("record,row", PRESET_PEAKS)
def test_the_plan_predicts_each_presets_measured_peaks(record, row):
    """Within -2% / +5% of max_memory_allocated on every preset measured (Gemma-3-12B with LoRA, the attention cache
    in host memory: +4.1%; the others within +1.5%), the CUDA context and the optimizer left out as above."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parents[2] / "benchmarks/results" / record).read_text())
    r = data["results"][row]
    assert r["system"].startswith("oomb") and "error" not in r
    options = r["options"]
    lora = {}
    if data["trainable"] == "lora":
        lora = dict(lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"), lora_fused=bool(data["fused_lora_layers"]))
    plan = plan_of(preset_config(data["preset"]), seq_len=r["seq_len"], optimizer="adamw", master_weights=False,
                   device_type="cuda", attention=r["backend"], fused_ops=bool(data["fused_ops_modules"]),
                   chunk_size=options["chunk_size"], cache_attention=options["cache_attention"],
                   recompute=options["recompute"], offload=options.get("offload", False), **lora)
    planned = _planned_gib(plan, with_optimizer=False)
    assert 0.98 <= planned / r["peak_gpu_gib"] <= 1.05, (planned, r["peak_gpu_gib"], planned / r["peak_gpu_gib"])


def test_fa4_workspace_is_bounded_by_key_segments_dense_and_by_page_lists_sparse():
    """fa4 gathers a dense call's keys up to KEY_SEGMENT of the past and the chunk (longer pasts in segments:
    Qwen2.5-7B at 1M tokens gathers 2 GiB instead of 8), and a page-sparse call's at most the pages its lists
    name plus the chunk."""
    cfg = preset_config("qwen2.5-7b")
    n = 1 << 20
    kw = dict(seq_len=n, chunk_size=4096, page_size=128, dtype=torch.bfloat16, device_type="cuda", offload=True,
              optimizer="adamw", master_weights=False, attention="fa4")

    def workspace(**more) -> int:
        return _items(plan_of(cfg, **{**kw, **more}), "gpu_bytes")["chunk workspace"]

    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_key = 8 * cfg.num_key_value_heads * head_dim * 2
    merged = 2 * 4096 * cfg.num_attention_heads * head_dim * 4  # the float32 output and dQ of segmented calls
    dense = workspace()
    assert dense == workspace(seq_len=KEY_SEGMENT + 4096) + merged == workspace(seq_len=4 * n)
    assert workspace(seq_len=KEY_SEGMENT) == workspace(seq_len=KEY_SEGMENT + 4096) - per_key * 4096
    # Lists per 128 queries: 32 lists of 64 pages and the chunk (as many keys as one dense segment, here).
    sparse = workspace(page_budget=64, select_block=128)
    assert dense - sparse == per_key * (KEY_SEGMENT - 32 * 64 * 128) + merged
    # One list per KV head names four times as many pages: more than the sequence holds, so all of it (block
    # sparsity gathers the union in one call).
    assert workspace(page_budget=64, select_block=128, per_head_selection=True) - sparse == \
        per_key * (n - 32 * 64 * 128 - 4096)
    # One list per chunk: the gather is smaller than the fused loss's workspace, which the chunk then needs.
    one_list = workspace(page_budget=64, select_block=4096)
    assert one_list == workspace(page_budget=64, select_block=4096, attention="triton") < sparse
