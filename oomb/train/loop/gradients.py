"""The step's gradients, one path for one process and for torchrun: accumulated over the step's batches,
their global norm, and clipping. What differs is read off the degrees (``DistributedContext``): with data
parallel ranks (FSDP2) the gradients are reduced once per step, at the backward of the last chunk of the
last batch; with tensor parallel ranks a split parameter's gradient is complete in its shard.

The step's loss is the mean over every target token of the step's batches, on every data parallel rank
(as one process running all ranks' sequences as one batch): each batch's summed token loss is divided by
T / D (``chunked_backward(loss_divisor=...)``; T: the step's target tokens over all data ranks, D: the data
parallel degree), and FSDP2's reduce-scatter averages over the D ranks. In one process (D = 1) that is the
summed loss over T: the gradients of the batches add up to the mean's in ``.grad`` with no rescaling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import oomb
from oomb.train.config.settings import Config
from oomb.train.config.step import step_options
from oomb.train.loop.distributed import DistributedContext

__all__ = ["accumulate_gradients", "clip_gradients", "gradient_norm", "tensor_parallel_norm"]


def accumulate_gradients(model, batches, ctx: DistributedContext, cfg: Config, on_chunk=None) -> torch.Tensor:
    """Gradients of the mean loss over every target token of ``batches`` (run one after another) into ``.grad``;
    returns that mean loss (the same on every rank). ``on_chunk(batch, stage, i, n)``: as each chunk of a batch
    starts (``chunked_backward``'s on_chunk, with the batch's index among those run)."""
    counts = [int((b.labels[:, 1:] != -100).sum()) for b in batches]  # the shifted targets
    sharded = ctx.data_parallel > 1  # FSDP2: every rank runs the same collectives, so every batch runs
    if sharded:
        total = _targets_over_data_ranks(counts, ctx)
    else:
        batches = [b for b, n in zip(batches, counts, strict=True) if n]  # nothing to learn: no backward
        total = sum(counts)
        if not batches:
            raise ValueError("no sequence of this step has a target token (every label is -100)")
    divisor = total / ctx.data_parallel
    options = step_options(cfg)
    loss = torch.zeros((), dtype=torch.float32, device=ctx.device)
    if sharded:
        _gather_root(model)
        _gradient_sync(model, False)
    try:
        for m, batch in enumerate(batches):
            last = sharded and m == len(batches) - 1
            doc_ids = batch.doc_ids.to(ctx.device) if batch.doc_ids is not None else None
            loss += oomb.chunked_backward(
                model, batch.input_ids.to(ctx.device), batch.labels.to(ctx.device), doc_ids=doc_ids,
                options=options, loss_divisor=divisor,
                before_last_backward=(lambda: _gradient_sync(model, True)) if last else None,
                on_chunk=None if on_chunk is None else (lambda stage, i, n, m=m: on_chunk(m, stage, i, n)),
            )
    finally:
        if sharded:
            _gradient_sync(model, True)
    if sharded:
        dist.all_reduce(loss)  # sum over ranks of each rank's summed loss / (T / D); a tp group's ranks agree
        loss /= ctx.world_size
    return loss


def _targets_over_data_ranks(counts: list[int], ctx: DistributedContext) -> int:
    """T, the step's target tokens over every data rank; a batch without targets on any rank is refused (the
    same decision on every rank: none starts a backward alone)."""
    local = torch.tensor(counts, dtype=torch.float64)
    every = [torch.zeros_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(every, local)
    every = torch.stack(every)
    if bool((every == 0).any()):
        rank, m = (int(i) for i in (every == 0).nonzero()[0])
        raise ValueError(f"batch {m + 1} of rank {rank} has no target token (every label is -100): every rank's "
                         "batches need targets under torchrun")
    return int(every.sum()) // ctx.tensor_parallel  # the ranks of a tensor parallel group hold the same rows


def _gather_root(model) -> None:
    """Gather the root's FSDP2 group (embeddings, norm, LM head): no forward of the root gathers it, and the
    fused cross-entropy reads the whole head."""
    from torch.distributed.tensor import DTensor

    model.unshard()
    if isinstance(model.get_output_embeddings().weight, DTensor):
        raise RuntimeError("the LM head's weight is still sharded after unshard(): it is not in the root's "
                           "FSDP2 group, so the fused cross-entropy cannot use it")


def _gradient_sync(model: torch.nn.Module, on: bool) -> None:
    """Reduce (and reshard after backward) in the coming backwards, or accumulate unreduced and keep gathered."""
    model.set_requires_gradient_sync(on)  # recurses into the layers' groups
    model.set_reshard_after_backward(on)


def gradient_norm(params, ctx: DistributedContext) -> torch.Tensor:
    """The global gradient norm (not yet clipped), the same on every rank, as a plain tensor."""
    if ctx.tensor_parallel > 1:
        return tensor_parallel_norm(params, ctx)
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP2's sharded gradients


def tensor_parallel_norm(params, ctx: DistributedContext) -> torch.Tensor:
    """The global gradient norm of a tensor parallel (and maybe FSDP2-sharded) model, the same on every rank.

    Each gradient's local squares are summed over the mesh dimensions it is sharded along and
    counted once along those it is replicated on (plain tensors and Replicate placements): at most
    one all-reduce each over the tp group, the dp group and all ranks.
    """
    from torch.distributed.tensor import DTensor

    sums = {(): torch.zeros((), dtype=torch.float32, device=ctx.device)}
    for dims in (("tp",), ("dp",), ("dp", "tp")):
        sums[dims] = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            dims = tuple(name for name, place in zip(g.device_mesh.mesh_dim_names, g.placements, strict=True)
                         if not place.is_replicate())  # Shard, or FSDP2's _StridedShard
            sums[dims] += g.to_local().float().square().sum()
        else:
            sums[()] += g.float().square().sum()
    for dims, group in ((("tp",), ctx.mesh.get_group("tp")), (("dp",), ctx.mesh.get_group("dp")),
                        (("dp", "tp"), None)):  # the same three collectives on every rank
        dist.all_reduce(sums[dims], group=group)
    return torch.stack(list(sums.values())).sum().sqrt()


def clip_gradients(params, max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by min(1, max_norm / norm), as torch's clip_grads_with_norm_ (plain or DTensor)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], scale.to(grads[0].device))
