"""benchmarks.core's rows: each row once per backend, recompute mode and chunk size, named apart."""

from benchmarks.core import expand_rows


def test_rows_are_named_by_what_varies_and_fixed_chunks_are_kept():
    runs = [(131072, "oomb-sparse", False, {"selection": "s"}),
            (65536, "oomb+layer-ckpt", True, {}),
            (65536, "oomb-auto", False, {"chunk_size": 16384})]
    rows = expand_rows(runs, ["fa4"], ["chunk", "layer-host"], [8192, 16384])
    names = [(n, name, options["recompute"], options["chunk_size"]) for n, name, _, options, _ in rows]
    assert names == [
        (131072, "oomb-sparse{chunk}@8192", "chunk", 8192), (131072, "oomb-sparse{chunk}@16384", "chunk", 16384),
        (131072, "oomb-sparse{layer-host}@8192", "layer-host", 8192),
        (131072, "oomb-sparse{layer-host}@16384", "layer-host", 16384),
        (65536, "oomb+layer-ckpt{chunk}@8192", "chunk", 8192), (65536, "oomb+layer-ckpt{chunk}@16384", "chunk", 16384),
        (65536, "oomb-auto{chunk}", "chunk", 16384), (65536, "oomb-auto{layer-host}", "layer-host", 16384)]
    assert all(options["selection"] == "s" for n, _, _, options, _ in rows if n == 131072)
    # one of each: the plain names of the records before lists
    one = expand_rows(runs[:1], ["auto"], ["chunk"], [4096])
    assert one == [(131072, "oomb-sparse", False, {"recompute": "chunk", "chunk_size": 4096, "selection": "s"}, "auto")]


def test_sparse_rows_once_per_cap_on_a_chunks_pages():
    import argparse

    import pytest

    from benchmarks.core import _caps, oomb_rows

    args = argparse.Namespace(chunk_pages=_caps("none,64"), budget=32, select_score="bound", lengths=[65536],
                              ckpt_lengths=[], cache_lengths=[], cache_host_lengths=[], offload_lengths=[],
                              offload_cache_host_lengths=[], sparse_lengths=[], sparse_cache_lengths=[131072])
    rows = oomb_rows(args, {})
    assert [(n, name) for n, name, _, _ in rows] == [
        (65536, "oomb"), (131072, "oomb-sparse+cached-attn+free"), (131072, "oomb-sparse+cached-attn+cap64")]
    caps = [options["selection"].chunk_pages for _, name, _, options in rows if "sparse" in name]
    assert caps == [None, 64] and all(o.get("cache_attention") for _, name, _, o in rows if "sparse" in name)
    # one entry: the names of the records made before the option
    args.chunk_pages = [None]
    assert [name for _, name, _, _ in oomb_rows(args, {})] == ["oomb", "oomb-sparse+cached-attn"]
    with pytest.raises(argparse.ArgumentTypeError, match="not a list of page counts"):
        _caps("64,lots")
    with pytest.raises(ValueError, match="at least page_budget"):  # the selection refuses a cap under the budget
        args.chunk_pages = [16]
        oomb_rows(args, {})


def test_a_length_oomb_train_refuses_gets_no_auto_row():
    import argparse

    from benchmarks.core import oomb_rows

    args = argparse.Namespace(chunk_pages=[None], budget=32, select_score="bound", lengths=[], ckpt_lengths=[],
                              cache_lengths=[], cache_host_lengths=[65536], offload_lengths=[65536], sparse_lengths=[],
                              sparse_cache_lengths=[], offload_cache_host_lengths=[65536])
    auto = {32768: {"chunk_size": 8192, "page_size": 128, "cache_attention": True, "recompute": "layer-host"},
            65536: {"refused": "`oomb train` refuses 65536 tokens on this card"}}
    rows = oomb_rows(args, auto)
    assert [(n, name) for n, name, _, _ in rows] == [(32768, "oomb-auto"), (65536, "oomb+host-cached-attn"),
                                                      (65536, "oomb+offload"), (65536, "oomb+offload+host-cached-attn")]
    assert rows[-2][3] == {"offload": True}  # with the bench's --recompute, no attention cache
    assert rows[-1][3] == {"offload": True, "cache_attention": "host"}


def test_auto_settings_are_oomb_train_s_for_the_trained_parameters(monkeypatch):
    import argparse

    import oomb.train.loop.memory as memory
    from benchmarks.core import auto_settings

    monkeypatch.setattr(memory, "available_memory", lambda device: (int(78.5 * 2**30), 120 * 2**30))
    args = argparse.Namespace(preset="llama-3-8b", auto_lengths=[65536], trainable="all")
    refused = auto_settings(args)[65536]
    assert "`oomb train` refuses 65536 tokens" in refused["refused"]  # AdamW's states beside an 8B model
    args.trainable = "lora"
    picked = auto_settings(args)[65536]
    assert "refused" not in picked and picked["recompute"] == "layer-host" and picked["chunk_size"] >= 8192


def test_the_stacks_run_in_the_environment_a_users_script_has(monkeypatch, tmp_path):
    # oomb's rows get `oomb train`'s allocator setting; the stacks' processes the environment from before it.
    import argparse
    import subprocess

    import benchmarks.core as core

    seen = []

    def fake_run(cmd, env=None, **kw):
        seen.append(env)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(core.subprocess, "run", fake_run)
    args = argparse.Namespace(baseline_stacks=["fa4"], preset="tiny", trainable="all", baseline_lengths=[1024],
                              repeats=1, profile_lengths=[])
    rows = core.run_baselines(args, {"PATH": "/bin"})
    assert seen == [{"PATH": "/bin"}] and rows == [{"system": "transformers-fa4", "seq_len": 1024, "error": "exit 1"}]
