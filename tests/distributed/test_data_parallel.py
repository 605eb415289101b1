"""Data parallel `oomb train` on 2 CPU ranks (gloo, torchrun): the same training as one process.

Reference: one process running both ranks' sequences (train.batch_size=2 where each rank has 1).
Both normalise the step's loss the same way: the mean over every target token of the step's
sequences (all ranks, all train.grad_accum batches).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import (
    DP_RUN,
    DP_STEPS,
    assert_export_holds_the_trained_weights,
    assert_resumes_exactly,
    assert_same_losses,
    losses,
    torchrun,
    two_ranks_and_one,
)
from planning import plan_of
from safetensors.torch import load_file

from oomb.cli import main
from oomb.train.runfolder.checkpoint import find_checkpoint, verify_checkpoint

HERE = Path(__file__).resolve().parent
STEPS, RUN = DP_STEPS, DP_RUN


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(2-rank run, 1-process run) of the same 4 steps, each with checkpoints at steps 2 and 4 and an export."""
    return two_ranks_and_one(tmp_path_factory.mktemp("dp"), RUN)


def test_two_ranks_train_like_one_process_with_both_sequences(runs):
    two, one = runs
    assert_same_losses(two, one, STEPS)
    counted = [[json.loads(x)["loss_tokens"] for x in (run / "metrics.jsonl").read_text().splitlines()]
               for run in (two, one)]
    assert counted[0] == counted[1] == [2 * 2 * 511] * STEPS  # both ranks' 2 x 2 sequences, all their targets
    a, b = load_file(two / "export" / "model.safetensors"), load_file(one / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-5, worst


def test_checkpoint_of_two_ranks_resumes_on_two_ranks(runs, tmp_path):
    assert_resumes_exactly(runs[0], tmp_path, STEPS, world_size=2, format="dcp-fsdp2")


class _MakesAFolder:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


@pytest.mark.parametrize("where", ["metadata", "scheduler"])
def test_pickled_code_in_a_sharded_checkpoint_is_never_run(runs, tmp_path, where):
    """DCP keeps its metadata as a pickle, the scheduler is a torch.save file: an attacker who rewrites them and
    the manifest gets a refusal naming the file, and nothing runs (DCP's own bytes values: test_safe_dcp.py)."""
    import hashlib
    import pickle

    copy = tmp_path / "two"
    shutil.copytree(runs[0], copy)
    ckpt = copy / "checkpoints" / "step-00000002"
    marker = tmp_path / "pwned"
    if where == "metadata":
        (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_MakesAFolder(marker)))
    else:  # the scheduler's state (plain data) becomes a pickled call
        torch.save({"evil": _MakesAFolder(marker)}, ckpt / "scheduler.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in manifest:
        data = (ckpt / name).read_bytes()
        manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    proc = torchrun("-m", "oomb.cli", "train", f"resume={ckpt}", check=False)
    assert proc.returncode != 0 and not marker.exists()
    said = " ".join(proc.stdout.split())
    reason = ("is not plain checkpoint metadata (refused, nothing from it was run)" if where == "metadata"
              else "holds objects other than tensors and plain data (refused, nothing from it was run)")
    assert reason in said, (proc.stdout[-2000:], proc.stderr[-3000:])


def test_export_loads_in_transformers_with_the_trained_weights(runs, tmp_path):
    assert_export_holds_the_trained_weights(runs[0], tmp_path, STEPS)


def test_one_process_refuses_a_checkpoint_of_two_ranks(runs, capsys):
    two, _ = runs
    assert main(["train", f"resume={two}"]) != 0
    assert "torchrun --nproc_per_node 2" in capsys.readouterr().out


def test_gradients_cross_the_network_once_per_step(tmp_path):
    """Each FSDP2 group gathers its parameters once and reduce-scatters its gradients once per step,
    though each step runs 2 batches of 4 chunks (16 forwards and 8 backwards per group)."""
    out = tmp_path / "collectives.json"
    torchrun(str(HERE / "count_collectives.py"), str(out))
    counts = json.loads(out.read_text())
    assert counts["groups"] == 3  # 2 decoder layers + the root (embeddings, final norm, LM head)
    for step in counts["steps"]:
        assert step == {"all_gather_single": counts["groups"], "reduce_scatter_single": counts["groups"]}, counts


def _worker_with_rank(launcher: int, rank: int) -> int:
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return int(child)
    raise AssertionError(f"no worker of rank {rank} under torchrun (pid {launcher})")


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM to rank 1 alone: both ranks finish the step, save it together and stop (no rank left waiting)."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "oomb.cli", "train", "data.seq_len=1024", "train.chunk_size=128",
                             "train.page_size=64", "train.device=cpu", "train.steps=200", "train.export=false",
                             f"out_dir={out}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 600  # ends a hang only: the wait is for the first step, however long it takes
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(_worker_with_rank(proc.pid, 1), signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, stdout[-2000:]
    assert "interrupted by SIGTERM" in stdout + stderr
    assert "finishing the step in progress (every rank stops after the same step)" in " ".join(stderr.split())
    done = len((out / "metrics.jsonl").read_text().splitlines())
    assert 1 <= done < 200
    ckpt = find_checkpoint(out)
    verify_checkpoint(ckpt)
    assert json.loads((ckpt / "state.json").read_text())["step"] == done


def test_packed_text_with_document_masks_and_an_untied_head_matches_one_process(tmp_path):
    """data.task=text (a stateful corpus position) with doc_ids, on a model folder whose LM head is its own."""
    from tiny_models import tiny_model

    folder = tmp_path / "model"
    tiny_model("llama", vocab_size=300).save_pretrained(folder)  # untied LM head; byte-level tokenizer
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(8):
        sentence = "The quick brown fox jumps over the lazy dog. "
        (texts / f"doc{i}.txt").write_text(f"Document {i}. " + sentence * (i % 3 + 1))
    args = ["data.seq_len=256", "train.chunk_size=128", "train.page_size=64", "train.lr=0.01", "train.warmup_steps=1",
            "train.device=cpu", "train.steps=3", f"model.path={folder}", "data.task=text", f"data.paths=[{texts}]",
            "data.document_mask=true"]
    torchrun("-m", "oomb.cli", "train", *args, f"out_dir={tmp_path / 'two'}")
    assert main(["train", *args, "train.batch_size=2", f"out_dir={tmp_path / 'one'}"]) == 0
    got, expected = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(got) == [1, 2, 3]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (step, got, expected)
    a = load_file(tmp_path / "two" / "export" / "model.safetensors")
    b = load_file(tmp_path / "one" / "export" / "model.safetensors")
    assert a.keys() == b.keys() and "lm_head.weight" in a
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert (tmp_path / "two" / "export" / "tokenizer_config.json").is_file()


def test_ranks_whose_plans_differ_step_the_smallest_chunk(tmp_path, monkeypatch):
    """train.chunk_size=auto, rank 1 with room for chunks of 128 only: both ranks step chunks of 128."""
    from oomb.train.config.presets import preset_config

    args = ["data.seq_len=256", "train.page_size=64", "train.device=cpu", "train.steps=1", "train.export=false"]
    need = plan_of(preset_config("tiny"), seq_len=256, chunk_size=128, page_size=64, dtype=torch.float32,
                       device_type="cpu").host_bytes
    # Rank 1 sees only that much host memory (a sitecustomize its interpreter reads at start); rank 0 sees
    # this machine's, which fits chunks of 256 (the whole sequence) with the attention cache.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import oomb.train.loop.memory as memory\n"
        f"    memory.available_memory = lambda device: (None, {need})\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    proc = torchrun("-m", "oomb.cli", "train", *args, f"out_dir={tmp_path / 'run'}")
    # Rank 0 (which prints) planned again with chunks of 128, and keeps the cache, which fits it.
    assert "chunk 128, attention cache on (chosen by the memory plan)" in " ".join(proc.stdout.split())
    # the startup line counts both ranks' sequences in a step, as metrics.jsonl's tokens do
    assert "on cpu x 2 ranks; 1 steps x 2 x 256 tokens" in " ".join(proc.stdout.split())
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["chunk_size"] == 128
    assert sorted(losses(tmp_path / "run")) == [1]
