"""benchmarks.packed's parts that run without a GPU: the data it writes, the packer's sequences it hands the stack,
positions within packed documents, the ratio to the stack."""

import json
import random
from pathlib import Path

import pytest
import torch

from benchmarks.packed import (
    VARIANTS,
    _variants,
    conversation_lengths,
    packed_batches,
    position_ids_of,
    unsloth_row,
    versus_baselines,
    write_chat_data,
)


def test_positions_restart_at_every_document():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    assert position_ids_of(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))]


def test_conversation_lengths_have_instruction_data_s_spread():
    rng = random.Random(0)
    prompts, replies = zip(*(conversation_lengths(rng) for _ in range(4000)), strict=True)
    assert 300 < sorted(prompts)[2000] < 500 and 1000 < sorted(replies)[2000] < 1400  # the medians
    assert max(replies) > 8000 and min(replies) >= 16 and max(replies) <= 16000  # a long tail, clipped


def test_the_data_packs_whole_with_loss_on_the_replies_only(tmp_path):
    data, template = write_chat_data(tmp_path, 60, seed=1)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 60 and [m["role"] for m in rows[0]["messages"]] == ["system", "user", "assistant"]
    corpus = packed_batches("qwen2.5-0.5b", 4096, data, template)
    batch = corpus.batch(1)
    assert batch.input_ids.shape == (1, 4096) and batch.doc_ids is not None
    positions = position_ids_of(batch.doc_ids)
    assert int((positions == 0).sum()) >= 2  # several conversations in one sequence
    # loss on part of the tokens (the replies), none on a conversation's first token
    has_loss = batch.labels != -100
    assert 0 < int(has_loss.sum()) < 4096 and not bool(has_loss[positions == 0].any())
    # the same seed, the same sequences: what the stack reads is what `oomb train` reads
    again = packed_batches("qwen2.5-0.5b", 4096, data, template).batch(1)
    assert torch.equal(again.input_ids, batch.input_ids)


def test_versus_baselines_pairs_length_and_variant_and_names_the_fastest():
    rows = [{"system": "transformers-fa4-liger-ckpt", "variant": "lora", "seq_len": 4096, "tokens_per_s": 8000.0},
            {"system": "unsloth", "variant": "lora", "seq_len": 4096, "tokens_per_s": 10000.0},
            {"system": "oomb train", "variant": "lora", "seq_len": 4096, "tokens_per_s": 10000.0},
            {"system": "transformers-fa4-liger-ckpt", "variant": "full", "seq_len": 4096, "error": "out of memory"},
            {"system": "oomb train", "variant": "full", "seq_len": 4096, "tokens_per_s": 5000.0},
            {"system": "unsloth", "variant": "lora", "seq_len": 16384, "tokens_per_s": 9000.0}]
    rows.append({"system": "oomb train, one chunk", "variant": "lora", "seq_len": 4096, "tokens_per_s": 6000.0})
    assert versus_baselines(rows) == [
        {"system": "oomb train", "seq_len": 4096, "variant": "lora",
         "ratios": {"transformers-fa4-liger-ckpt": 1.25, "unsloth": 1.0}, "fastest_baseline": "unsloth",
         "throughput_ratio": 1.0},
        {"system": "oomb train, one chunk", "seq_len": 4096, "variant": "lora",
         "ratios": {"transformers-fa4-liger-ckpt": 0.75, "unsloth": 0.6}, "fastest_baseline": "unsloth",
         "throughput_ratio": 0.6}]  # the full row has no baseline that ran: no entry


@pytest.mark.parametrize("variant", ["lora", "full"])
def test_an_unsloth_row_runs_its_step_in_a_process_on_its_own_path(monkeypatch, tmp_path, variant):
    import argparse
    import os
    import subprocess

    import benchmarks.unsloth_step as us

    data, _ = write_chat_data(tmp_path, 5)
    args = argparse.Namespace(preset="qwen2.5-7b", repeats=3, data=str(data), unsloth_path="/opt/unsloth_site")
    seen = {}

    def fake_run(cmd, env, cwd):
        seen.update(cmd=cmd, env=env)
        step_args = us.parse_args(cmd[3:])  # what the step process would parse
        seen["system"] = us.system_name(step_args)
        record = {"results": [{"system": seen["system"], "seq_len": 4096, "step_s": 2.0, "tokens_per_s": 2048.0,
                               "peak_gpu_gib": 30.0}], "unsloth": {"version": "x"}, "settings": {"batch": 1}}
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(record))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr("benchmarks.packed.subprocess.run", fake_run)
    row = unsloth_row(args, 4096, variant)
    assert seen["cmd"][1:3] == ["-m", "benchmarks.unsloth_step"]
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[1] == "/opt/unsloth_site"  # its path only, no flash-attn-4
    assert seen["system"] == {"lora": "unsloth-lora-r16", "full": "unsloth-full"}[variant]
    assert "--packed-data" in seen["cmd"] and "adamw" in seen["cmd"]
    assert (row["system"], row["variant"], row["seq_len"], row["tokens_per_s"], row["unsloth_system"]) == (
        "unsloth", variant, 4096, 2048.0, seen["system"])

    def failing_run(cmd, env, cwd):
        return subprocess.CompletedProcess(cmd, 2)

    monkeypatch.setattr("benchmarks.packed.subprocess.run", failing_run)
    assert unsloth_row(args, 4096, variant)["error"] == "exit 2, no record"


def test_variants_are_checked():
    assert _variants("lora") == ["lora"] and _variants("full,lora") == list(VARIANTS)
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="variants are full, lora"):
        _variants("qlora")
