"""Run under torchrun: count FSDP2's collectives in data parallel chunked steps (tests only).

    torchrun --nproc_per_node 2 tests/distributed/count_collectives.py OUT.json

Two optimizer steps of the tiny preset, 2 batches (train.grad_accum) of 1024 tokens in 4 chunks
each; rank 0 writes the all-gathers and reduce-scatters of each step and the number of FSDP2
groups to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from oomb.train.config.presets import build_model
from oomb.train.config.settings import load_config
from oomb.train.data.inputs import build_inputs, model_config
from oomb.train.loop import distributed
from oomb.train.loop.gradients import accumulate_gradients

calls = {"all_gather_single": 0, "reduce_scatter_single": 0}


def counted(name):
    original = getattr(dist, name)

    def call(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)

    setattr(dist, name, call)


cfg = load_config(None, ["data.seq_len=1024", "train.chunk_size=256", "train.page_size=64", "train.grad_accum=2",
                         "train.device=cpu"])
ctx = distributed.setup(cfg)
model = distributed.shard_model(build_model("tiny", dtype=torch.float32, device="cpu"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
inputs = distributed.build_rank_inputs(cfg, model_config(cfg), ctx, build_inputs)
for name in calls:
    counted(name)
steps = []
for step in range(2):
    before = dict(calls)
    accumulate_gradients(model, inputs.batches(step), ctx, cfg)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    steps.append({name: calls[name] - before[name] for name in calls})
if ctx.is_main:
    groups = sum(isinstance(m, FSDPModule) for m in model.modules())
    with open(sys.argv[1], "w") as f:
        json.dump({"steps": steps, "groups": groups, "chunks": 4, "batches": 2}, f)
distributed.teardown(ctx)
