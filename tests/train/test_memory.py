"""`oomb plan`, and `oomb train` refusing a run whose memory plan does not fit."""

import json
import re

import pytest
import torch
from planning import longest_of, plan_of, plan_run

import oomb.train.loop.memory as memory
from oomb.cli import main
from oomb.planning.plan import HOST_PROCESS_BYTES
from oomb.planning.timing import PageSparsity, predict_step_seconds
from oomb.train.config.presets import preset_config
from oomb.train.config.settings import ConfigError
from oomb.train.config.step import offload_gpu_allowance
from oomb.train.runfolder.rundir import load_run_config

FAST = ["train.chunk_size=128", "train.page_size=64", "train.device=cpu", "train.steps=1", "train.export=false"]
TINY = dict(batch_size=1, chunk_size=128, page_size=64, dtype=torch.float32, device_type="cpu",
            lora_r=0, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), optimizer="adamw",
            layer_checkpointing=False)


def _limit_host(monkeypatch, host_bytes):
    monkeypatch.setattr(memory, "available_memory", lambda device: (None, host_bytes))


def test_train_refuses_a_run_that_does_not_fit_and_writes_nothing(tmp_path, capsys, monkeypatch):
    host = HOST_PROCESS_BYTES + 96 * 2**20
    _limit_host(monkeypatch, host)
    longest = longest_of(preset_config("tiny"), host_total_bytes=host, **TINY)
    assert 256 <= longest < 65536
    out = tmp_path / "out"
    assert main(["train", f"out_dir={out}", "data.seq_len=65536", *FAST]) == 2
    msg = capsys.readouterr().out.replace("\n", "")
    assert "config error:" in msg and "this run needs" in msg and "of host memory but 4.09 GiB is available" in msg
    assert f"The longest data.seq_len that fits with these settings is {longest:,}." in msg
    assert "train.memory_check=false skips this check" in msg and "oomb plan" in msg
    assert not out.exists()
    # The check is a setting: switched off, a run that the plan refuses starts (and here finishes).
    _limit_host(monkeypatch, 1)
    assert main(["train", f"out_dir={out}", "data.seq_len=256", *FAST]) == 2
    assert not out.exists()
    assert main(["train", f"out_dir={out}", "data.seq_len=256", "train.memory_check=false", *FAST]) == 0
    assert (out / "metrics.jsonl").is_file()
    assert "memory plan:" not in capsys.readouterr().out
    _limit_host(monkeypatch, 64 * 2**30)  # fits: the run starts and says what was planned
    assert main(["train", f"out_dir={tmp_path / 'fits'}", "data.seq_len=256", *FAST]) == 0
    assert "memory plan: host 4.0" in capsys.readouterr().out


def test_refusal_names_the_settings_that_would_fit(monkeypatch):
    cfg = load_run_config(None, ["model.preset=qwen2.5-0.5b", "data.seq_len=65536", "train.chunk_size=8192",
                                        "train.device=cpu", "model.dtype=bfloat16", "train.master_weights=true"])
    settings = dict(TINY, chunk_size=8192, page_size=128, dtype=torch.bfloat16, master_weights=True)
    need = plan_of(preset_config("qwen2.5-0.5b"), seq_len=65536, **settings).host_bytes
    _limit_host(monkeypatch, need - 2**30)
    with pytest.raises(ConfigError) as err:
        memory.check_memory(cfg, torch.device("cpu"), torch.bfloat16)
    msg = str(err.value)
    assert "Or keep data.seq_len=65,536 and set train.layer_checkpointing=true" in msg
    assert "train.master_weights=false" in msg  # 0.5B x (4 B masters + 4 B more for fp32 moments)
    changes = {"train.layer_checkpointing=true": {"layer_checkpointing": True},
               "train.optimizer=adamw8bit": {"optimizer": "adamw8bit"},
               "train.master_weights=false": {"master_weights": False}, "lora.r=16": {"lora_r": 16}}
    for fix, change in changes.items():
        fits = plan_of(preset_config("qwen2.5-0.5b"), seq_len=65536, **{**settings, **change},
                           host_total_bytes=need - 2**30).fits
        assert (fix in msg) == fits, fix


def test_plan_cli_prints_the_tiny_preset(capsys):
    assert main(["plan", "--host-memory", "64GiB", "data.seq_len=4096", "train.device=cpu"]) == 0
    text = capsys.readouterr().out
    for line in ("parameters", "paged store", "saved activations", "chunk workspace", "total",
                 "(--host-memory): fits", "longest data.seq_len that fits with these settings:"):
        assert line in text, line
    assert main(["plan", "--json", "--host-memory", "64GiB", "data.seq_len=4096", "train.device=cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    # train.chunk_size=auto and train.cache_attention=auto: on CPU chunks of 1024 (at most), cached where it fits
    want = plan_of(preset_config("tiny"), seq_len=4096, chunk_size=1024, page_size=128, dtype=torch.float32,
                       device_type="cpu", host_total_bytes=64 * 2**30, cache_attention=True)
    assert got["items"] == want.to_dict()["items"] and got["host_bytes"] == want.host_bytes
    # The longest context is the longest over what auto may pick (here: the smallest chunk, no cache).
    longest = {(chunk, cache): longest_of(preset_config("tiny"), chunk_size=chunk, page_size=128,
                                               dtype=torch.float32, device_type="cpu", host_total_bytes=64 * 2**30,
                                               cache_attention=cache)
               for chunk in (1024, 512, 256, 128) for cache in (True, False)}
    assert got["largest_seq_len"] == max(longest.values()) == longest[128, False] > longest[1024, True]
    assert main(["plan", "--host-memory", "1GiB", "train.device=cpu"]) == 1  # does not fit: exit status 1
    assert "does NOT fit" in capsys.readouterr().out


def test_plan_cli_for_another_gpu(capsys):
    args = ["plan", "train.device=cuda", "model.preset=qwen2.5-7b", "data.seq_len=1048576", "train.chunk_size=4096",
            "--gpu-memory", "141GiB", "--host-memory", "125GiB", "--json"]
    if not torch.cuda.is_available():
        assert main(args[:-5]) == 2  # no GPU here and no --gpu-memory: asks for one
        assert "--gpu-memory 141GiB" in capsys.readouterr().out.replace("\n", "")
    # --gpu-memory with a config that says cpu: refused, not silently planned for the CPU
    assert main(["plan", "train.device=cpu", "--gpu-memory", "141GiB"]) == 2
    assert "but the config says train.device=cpu" in capsys.readouterr().out.replace("\n", "")
    assert main([*args, "train.master_weights=true"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["device_type"] == "cuda" and got["device_total_bytes"] == 141 * 2**30
    # Full fine-tuning of 7B on fp32 master weights: 16 B per parameter before any activation, more than
    # the GPU holds at any length.
    items = {i["name"]: i["gpu_bytes"] for i in got["items"]}
    assert items["master weights"] == 4 * 7_615_616_512 and items["optimizer states"] == 8 * 7_615_616_512
    assert got["largest_seq_len"] == 0
    assert main([*args, "train.master_weights=false"]) == 1  # without them (moments in bf16), up to some length
    without = json.loads(capsys.readouterr().out)
    assert 0 < without["largest_seq_len"] < 1048576
    # The default, train.master_weights=auto, may drop them: its longest is the longest without them, and
    # where no choice fits it shows the plan that needs the least (no master weights).
    assert main(args) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["largest_seq_len"] == without["largest_seq_len"] and got["gpu_bytes"] == without["gpu_bytes"]
    assert {i["name"]: i["gpu_bytes"] for i in got["items"]}["master weights"] == 0
    assert main(["plan", "--gpu-memory", "lots"]) == 2
    assert "is not a memory size" in capsys.readouterr().out


@pytest.mark.parametrize("text,nbytes", [("141GiB", 141 * 2**30), ("80 GB", 80 * 10**9), ("150e9", 150 * 10**9),
                                         ("1.5TiB", 3 * 2**39)])
def test_parse_bytes(text, nbytes):
    assert memory.parse_bytes(text) == nbytes


def test_auto_master_weights_are_dropped_when_only_the_run_without_them_fits(monkeypatch):
    overrides = ["model.preset=qwen2.5-0.5b", "data.seq_len=65536", "train.chunk_size=8192", "train.device=cpu",
                 "model.dtype=bfloat16"]
    settings = dict(TINY, chunk_size=8192, page_size=128, dtype=torch.bfloat16)
    with_masters = plan_of(preset_config("qwen2.5-0.5b"), seq_len=65536, **settings, master_weights=True)
    without = plan_of(preset_config("qwen2.5-0.5b"), seq_len=65536, **settings, master_weights=False)
    assert without.host_bytes < with_masters.host_bytes
    _limit_host(monkeypatch, (without.host_bytes + with_masters.host_bytes) // 2)
    cfg = load_run_config(None, overrides)
    plan = memory.check_memory(cfg, torch.device("cpu"), torch.bfloat16)
    assert cfg.train.master_weights is False and plan.settings["master_weights"] is False
    # Asked for explicitly, they are kept and the run is refused with the way out named.
    cfg = load_run_config(None, [*overrides, "train.master_weights=true"])
    with pytest.raises(ConfigError, match="train.master_weights=false"):
        memory.check_memory(cfg, torch.device("cpu"), torch.bfloat16)
    # Where they fit, auto keeps them.
    _limit_host(monkeypatch, with_masters.host_bytes + 2**30)
    cfg = load_run_config(None, overrides)
    assert memory.check_memory(cfg, torch.device("cpu"), torch.bfloat16).settings["master_weights"] is True
    assert cfg.train.master_weights == "auto"


def test_auto_attention_cache_is_on_only_where_it_fits(monkeypatch):
    overrides = ["model.preset=qwen2.5-0.5b", "data.seq_len=65536", "train.chunk_size=8192", "train.device=cpu",
                 "model.dtype=bfloat16", "train.master_weights=false"]
    settings = dict(TINY, chunk_size=8192, page_size=128, dtype=torch.bfloat16)
    cached = plan_of(preset_config("qwen2.5-0.5b"), seq_len=65536, **settings, cache_attention=True)
    plain = plan_of(preset_config("qwen2.5-0.5b"), seq_len=65536, **settings)
    assert plain.host_bytes < cached.host_bytes
    _limit_host(monkeypatch, cached.host_bytes + 2**30)
    cfg = load_run_config(None, overrides)
    assert memory.check_memory(cfg, torch.device("cpu"), torch.bfloat16).settings["cache_attention"] is True
    assert cfg.train.cache_attention is True
    _limit_host(monkeypatch, (plain.host_bytes + cached.host_bytes) // 2)  # fits only without the cache
    cfg = load_run_config(None, overrides)
    assert memory.check_memory(cfg, torch.device("cpu"), torch.bfloat16).settings["cache_attention"] is False
    assert cfg.train.cache_attention is False
    cfg = load_run_config(None, [*overrides, "train.cache_attention=true"])  # asked for: kept, and refused
    with pytest.raises(ConfigError, match="train.cache_attention=false"):
        memory.check_memory(cfg, torch.device("cpu"), torch.bfloat16)
    cfg = load_run_config(None, [*overrides, "train.memory_check=false"])  # no plan: no cache
    assert memory.check_memory(cfg, torch.device("cpu"), torch.bfloat16) is None and cfg.train.cache_attention is False
    with pytest.raises(ConfigError, match="train.cache_attention='sometimes'"):
        from oomb.train.config.checks import check_config
        check_config(load_run_config(None, [*overrides, "train.cache_attention=sometimes"]))


def test_offload_gpu_memory_is_checked_and_settled_by_the_plan(monkeypatch):
    from oomb.train.config.checks import check_config

    base = ["model.preset=qwen2.5-0.5b", "data.seq_len=131072", "train.device=cpu", "train.offload=true"]
    with pytest.raises(ConfigError, match="not a memory size"):
        check_config(load_run_config(None, [*base, "train.offload_gpu_memory=lots"]))
    cfg = load_run_config(None, [*base, "train.offload_gpu_memory=3GiB"])
    assert offload_gpu_allowance(cfg) == 3 * 2**30
    assert offload_gpu_allowance(load_run_config(None, [*base, "train.offload_gpu_memory=0"])) == 0
    # auto (the default) is settled by the plan to a byte count (0 here: on the CPU nothing is offloaded),
    # and is 0 unplanned.
    cfg = load_run_config(None, base)
    assert cfg.train.offload_gpu_memory == "auto"
    assert offload_gpu_allowance(cfg) == 0
    memory.check_memory(cfg, torch.device("cpu"), torch.bfloat16)
    assert cfg.train.offload_gpu_memory == "0"
    planned = memory.planned_step(load_run_config(None, [*base, "train.offload_gpu_memory=auto"]), "cuda",
                                  torch.bfloat16)
    plan = plan_run(preset_config("qwen2.5-0.5b"), planned, 80 * 2**30, 64 * 2**30, seq_len=131072)
    assert plan.settings["offload_resident_layers"] == 24  # 3 GiB of pages fit the GPU's headroom whole
    assert {i.name: i.host_bytes for i in plan.items}["offloaded pages"] == 0


def test_a_chunks_pages_are_capped_by_default_and_an_uncapped_offload_choice_noted(capsys):
    from oomb.train.config.settings import load_config
    from oomb.train.config.step import offload_selection_note, page_selection

    base = ["train.offload=true", "train.page_budget=4", "train.chunk_size=1024"]
    assert page_selection(load_config(None, base)).chunk_pages == 4  # auto: one budget a chunk with offload
    assert page_selection(load_config(None, ["train.page_budget=4"])).chunk_pages == 4  # auto: the same without
    assert page_selection(load_config(None, ["train.page_budget=4", "train.chunk_pages=9"])).chunk_pages == 9
    assert offload_selection_note(load_config(None, base)) is None
    uncapped = [*base, "train.chunk_pages=null"]
    note = offload_selection_note(load_config(None, uncapped))
    assert note is not None and "train.chunk_pages=auto" in note and "+29.9%" in note
    assert offload_selection_note(load_config(None, [*uncapped, "train.select_block=1024"])) is None
    assert offload_selection_note(load_config(None, ["train.page_budget=4"])) is None  # no offload
    assert offload_selection_note(load_config(None, ["train.offload=true"])) is None  # dense
    for bad, match in ((["train.chunk_pages=3"], "at least page_budget"), (["train.chunk_pages=many"], "use auto")):
        with pytest.raises(ConfigError, match=match):
            page_selection(load_config(None, [*base, *bad]))
    args = ["plan", "--host-memory", "64GiB", "data.seq_len=4096", "train.device=cpu", *uncapped]
    assert main(args) == 0
    assert "note: train.offload with train.chunk_pages=null" in capsys.readouterr().out.replace("\n", "")


def test_a_cap_on_a_chunks_pages_shrinks_the_offload_slots_in_the_plan():
    from oomb.train.loop import memory

    base = ["model.preset=qwen2.5-7b", "train.offload=true", "train.offload_gpu_memory=0", "train.page_budget=64",
            "train.chunk_size=8192", "data.seq_len=1048576"]
    device = {}
    for cap in ("auto", "null"):
        planned = memory.planned_step(load_run_config(None, [*base, f"train.chunk_pages={cap}"]), "cuda",
                                      torch.bfloat16)
        plan = plan_run(preset_config("qwen2.5-7b"), planned, seq_len=1048576)
        device[cap] = {i.name: i.gpu_bytes for i in plan.items}["paged store (device part)"]
        assert plan.settings["chunk_pages"] == (64 if cap == "auto" else None)
    # Two slots of (64 blocks x 64 pages, or 64 pages) + the chunk's 64, each of 28 KiB per token x 128 tokens
    assert device["null"] - device["auto"] > 2 * (4096 - 64) * 128 * 4096 * 0.9


def test_plan_says_what_a_length_that_does_not_fit_needs_and_predicts_the_dense_step(capsys):
    # 4M tokens of Qwen2.5-7B on an H200 with 125.8 GiB of host memory: the pages (112 KiB per token) do not fit.
    args = ["plan", "train.device=cuda", "model.preset=qwen2.5-7b", "train.offload=true", "data.seq_len=4194304",
            "--gpu-memory", "141GiB", "--host-memory", "125.8GiB", "--json"]
    assert main(args) == 1
    got = json.loads(capsys.readouterr().out)
    needs = got["needs"]
    pages = 4194304 * 112 * 1024  # K, V and their gradients, 28 layers x 4 KV heads x 128 x 2 B each
    # Planned as `oomb train` would run it on this GPU with a host that large: the largest chunk once the fp32
    # master weights are dropped (not the smallest chunk tried against this host), the layers' pages that fit
    # beside it on the GPU, the rest (and the process, the mean keys) on the host.
    assert needs["chunk_size"] == 8192 and needs["fits_gpu_offloaded"]
    on_host = pages * (28 - needs["layers_on_gpu"]) // 28
    assert on_host <= needs["host_bytes_pages_on_host"] <= on_host + 16 * 2**30
    assert needs["gpu_bytes_pages_on_gpu"] >= pages > 141 * 2**30 >= needs["gpu_bytes_pages_on_host"]
    # The prediction is the fitted model's, and a length that fits gets no "needs".
    # Offloaded: no attention cache, so stage 2's extra attention forward is counted.
    assert got["predicted_dense_step_s"] == pytest.approx(predict_step_seconds(preset_config("qwen2.5-7b"), 4194304,
                                                                               cache_attention=False))
    assert not got["predicted_with_attention_cache"]
    assert main([*args[:4], "data.seq_len=65536", *args[5:]]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["needs"] is None and 10 < got["predicted_dense_step_s"] < 14
    # Page-sparse: the attended keys at the sparse rate, with the plan's chunk (4M, offloaded: no attention cache).
    assert main([*args[:4], "data.seq_len=4194304", "train.page_budget=64", *args[5:]]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["predicted_dense_step_s"] is None
    sparsity = PageSparsity(64, 128, got["needs"]["chunk_size"])
    assert got["predicted_sparse_step_s"] == pytest.approx(predict_step_seconds(
        preset_config("qwen2.5-7b"), 4194304, cache_attention=False, sparsity=sparsity))
    assert 400 < got["predicted_sparse_step_s"] < 800  # about 4x the 1M step's 152 s: linear in the context
    # LoRA and a 4-bit base: no frozen weight gradients, the adapters' rows counted, the dequantization not.
    assert main([*args[:4], "data.seq_len=65536", "model.quantize=nf4", "lora.r=16", *args[5:]]) in (0, 1)
    got = json.loads(capsys.readouterr().out)
    assert got["predicted_lora"] and got["predicted_four_bit"] and got["predicted_sparse_step_s"] is None
    full = predict_step_seconds(preset_config("qwen2.5-7b"), 65536,
                                cache_attention=got["predicted_with_attention_cache"])
    assert 0.75 * full < got["predicted_dense_step_s"] < 0.95 * full


# --- the host check counts what the process really holds (issue 42, item 5) ------------------------------------


def _free_host(monkeypatch, available: int) -> None:
    """psutil's view of this machine: ``available`` bytes of host memory free (this process's RSS is measured)."""
    import psutil

    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=available))


def test_the_demo_fits_on_3_gib_free_counting_the_process_as_measured(monkeypatch):
    import psutil

    _free_host(monkeypatch, 3 * 2**30)  # a flat 4 GiB "process" allowance refused the demo here
    cfg = load_run_config(None, [])  # the built-in demo
    plan = memory.check_memory(cfg, torch.device("cpu"), torch.float32)
    assert plan.fits
    process = {i.name: i for i in plan.items}["process"]
    assert process.note.startswith("measured") and process.host_bytes != HOST_PROCESS_BYTES
    assert 0 < process.host_bytes <= psutil.Process().memory_info().rss * 1.1  # this process's RSS, at the check
    assert plan.host_total_bytes == 3 * 2**30 + process.host_bytes  # free memory + what the process holds
    assert plan.host_bytes - process.host_bytes < 0.5 * 2**30  # what the demo adds


def test_a_host_too_small_for_what_the_plan_adds_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    _free_host(monkeypatch, 2**30 // 10)  # 0.1 GiB
    out = tmp_path / "out"
    assert main(["train", f"out_dir={out}", "train.device=cpu"]) == 2  # the demo, on a CPU
    said = " ".join(capsys.readouterr().out.split())
    need = re.search(r"this run needs ([\d.]+ MiB) of host memory besides the ([\d.]+ [MG]iB) this process holds, "
                     r"but 102.40 MiB is free \(largest items: ", said)
    assert need is not None, said
    assert 102.4 < float(need.group(1).split()[0]) < 512  # the demo's store, activations and workspace
    assert "process" in said and "train.memory_check=false skips this check" in said
    assert not out.exists()


def test_oomb_plan_measures_this_process_and_takes_the_allowance_for_another_host(capsys):
    assert main(["plan", "--json", "train.device=cpu"]) == 0  # this machine: the process as measured
    process = {i["name"]: i for i in json.loads(capsys.readouterr().out)["items"]}["process"]
    assert process["note"].startswith("measured") and process["host_bytes"] != HOST_PROCESS_BYTES
    assert main(["plan", "--json", "--host-memory", "8GiB", "train.device=cpu"]) == 0  # another machine's host
    process = {i["name"]: i for i in json.loads(capsys.readouterr().out)["items"]}["process"]
    assert process["note"].startswith("allowance") and process["host_bytes"] == HOST_PROCESS_BYTES


def test_gpu_memory_holds_the_plan_and_the_allocator_to_a_budget(monkeypatch, capsys):
    import oomb.train.loop.host_memory as host_memory

    args = ["plan", "train.device=cuda", "model.preset=qwen2.5-7b", "lora.r=16", "data.seq_len=131072",
            "--gpu-memory", "79GiB", "--host-memory", "125GiB"]
    assert main([*args, "--json"]) == 0
    free = json.loads(capsys.readouterr().out)
    assert main([*args, "--json", "train.gpu_memory=20GiB"]) == 1  # the same run in 20 GiB: no setting fits
    capped = json.loads(capsys.readouterr().out)
    assert capped["device_total_bytes"] == 20 * 2**30 and 0 < capped["largest_seq_len"] < free["largest_seq_len"]
    assert main([*args, "train.gpu_memory=20GiB"]) == 1
    assert "of 20.00 GiB (--gpu-memory, at most train.gpu_memory=20GiB)" in capsys.readouterr().out.replace("\n", "")
    assert main([*args, "train.gpu_memory=200GiB", "--json"]) == 0  # more than the card: the card's
    assert json.loads(capsys.readouterr().out)["device_total_bytes"] == 79 * 2**30
    assert main([*args, "train.gpu_memory=lots"]) == 2
    assert "is not a memory size" in capsys.readouterr().out

    # oomb train's check plans within it and says so when it refuses ...
    monkeypatch.setattr(memory, "available_memory", lambda device: (79 * 2**30, 125 * 2**30))
    cfg = load_run_config(None, ["model.preset=qwen2.5-7b", "lora.r=16", "data.seq_len=131072",
                                 "train.device=cuda", "train.gpu_memory=20GiB"])
    with pytest.raises(ConfigError, match=r"but train.gpu_memory=20GiB allows 20.00 GiB.*set train.offload=true"):
        memory.check_memory(cfg, torch.device("cuda"), torch.bfloat16)
    # ... and holds the caching allocator to it, less the CUDA context allowance the plan counted within it.
    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 76 * 2**30}))
    def set_fraction(fraction, device):  # torch's own check of the device first: a bare "cuda" is refused there
        torch._utils._get_device_index(device, optional=False)
        fractions.append(fraction)

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert host_memory.cap_gpu_allocator(cfg, torch.device("cuda")) == 0.25 and fractions == [0.25]  # 19 of 76 GiB
    assert host_memory.cap_gpu_allocator(cfg, torch.device("cuda", 0)) == 0.25
    assert host_memory.cap_gpu_allocator(cfg, torch.device("cpu")) is None
    cfg.train.gpu_memory = "auto"
    assert host_memory.cap_gpu_allocator(cfg, torch.device("cuda")) is None and fractions == [0.25, 0.25]
