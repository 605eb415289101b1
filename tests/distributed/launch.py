"""What the multi-process tests share: launching torchrun, reading a run's losses, and the
checks a sharded checkpoint (resume) and its export (transformers load) must pass."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def torchrun(*args: str, check: bool = True, ranks: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(ranks), *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


# The data parallel runs the tests compare: 4 steps of 2 accumulated batches, checkpoints at steps 2 and 4.
DP_STEPS = 4
DP_RUN = ["data.seq_len=512", "train.chunk_size=128", "train.page_size=64", "train.lr=0.01", "train.warmup_steps=1",
          "train.device=cpu", f"train.steps={DP_STEPS}", "train.grad_accum=2", "train.save_every=2",
          "train.keep_last=0"]


def two_ranks_and_one(root: Path, run: list[str]) -> tuple[Path, Path]:
    """(``root/two``, ``root/one``): ``run`` on 2 ranks, and in one process training both ranks' sequences as one
    batch (train.batch_size=2 where each rank has 1), each with its checkpoints and export."""
    from oomb.cli import main

    torchrun("-m", "oomb.cli", "train", *run, f"out_dir={root / 'two'}")
    assert main(["train", *run, "train.batch_size=2", f"out_dir={root / 'one'}"]) == 0
    return root / "two", root / "one"


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def assert_same_losses(run: Path, reference: Path, steps: int, rel: float = 1e-5) -> dict[int, float]:
    """Every step 1..steps of ``run`` has ``reference``'s loss; returns run's losses."""
    got, expected = losses(run), losses(reference)
    assert sorted(got) == list(range(1, steps + 1))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=rel), (step, got, expected)
    return got


def assert_resumes_exactly(run: Path, tmp_path: Path, steps: int, ranks: int = 2, **state) -> None:
    """A copy of ``run`` resumed from its step-2 checkpoint on ``ranks`` ranks repeats steps 3.. with the
    same losses; ``state`` are the entries the checkpoint's state.json must hold (format, world_size, ...)."""
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step-00000002"
    saved = json.loads((ckpt / "state.json").read_text())
    assert {k: saved.get(k) for k in state} == state
    assert {p.name for p in ckpt.iterdir()} >= {"dcp", "rng-rank0.pt", "rng-rank1.pt", "manifest.json"}
    torchrun("-m", "oomb.cli", "train", f"resume={ckpt}", ranks=ranks)
    got, expected = losses(copy), losses(run)
    assert sorted(got) == list(range(1, steps + 1))  # steps after 2 once each: rolled back and run again
    for step in range(3, steps + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-6), (step, got, expected)


def assert_export_holds_the_trained_weights(run: Path, tmp_path: Path, steps: int) -> None:
    """The export's logits equal those of the final sharded checkpoint's weights in a fresh model."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from oomb.train.config.presets import build_model

    dcp_to_torch_save(run / "checkpoints" / f"step-{steps:08d}" / "dcp", tmp_path / "full.pt")
    trained = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    model = build_model("tiny", dtype=torch.float32, device="cpu")
    model.load_state_dict(trained)
    exported = AutoModelForCausalLM.from_pretrained(run / "export", local_files_only=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 96))
    with torch.no_grad():
        expected, got = model(input_ids=ids).logits, exported(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    fresh = build_model("tiny", dtype=torch.float32, device="cpu")
    assert not torch.allclose(fresh(input_ids=ids).logits, got, atol=1e-3)  # the trained weights, not the init
