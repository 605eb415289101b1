"""Run under torchrun: chunked_backward gradients of a tensor parallel model and of one process (tests only).

    torchrun --nproc_per_node 2 tests/distributed/tp_gradients.py OUT.pt

For each case (family x dense / page-sparse / packed documents / offload / layer checkpointing), every rank computes the
one-process gradients of a tiny fp32 model, then splits an identical copy over the ranks
(oomb.engine.apply_tensor_parallel) and runs the same step. Each rank writes OUT.pt.rank{r}: per
case the loss, the reference gradients, the tensor parallel gradients gathered to full tensors,
the store's KV heads on this rank, the number of all-reduces of the tensor parallel step and the
gradient norm of both (oomb train's tensor_parallel_norm for the split model).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tiny_models

from tiny_models import tiny_model  # noqa: E402

import oomb  # noqa: E402
from oomb.engine import apply_tensor_parallel, store_for_model  # noqa: E402
from oomb.engine.support import model_support  # noqa: E402
from oomb.sparse import PageSelection  # noqa: E402
from oomb.train.loop.distributed import DistributedContext  # noqa: E402
from oomb.train.loop.gradients import tensor_parallel_norm  # noqa: E402

SEQ, CHUNK, PAGE = 384, 128, 32  # 3 chunks of 4 pages: from the second chunk on, 4+ past pages > budget 3
CASES = {
    "qwen3-sparse": ("qwen3", {"page_budget": 3}),
    "llama-dense": ("llama", {}),
    "llama-sparse": ("llama", {"page_budget": 3}),
    "llama-sparse-sinks-local": ("llama", {"selection": PageSelection(page_budget=3, block=64, sink_pages=1,
                                                                      local_pages=1)}),
    "llama-sparse-per-head": ("llama", {"selection": PageSelection(page_budget=3, per_head=True)}),
    "llama-documents": ("llama", {"doc_ids": True}),
    "llama-offload-sparse": ("llama", {"offload": True, "page_budget": 3}),
    "llama-layer-checkpointing": ("llama", {"layer_checkpointing": True}),
    "qwen2-dense": ("qwen2", {}),
    "gpt_oss-dense": ("gpt_oss", {}),
}


class CountAllReduces(TorchDispatchMode):
    """Counts the all-reduces DTensor issues (functional collectives) inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops._c10d_functional.all_reduce.default
        return func(*args, **(kwargs or {}))


def grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def main(path: str) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))  # as oomb train builds it
    mesh = mesh2d["tp"]
    ctx = DistributedContext(dist.get_rank(), world, dist.get_rank(), torch.device("cpu"), tensor_parallel=world,
                             mesh=mesh2d)
    results = {}
    for case, (family, options) in CASES.items():
        torch.manual_seed(1)
        ids = torch.randint(0, 101, (1, SEQ))
        kwargs = dict(options)
        if kwargs.pop("doc_ids", False):
            kwargs["doc_ids"] = torch.tensor([[0] * 100 + [1] * 150 + [2] * (SEQ - 250)])
        reference = tiny_model(family)
        if kwargs.pop("layer_checkpointing", False):  # transformers' own, recomputing each layer in backward
            reference.train()
            reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = copy.deepcopy(reference)
        ref_loss = oomb.chunked_backward(reference, ids, chunk_size=CHUNK, page_size=PAGE, **kwargs)
        apply_tensor_parallel(model, mesh)
        model_support(model)  # the model's check, once (its probe forward runs the layers' collectives too)
        with CountAllReduces() as counted:
            loss = oomb.chunked_backward(model, ids, chunk_size=CHUNK, page_size=PAGE, **kwargs)
        results[case] = {"loss": loss, "ref_loss": ref_loss, "ref": grads(reference), "tp": grads(model),
                         "all_reduces": counted.count,
                         "norm": tensor_parallel_norm(list(model.parameters()), ctx),
                         "ref_norm": torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]),
                         "split": [name for name, p in model.named_parameters()
                                   if isinstance(p, DTensor) and not p.placements[0].is_replicate()],
                         "kv_heads": store_for_model(model).spec.num_kv_heads,
                         "ref_kv_heads": store_for_model(reference).spec.num_kv_heads}
    torch.save(results, f"{path}.rank{dist.get_rank()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
