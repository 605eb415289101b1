"""Tensor parallel chunked steps on 2 CPU ranks (gloo, torchrun): the gradients of one process.

The engine-level test runs tests/distributed/tp_gradients.py under torchrun: per case (model family
x dense / page-sparse / packed documents / offload) both ranks compute one process's gradients
and the same step with the model's heads split over the 2 ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close_rel
from tp_gradients import CASES

HERE = Path(__file__).resolve().parent


def torchrun(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *args], capture_output=True, text=True, timeout=300, env=env)
    if check:
        assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def gradients(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "grads.pt"
    torchrun(str(HERE / "tp_gradients.py"), str(out))
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_gradients_equal_one_process(gradients, case):
    for rank, results in enumerate(gradients):
        got = results[case]
        assert got["ref_kv_heads"] == 2 and got["kv_heads"] == 1  # each rank's store holds half the KV heads
        assert float(got["loss"]) == pytest.approx(float(got["ref_loss"]), rel=1e-6)
        assert got["tp"].keys() == got["ref"].keys()
        for name, ref in got["ref"].items():
            assert ref.abs().max() > 0, name  # every parameter takes part
            assert_close_rel(got["tp"][name], ref, 1e-5, f"rank {rank} {case} {name}")
    for name, g in gradients[0][case]["tp"].items():  # replicated parameters: the same update on both ranks
        assert torch.equal(g, gradients[1][case]["tp"][name]), name


def test_sparse_cases_attend_fewer_pages_than_dense(gradients):
    """The page budget is in effect (else the sparse cases would test dense attention again)."""
    results = gradients[0]
    dense = float(results["llama-dense"]["ref_loss"])
    for case in ("llama-sparse", "llama-sparse-sinks-local", "llama-sparse-per-head", "llama-offload-sparse"):
        assert abs(float(results[case]["ref_loss"]) - dense) > 1e-5, case
