"""The memory plan's choices for train's `auto` settings: master weights, chunk, attention cache and the
offload GPU allowance are settled together, and the longest context is the longest over what auto may pick."""

import json

import pytest
import torch
from planning import longest_run, plan_of, plan_run

import oomb.train.loop.memory as memory
from oomb.cli import main
from oomb.surgery import fused_ops
from oomb.train.config.checks import check_config
from oomb.train.config.presets import preset_config
from oomb.train.config.settings import ConfigError, config_json, load_config
from oomb.train.config.step import settled_chunk_size

GiB = 2**30
H200 = dict(gpu_bytes=139 * GiB, host_bytes=int(125.8 * GiB))  # as `oomb plan --gpu-memory 139GiB ...` plans
OFFLOAD_7B = ["model.preset=qwen2.5-7b", "train.offload=true", "train.offload_gpu_memory=auto"]


def _resolve(overrides, device_type="cuda", dtype=torch.bfloat16, **limits):
    cfg = load_config(None, overrides)
    check_config(cfg)
    plan, longest = memory.resolve_auto_settings(cfg, device_type, dtype, **(limits or H200))
    return cfg, plan, longest


def _printed(capsys) -> str:
    """What the command printed, with rich's line wrapping undone."""
    return " ".join(capsys.readouterr().out.split())


def _plan_json(capsys, *args) -> dict:
    main(["plan", "--json", "--gpu-memory", "141GiB", "--host-memory", "125.8GiB", *args])
    return json.loads(capsys.readouterr().out)


def test_the_longest_context_does_not_depend_on_what_is_settled_first(capsys):
    # Reported: 1,138,048 with master_weights=auto (the allowance was settled while masters were still on),
    # 1,593,344 with master_weights=false, and 0 at data.seq_len=1500000.
    runs = {extra: _plan_json(capsys, *OFFLOAD_7B, *extra.split()) for extra in
            ("", "train.master_weights=false", "data.seq_len=1500000", "train.chunk_size=1024",
             "train.chunk_size=1024 data.seq_len=1500000")}
    longest = {r["largest_seq_len"] for r in runs.values()}
    assert longest == {1_593_344}  # >= 1.5M: 7B full fine-tuning with AdamW, pages in 125.8 GiB of host memory
    at_1_5m = runs["data.seq_len=1500000"]
    assert at_1_5m["fits"] and at_1_5m["settings"]["master_weights"] is False
    # The allowance is the chosen plan's: what the GPU leaves beside the run without master weights.
    assert at_1_5m["gpu_bytes"] <= 141 * GiB and at_1_5m["settings"]["offload_resident_layers"] > 0
    # auto is the default allowance: offload alone reports the same; 0 keeps only two layers on the GPU.
    default = _plan_json(capsys, "model.preset=qwen2.5-7b", "train.offload=true")
    assert default["largest_seq_len"] == 1_593_344
    paper = _plan_json(capsys, "model.preset=qwen2.5-7b", "train.offload=true", "train.offload_gpu_memory=0")
    assert paper["largest_seq_len"] == 1_138_048 and paper["settings"]["offload_resident_layers"] == 0


def test_auto_is_at_least_every_fixed_choice_and_the_order_of_choices_does_not_matter():
    cfg, _, auto_longest = _resolve([*OFFLOAD_7B, "data.seq_len=65536"])
    fixed = []
    for masters in ("true", "false"):
        for chunk in (8192, 2048, 128):
            overrides = [*OFFLOAD_7B, f"train.master_weights={masters}", f"train.chunk_size={chunk}"]
            fixed.append(_resolve(overrides)[2])
    assert auto_longest == max(fixed) and auto_longest >= 1_500_000
    # The same answer whichever setting is settled first: every order of the choices auto may take.
    cfg = load_config(None, [*OFFLOAD_7B, "data.seq_len=65536"])
    choices = memory.auto_choices(cfg, "cuda")
    planned = memory.planned_step(cfg, "cuda", torch.bfloat16)
    config = preset_config("qwen2.5-7b")
    for order in (choices, choices[::-1], sorted(choices, key=lambda c: (c["chunk_size"], c["master_weights"]))):
        assert longest_run(config, planned, order, H200["gpu_bytes"], H200["host_bytes"]) == auto_longest


def test_a_long_seq_len_reports_the_longest_that_fits_never_zero():
    _, _, short = _resolve([*OFFLOAD_7B, "data.seq_len=4096"])
    for n in (1_500_000, 1_593_344, 1_593_344 + 128, 10_000_000):
        cfg, plan, longest = _resolve([*OFFLOAD_7B, f"data.seq_len={n}"])
        assert longest == short == 1_593_344
        assert plan.fits == (n <= longest), n
    # Without offload (GPU-bound) as well: the refusal names the longest, not 0.
    _, plan, longest = _resolve(["model.preset=qwen2.5-7b", "data.seq_len=10000000"])
    assert not plan.fits and longest == _resolve(["model.preset=qwen2.5-7b"])[2] > 500_000


@pytest.mark.parametrize("seq_len,chunk,cache", [(65536, 16384, True), (131072, 16384, True), (262144, 16384, "host"),
                                               (524288, 16384, False)])
def test_the_chunk_and_cache_for_7b_on_an_h200(monkeypatch, seq_len, chunk, cache):
    # With liger's fused ops, as on the H200 (the plan counts what they keep; measured peaks in
    # benchmarks/results/core-7b-recompute-64k.json and core-7b-recompute-128k.json). Every layer's input in host
    # memory: up to 256K with the attention cache (on the host at 256K), 512K without it, no offload.
    monkeypatch.setattr(fused_ops, "liger_available", lambda: True)
    cfg, plan, _ = _resolve(["model.preset=qwen2.5-7b", f"data.seq_len={seq_len}"])
    assert (cfg.train.chunk_size, cfg.train.cache_attention, cfg.train.master_weights,
            cfg.train.recompute) == (chunk, cache, False, "layer-host")
    assert plan.fits and plan.settings["chunk_size"] == chunk and plan.settings["cache_attention"] == cache
    # The choice is the first in the order of preference that fits: nothing preferred to it does.
    choices = memory.auto_choices(cfg := load_config(None, ["model.preset=qwen2.5-7b", f"data.seq_len={seq_len}"]),
                                  "cuda", seq_len)
    chosen = choices.index(dict(master_weights=False, chunk_size=chunk, cache_attention=cache, recompute="layer-host"))
    planned = memory.planned_step(cfg, "cuda", torch.bfloat16)
    for choice in choices[:chosen]:
        assert not plan_run(preset_config("qwen2.5-7b"), planned, H200["gpu_bytes"], H200["host_bytes"],
                            seq_len=seq_len, **choice).fits


def test_with_offload_long_whole_chunks_come_first_then_layer_host():
    # Each whole chunk brings every offloaded layer's past again: below 8192 tokens layer-host (a layer's pages once
    # a chunk, chunks twice as long) comes first.
    cfg = load_config(None, [*OFFLOAD_7B, "data.seq_len=65536", "train.master_weights=false"])
    order = [(c["recompute"], c["chunk_size"], c["cache_attention"]) for c in memory.auto_choices(cfg, "cuda", 65536)]
    assert order.pop(0) == ("chunk", 65536, False)  # the whole sequence in one chunk first, where it fits
    first_layer = next(i for i, o in enumerate(order) if o[0] == "layer-host")
    assert order[:first_layer] == [("chunk", 8192, "host"), ("chunk", 8192, False)]
    layer = [o for o in order if o[0] == "layer-host"]
    assert layer[0] == ("layer-host", 16384, "host") and all(k != True for _, _, k in order)  # noqa: E712
    assert order[first_layer + len(layer)] == ("chunk", 4096, "host")  # then the shorter whole chunks
    # Llama-3-8B QLoRA r=32 in Unsloth's 22.6 GiB (plus the context): chunks of 16384 by layer, where whole-chunk
    # recompute would take chunks of 2048
    keys = ["model.preset=llama-3-8b", "model.quantize=nf4", "lora.r=32", "lora.alpha=32", "lora.targets=all-linear",
            "train.optimizer=adamw8bit", "train.offload=true", "data.seq_len=65536"]
    limits = dict(gpu_bytes=int(23.6 * GiB), host_bytes=int(125.8 * GiB))
    cfg, plan, _ = _resolve(keys, **limits)
    assert plan.fits and (cfg.train.recompute, cfg.train.chunk_size) == ("layer-host", 16384)
    cfg, plan, _ = _resolve([*keys, "train.recompute=chunk"], **limits)
    assert plan.fits and cfg.train.chunk_size == 2048
    # Without layer recompute (layer checkpointing), whole chunks alone, longest first
    cfg = load_config(None, [*OFFLOAD_7B, "data.seq_len=65536", "train.layer_checkpointing=true"])
    assert {c["recompute"] for c in memory.auto_choices(cfg, "cuda", 65536)} == {"chunk"}


def test_a_sequence_whose_activations_fit_runs_as_one_chunk_computed_once(monkeypatch):
    # One chunk with whole-chunk recompute is a plain forward and backward (stage 1 runs every chunk but the last);
    # layer-host would run every layer's forward twice. Taken wherever all the activations fit the card.
    monkeypatch.setattr(fused_ops, "liger_available", lambda: True)
    card = dict(gpu_bytes=int(79.2 * GiB), host_bytes=int(125.8 * GiB))
    lora = ["model.preset=qwen2.5-7b", "lora.r=16", "lora.targets=all-linear"]
    cfg, plan, _ = _resolve([*lora, "data.seq_len=4000"], **card)
    t = cfg.train
    assert plan.fits and (t.recompute, t.chunk_size, t.cache_attention) == ("chunk", 4096, False)
    # Too long for every layer's activations at once: chunks of 16384 by layer, as before.
    cfg, plan, _ = _resolve([*lora, "data.seq_len=32768"], **card)
    assert plan.fits and (cfg.train.recompute, cfg.train.chunk_size) == ("layer-host", 16384)
    qlora = ["model.preset=llama-3-8b", "model.quantize=nf4", "lora.r=32", "lora.alpha=32", "lora.targets=all-linear",
             "train.optimizer=adamw8bit"]
    assert _resolve([*qlora, "data.seq_len=8192"], **card)[0].train.recompute == "chunk"
    assert _resolve([*qlora, "data.seq_len=16384"], **card)[0].train.recompute == "layer-host"
    # An explicit chunk shorter than the sequence, a fixed recompute by layer, and a CPU run keep their chunks.
    for keys, device in (([*lora, "data.seq_len=4096", "train.chunk_size=2048"], "cuda"),
                         ([*lora, "data.seq_len=4096", "train.recompute=layer-host"], "cuda"),
                         ([*lora, "data.seq_len=4096"], "cpu")):
        cfg = load_config(None, keys)
        assert memory.whole_sequence_chunk(cfg, device, 4096) is None
    cfg = load_config(None, [*lora, "data.seq_len=4096"])
    assert 4096 not in {c["chunk_size"] for c in memory.auto_choices(cfg, "cpu", 4096)}
    # An explicit chunk as long as the sequence is one chunk, computed once; the cache as set.
    cfg = load_config(None, [*lora, "data.seq_len=4096", "train.chunk_size=8192", "train.cache_attention=host"])
    assert memory.describe_step_choice(cfg, {"chunk_size"}, planned=True).startswith(
        "chunk 8192 (the whole sequence: no layer computed twice) (chosen by the memory plan)")
    first = memory.auto_choices(cfg, "cuda", 4096)[0]
    assert (first["chunk_size"], first["cache_attention"], first["recompute"]) == (8192, "host", "chunk")


def test_auto_chunk_order_smaller_gpus_and_short_sequences(monkeypatch):
    cfg = load_config(None, ["data.seq_len=65536", "train.master_weights=false"])
    choices = memory.auto_choices(cfg, "cuda", 65536)
    assert choices.pop(0) == dict(master_weights=False, chunk_size=65536, cache_attention=False, recompute="chunk")
    # then recompute=layer-host (chunks from 16384, each with the cache on the GPU, then in host memory; then
    # without it), then whole-chunk recompute (chunks from 8192; the cache on the GPU, then none)
    by_layer = [(c["chunk_size"], c["cache_attention"]) for c in choices if c["recompute"] == "layer-host"]
    speed = [(c["chunk_size"], c["cache_attention"]) for c in choices[len(by_layer):]]
    assert [c["recompute"] for c in choices] == ["layer-host"] * len(by_layer) + ["chunk"] * len(speed)
    layer_chunks = [16384, 8192, 4096, 2048, 1024]
    assert by_layer == ([(c, where) for c in layer_chunks for where in (True, "host")]
                        + [(c, False) for c in [*layer_chunks, 512, 256, 128]])
    assert speed == [(8192, True), (4096, True), (2048, True), (1024, True),
                     (8192, False), (4096, False), (2048, False), (1024, False), (512, False), (256, False),
                     (128, False)]
    assert memory.chunk_choices(cfg, "cpu", 65536) == [1024, 512, 256, 128]
    assert memory.chunk_choices(cfg, "cuda", 3000) == [3072, 1536, 768, 384, 128]  # one chunk at most; whole pages
    cfg.train.page_size = 96
    assert memory.chunk_choices(cfg, "cuda") == [8160, 4032, 2016, 960, 480, 192, 96]
    # Where layer recompute is not possible (layer checkpointing here), whole-chunk recompute alone, as before.
    cfg = load_config(None, ["data.seq_len=65536", "train.master_weights=false", "train.layer_checkpointing=true"])
    assert [(c["chunk_size"], c["cache_attention"]) for c in memory.auto_choices(cfg, "cuda", 65536)] == [
        (65536, False), *speed]
    # nor for a decoder whose layers cannot be rebuilt one at a time
    cfg = load_config(None, ["data.seq_len=65536", "train.master_weights=false"])
    with monkeypatch.context() as patched:
        patched.setattr(memory, "layers_rebuildable", lambda config, trust_remote_code: False)
        assert [(c["chunk_size"], c["cache_attention"]) for c in memory.auto_choices(cfg, "cuda", 65536)] == [
            (65536, False), *speed]
    # A smaller GPU moves the cache to the host where the 141 GiB one would not; a host too small for every
    # layer's input recomputes whole chunks.
    order = [(c["recompute"], c["chunk_size"], c["cache_attention"]) for c in choices]
    chosen = {}
    for gpu_gib, host_gib in ((141, 125), (96, 125), (80, 125), (141, 16)):
        cfg, plan, _ = _resolve(["model.preset=qwen2.5-7b", "data.seq_len=65536"], gpu_bytes=gpu_gib * GiB,
                                host_bytes=host_gib * GiB)
        assert plan.fits, (gpu_gib, host_gib)
        chosen[gpu_gib, host_gib] = (cfg.train.recompute, cfg.train.chunk_size, cfg.train.cache_attention)
    assert chosen[141, 125] == chosen[96, 125] == ("layer-host", 16384, True)
    assert chosen[80, 125] == ("layer-host", 16384, "host")
    assert chosen[141, 16] == ("chunk", 8192, True)
    assert order.index(chosen[141, 125]) < order.index(chosen[80, 125]) < order.index(chosen[141, 16])


def test_an_explicit_chunk_is_kept(monkeypatch):
    # transformers' own norms and MLP (train.fused_ops=none): the sizes below are theirs
    cfg, plan, _ = _resolve(["model.preset=qwen2.5-7b", "data.seq_len=65536", "train.chunk_size=2048",
                             "train.fused_ops=none"])
    assert cfg.train.chunk_size == 2048 and plan.settings["chunk_size"] == 2048 and cfg.train.cache_attention is True
    # Kept where it does not fit either: refused, with smaller chunks offered, not changed silently.
    asked = ["model.preset=qwen2.5-7b", "data.seq_len=65536", "train.chunk_size=8192", "train.fused_ops=none"]
    cfg = load_config(None, [*asked, "train.recompute=chunk"])
    monkeypatch.setattr(memory, "available_memory", lambda device: (110 * GiB, 100 * GiB))
    with pytest.raises(ConfigError, match=r"set train.recompute=layer-host \(78.94 GiB\); .*or train.chunk_size=4096 "
                                          r"\(90.54 GiB\)"):  # 8192 needs 115 GiB uncached
        memory.check_memory(cfg, torch.device("cuda"), torch.bfloat16)
    assert cfg.train.chunk_size == 8192 and cfg.train.cache_attention is False
    # With train.recompute=auto the chunk is kept and the layers' inputs go to the host: one layer's activations
    cfg = load_config(None, asked)
    plan = memory.check_memory(cfg, torch.device("cuda"), torch.bfloat16)
    assert (cfg.train.chunk_size, cfg.train.recompute) == (8192, "layer-host") and plan.fits
    assert plan.settings["recompute"] == "layer-host"
    cfg = load_config(None, ["model.preset=qwen2.5-7b", "data.seq_len=65536", "train.fused_ops=none"])  # auto
    assert memory.check_memory(cfg, torch.device("cuda"), torch.bfloat16).fits
    assert (cfg.train.chunk_size, cfg.train.cache_attention, cfg.train.recompute) == (16384, True, "layer-host")


def test_chunk_size_auto_in_the_config():
    cfg = load_config(None, [])
    assert cfg.train.chunk_size == "auto"  # the default
    for text in ("auto", "4096"):
        cfg = load_config(None, [f"train.chunk_size={text}"])
        check_config(cfg)
        assert load_config(None, [f"train.chunk_size={json.loads(config_json(cfg))['train']['chunk_size']}"]
                           ).train.chunk_size == cfg.train.chunk_size == (4096 if text == "4096" else "auto")
    for bad, message in (("big", "train.chunk_size='big': use auto"), ("0", "use auto"),
                         ("1000", "must be a multiple of train.page_size=128"), ("true", "train.chunk_size='true'")):
        with pytest.raises(ConfigError, match=message):
            check_config(load_config(None, [f"train.chunk_size={bad}"]))
    # Unplanned (train.memory_check=false): the old default, 1024, as a multiple of the page.
    assert settled_chunk_size(load_config(None, [])) == 1024
    assert settled_chunk_size(load_config(None, ["train.page_size=384"])) == 768
    assert settled_chunk_size(load_config(None, ["train.page_size=2048"])) == 2048
    cfg = load_config(None, ["train.memory_check=false"])
    assert memory.check_memory(cfg, torch.device("cpu"), torch.float32) is None
    assert (cfg.train.chunk_size, cfg.train.cache_attention) == (1024, False)


def test_the_cpu_default_keeps_its_chunk_and_cache(capsys):
    cfg, plan, _ = _resolve([], "cpu", torch.float32, gpu_bytes=None, host_bytes=16 * GiB)
    assert (cfg.train.chunk_size, cfg.train.cache_attention, plan.fits) == (256, True, True)  # the demo: one chunk
    cfg, plan, _ = _resolve(["data.seq_len=4096"], "cpu", torch.float32, gpu_bytes=None, host_bytes=16 * GiB)
    assert (cfg.train.chunk_size, cfg.train.cache_attention, plan.fits) == (1024, True, True)
    cfg, _, _ = _resolve(["train.offload=true"], "cpu", torch.float32, gpu_bytes=None, host_bytes=16 * GiB)
    assert cfg.train.cache_attention == "host"  # with offload never on the device, in host memory where it fits
    assert main(["plan", "train.device=cpu", "data.seq_len=4096", "--host-memory", "16GiB"]) == 0
    text = _printed(capsys)
    assert "chunk 1024," in text and "step: chunk 1024, attention cache on (chosen by the memory plan)" in text
    # `oomb plan` for a GPU: the 7B's chunk at 64K, and a chunk set by hand is named as such.
    main(["plan", "model.preset=qwen2.5-7b", "data.seq_len=65536", "--gpu-memory", "141GiB", "--host-memory", "125GiB"])
    assert "step: chunk 16384, attention cache on (chosen by the memory plan), recompute layer-host" in _printed(capsys)
    main(["plan", "model.preset=qwen2.5-7b", "data.seq_len=65536", "train.chunk_size=2048", "train.offload=true",
          "--gpu-memory", "141GiB", "--host-memory", "125GiB"])
    assert "step: chunk 2048, attention cache in host memory (chosen by the memory plan)" in _printed(capsys)
    # at a length whose cache the host cannot hold beside the pages, none
    main(["plan", "model.preset=qwen2.5-7b", "data.seq_len=1048576", "train.chunk_size=2048", "train.offload=true",
          "--gpu-memory", "141GiB", "--host-memory", "125GiB"])
    assert "step: chunk 2048, attention cache off (chosen by the memory plan)" in _printed(capsys)
    # a full fine-tune of an 8B model at 64K on 80 GB: no choice fits, and the step line says so
    assert main(["plan", "model.preset=llama-3-8b", "data.seq_len=65536", "--gpu-memory", "78.5GiB",
                 "--host-memory", "120GiB"]) == 1
    assert "step: none of the choices fits (the plan above is the one that needs least: chunk 128," in _printed(capsys)


def test_under_torchrun_every_rank_takes_the_smallest_chunk(monkeypatch):
    overrides = ["model.preset=qwen2.5-7b", "data.seq_len=65536"]
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: whole-chunk recompute only
    monkeypatch.setattr(memory, "available_memory", lambda device: (H200["gpu_bytes"], H200["host_bytes"]))
    seen = []
    monkeypatch.setattr(memory, "smallest_over_ranks", lambda value: seen.append(value) or 2048)
    cfg = load_config(None, overrides)
    plan = memory.check_memory(cfg, torch.device("cuda"), torch.bfloat16, torchrun=True)
    # Another rank could only fit 2048: this one plans again from the settings as asked, with that chunk.
    assert seen == [8192] and (cfg.train.chunk_size, cfg.train.cache_attention) == (2048, True)
    assert plan.settings["chunk_size"] == 2048 and not plan.settings["master_weights"]  # auto: off under torchrun
    cfg = load_config(None, [*overrides, "train.chunk_size=4096"])  # set by the user: no agreement needed
    memory.check_memory(cfg, torch.device("cuda"), torch.bfloat16, torchrun=True)
    assert seen == [8192] and cfg.train.chunk_size == 4096


def test_smallest_over_ranks_in_a_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert memory.smallest_over_ranks(4096) == 4096
    finally:
        dist.destroy_process_group()


def test_train_states_the_choice_and_a_resume_keeps_the_recorded_chunk(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    base = ["data.seq_len=1024", "train.page_size=64", "train.device=cpu", "train.export=false", "train.lr=0.01"]
    settings = dict(seq_len=1024, page_size=64, dtype=torch.float32, device_type="cpu")
    need = {c: plan_of(preset_config("tiny"), chunk_size=c, **settings).host_bytes for c in (512, 256)}
    assert need[256] < need[512]
    monkeypatch.setattr(memory, "available_memory", lambda device: (None, need[256]))  # room for chunks of 256
    assert main(["train", f"out_dir={run}", "train.steps=1", *base]) == 0
    assert ("chunk 256, attention cache off (chosen by the memory plan), page 64, attention kernels torch (auto);"
            in _printed(capsys))
    assert json.loads((run / "config.json").read_text())["train"]["chunk_size"] == 256
    # A resume keeps the chunk its run recorded, though this machine has room for more.
    monkeypatch.setattr(memory, "available_memory", lambda device: (None, 64 * GiB))
    assert main(["train", f"resume={run}", "train.steps=2"]) == 0
    assert "chunk 256, attention cache off, page 64, attention kernels torch (auto);" in _printed(capsys)
    assert json.loads((run / "config.json").read_text())["train"]["chunk_size"] == 256
    # Unless it is asked for again: auto plans anew (the cache stays as the run recorded it, off).
    assert main(["train", f"resume={run}", "train.steps=3", "train.chunk_size=auto"]) == 0
    assert ("chunk 1024 (the whole sequence: no layer computed twice) (chosen by the memory plan), attention cache "
            "off, page 64, attention kernels torch (auto);" in _printed(capsys))
    assert json.loads((run / "config.json").read_text())["train"]["chunk_size"] == 1024


def test_the_cache_and_the_layer_inputs_in_host_memory(monkeypatch):
    # train.cache_attention=host with train.recompute=layer-host: both kept stores of the step on the host,
    # the GPU holding one layer's activations of one chunk beside the weights and the pages.
    monkeypatch.setattr(fused_ops, "liger_available", lambda: True)
    cfg, plan, _ = _resolve(["model.preset=qwen2.5-7b", "data.seq_len=131072", "train.cache_attention=host",
                             "train.recompute=layer-host"])
    items = {i.name: i for i in plan.items}
    assert items["attention output cache"].gpu_bytes == 0 and items["kept layer inputs"].gpu_bytes == 0
    n, layers = 131072, 28
    assert items["attention output cache"].host_bytes == n * layers * 28 * (128 * 2 + 4)  # every chunk, by layer
    assert items["kept layer inputs"].host_bytes == n * (layers + 1) * 3584 * 2
    assert plan.fits and cfg.train.chunk_size == 16384
    assert memory.describe_step_choice(cfg, {"chunk_size"}, planned=True) == (
        "chunk 16384 (chosen by the memory plan), attention cache in host memory, recompute layer-host")
    with pytest.raises(ConfigError, match="train.cache_attention='gpu': use auto"):
        _resolve(["model.preset=qwen2.5-7b", "train.cache_attention=gpu"])
    with pytest.raises(ConfigError, match="train.cache_attention=true keeps attention outputs on the GPU"):
        _resolve(["model.preset=qwen2.5-7b", "train.cache_attention=true", "train.offload=true"])


def test_the_leanest_exact_step_keeps_pages_and_layer_inputs_in_host_memory(monkeypatch):
    # train.offload=true with train.recompute=layer-host (asked for: auto keeps whole-chunk recompute with offload):
    # the pages, every layer's input and the attention cache in host memory; the GPU holds the weights, the
    # gradients, one layer's activations of one chunk and two layers' page slots.
    monkeypatch.setattr(fused_ops, "liger_available", lambda: True)
    cfg, plan, _ = _resolve(["model.preset=qwen2.5-7b", "data.seq_len=131072", "train.offload=true",
                             "train.offload_gpu_memory=0", "train.recompute=layer-host", "train.cache_attention=host"])
    items = {i.name: i for i in plan.items}
    assert items["kept layer inputs"].gpu_bytes == 0 and items["attention output cache"].gpu_bytes == 0
    assert plan.host_bytes > 131072 * 112 * 1024  # the pages (K, V and their gradients: 112 KiB a token) among them
    lean, ondevice = plan.gpu_bytes, _resolve(
        ["model.preset=qwen2.5-7b", "data.seq_len=131072", "train.recompute=layer-host",
         "train.cache_attention=host"])[1].gpu_bytes
    assert ondevice - lean > 131072 * 100 * 1024  # the pages' 112 KiB a token, less two layers' slots
    assert cfg.train.recompute == "layer-host" and plan.settings["recompute"] == "layer-host"
    auto = _resolve(["model.preset=qwen2.5-7b", "data.seq_len=131072", "train.offload=true"])[0]
    assert auto.train.recompute == "chunk"


@pytest.mark.parametrize("allowance,resident", [("auto", 28), ("0", 0)])
def test_the_startup_line_says_where_offloaded_pages_are(monkeypatch, allowance, resident):
    # The default allowance (auto) keeps every layer of a 7B step at 128K on a 141 GiB GPU: no page is copied.
    from rich.console import Console

    from oomb.train.loop import trainer
    from oomb.train.loop.distributed import DistributedContext

    monkeypatch.setattr(memory, "available_memory", lambda device: (H200["gpu_bytes"], H200["host_bytes"]))
    cfg = load_config(None, ["model.preset=qwen2.5-7b", "data.seq_len=131072", "train.offload=true",
                             f"train.offload_gpu_memory={allowance}"])
    check_config(cfg)
    one = DistributedContext.single(torch.device("cuda"))
    plan, line = trainer._check_memory(cfg, one.device, torch.bfloat16, Console(quiet=True), one)
    assert plan.settings["offload_resident_layers"] == resident
    if resident:
        assert line.endswith(f"offload: the pages of 28 layers kept on the GPU (train.offload_gpu_memory="
                             f"{plan.settings['offload_gpu_bytes']} bytes)")
        assert cfg.train.offload_gpu_memory == str(plan.settings["offload_gpu_bytes"])  # recorded for a resume
    else:
        assert line.endswith("offload: every layer's pages in host memory")
