"""`oomb train` under torchrun: data parallel (FSDP2) or tensor parallel (heads split), DCP checkpoints.

    torchrun --nproc_per_node N -m oomb.cli train CONFIG.yaml out_dir=runs/x
    torchrun --nproc_per_node N -m oomb.cli train CONFIG.yaml train.tensor_parallel=N out_dir=runs/x

Tensor parallel (train.tensor_parallel = T): the ranks form a 2-D mesh (dp, tp); the T ranks of
a tp group train the same sequences, each with its 1/T of each layer's heads and MLP columns
(oomb.surgery.tensor_parallel) and a paged store of its own KV heads. No gradient reduction is
needed inside a group (a split parameter's gradient is complete in its shard, a replicated one
identical on every rank of the group). With more than one group, FSDP2 shards over dp on top,
as described below for data parallel, and the groups train different sequences.

Each rank trains its own sequences with ``chunked_backward``; parameters, gradients and
optimizer states are sharded over the ranks with FSDP2 (``fully_shard``). docs/distributed.md
says how to launch and what each choice costs; in short, for P parameters of b bytes on W ranks:

- Parameters stay gathered for the whole step (``reshard_after_forward=False``, and resharding
  after backward turned off for every backward but the step's last). A chunked step runs the
  model forward twice per chunk; gathering per forward would move 2 * m * P * b bytes per rank
  for m chunks. Gathered once, a step moves P * b (all-gather) + P * 4 or P * b (reduce-scatter
  of the gradients) per rank, whatever the sequence length. The price: the full parameters and
  their full (unreduced) gradients are resident during the step, P * b + P * b bytes, as on one
  GPU; what stays sharded between steps are the parameters, the reduced gradients and the
  optimizer states (P * b / W, and 2 * P * b / W for AdamW), which is what lets the optimizer
  states of a model that does not fit one GPU fit across W.
- Gradients are reduced once per step: ``set_requires_gradient_sync(False)`` for every chunk
  backward but the last chunk of the last batch (``chunked_backward(before_last_backward=...)``
  turns it on there). Unreduced gradients accumulate in the gathered (unsharded) gradient
  buffers meanwhile.
- The decoder and the LM head form one FSDP2 group (the layers one group each): the chunked
  step calls the decoder and reads the head's weight for the fused cross-entropy, never the
  causal LM's own forward, so the head's weight must be gathered together with the decoder.

LoRA (peft) trains the same way: the frozen base and the adapters sharded, the adapters' gradients reduced;
checkpoints hold the trained parameters only (``_trained_state``), and the export merges the adapters on rank 0
from the gathered state (oomb.surgery.lora.merged_state_dict) as one process's export does.

The step's gradients, their norm and clipping are one path for one process and for torchrun
(oomb/train/loop/gradients.py), which also says how the loss is normalised over the ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from oomb.train.config.device import resolve_device
from oomb.train.config.settings import Config, ConfigError
from oomb.train.data.identity import sha256_of
from oomb.train.loop.optim import wants_master_weights
from oomb.train.runfolder.checkpoint import (
    CHECKPOINTS,
    LATEST,
    CheckpointError,
    checkpoint_dir,
    checkpoint_state,
    fsync_dir,
    fsync_file,
    load_plain,
    name_base_model,
    publish_dir,
    rng_state,
    set_rng_state,
    start_folder_write,
    write_export,
    write_text_atomic,
)

FORMAT = "dcp-fsdp2"  # state.json "format" of a checkpoint written by data parallel ranks together
TP_FORMAT = "dcp-tp"  # ... by tensor parallel ranks


def under_torchrun(cfg: Config) -> bool:
    """Whether the run is one of several torchrun processes (data or tensor parallel)."""
    return cfg.train.tensor_parallel > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1


def smallest_over_ranks(value: int) -> int:
    """The smallest of every torchrun rank's ``value``, on every rank (one all-reduce of one number)."""
    tensor = torch.tensor([value], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


@dataclass(frozen=True)
class DistributedContext:
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tensor_parallel: int = 1  # ranks one model's heads are split over (1: data parallel)
    mesh: object = None  # the 2-D DeviceMesh ("dp", "tp") when tensor_parallel > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel(self) -> int:
        """Groups of ranks that train different sequences."""
        return self.world_size // self.tensor_parallel

    @property
    def data_rank(self) -> int:
        """Which of the data parallel groups this rank belongs to (ranks of one group split one model)."""
        return self.rank // self.tensor_parallel

    @property
    def torchrun(self) -> bool:
        """Whether this process is one of several (a single process is a context of one rank too)."""
        return self.world_size > 1

    @classmethod
    def single(cls, device: torch.device) -> DistributedContext:
        """The context of a run in one process: one rank, every degree 1."""
        return cls(rank=0, world_size=1, local_rank=0, device=device)

    @property
    def checkpoint_format(self) -> str:
        return TP_FORMAT if self.tensor_parallel > 1 else FORMAT


def setup(cfg: Config) -> DistributedContext:
    """Join the torchrun job (WORLD_SIZE > 1 in the environment); a single process is a context of one rank
    (``DistributedContext.single`` on train.device).

    gloo on CPU, nccl on CUDA with device cuda:LOCAL_RANK. Settings that the data parallel
    path does not support are refused here, before the process group starts.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = cfg.train.tensor_parallel
    if world <= 1:
        if tp > 1:
            raise ConfigError(f"train.tensor_parallel={tp} splits the model over {tp} processes: launch with "
                              f"torchrun --nproc_per_node {tp} -m oomb.cli train ...")
        return DistributedContext.single(resolve_device(cfg.train.device))
    if world % tp:
        raise ConfigError(f"train.tensor_parallel={tp} does not divide the {world} ranks: the ranks form groups "
                          f"of train.tensor_parallel that each split one model (e.g. train.tensor_parallel={world})")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    name = cfg.train.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"train.device={cfg.train.device!r} under torchrun: use auto, cpu or cuda (each rank "
                          "takes cuda:LOCAL_RANK itself)")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    if cfg.lora.r > 0 and tp > 1:
        raise ConfigError(f"lora.r > 0 with train.tensor_parallel={tp}: LoRA runs data parallel under torchrun "
                          "(train.tensor_parallel=1, the default), or in one process")
    if cfg.model.quantize != "none":
        raise ConfigError(f"model.quantize={cfg.model.quantize} under torchrun: FSDP2 cannot shard bitsandbytes' "
                          "packed 4-bit weights; run QLoRA in one process, or LoRA on a 16-bit base "
                          "(model.quantize=none) under torchrun")
    if cfg.train.optimizer != "adamw":
        raise ConfigError(f"train.optimizer={cfg.train.optimizer} under torchrun: only adamw (torch) works on "
                          "FSDP2's sharded parameters")
    wants_master_weights(cfg.train.master_weights, torchrun=True)  # true is refused; auto is off under torchrun
    if cfg.train.recompute in ("layer", "layer-host"):  # FSDP2's hooks miss layers rebuilt inside the backward
        raise ConfigError(f"train.recompute={cfg.train.recompute} runs in one process only: under torchrun set "
                          "train.recompute=chunk (or auto)")
    device = torch.device("cuda", local_rank) if name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    if dist.get_world_size() != world or dist.get_rank() != rank:
        raise RuntimeError(f"process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"the environment says {rank} of {world}")
    mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return DistributedContext(rank, world, local_rank, device, tensor_parallel=tp, mesh=mesh)


def teardown(ctx: DistributedContext) -> None:
    """Leave the process group ``setup`` started (a single process started none)."""
    if ctx.torchrun and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistributedContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def any_rank(ctx: DistributedContext, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one (one tiny all-reduce; ``flag`` on one rank)."""
    if ctx.world_size == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def sum_over_data_ranks(ctx: DistributedContext, count: int) -> int:
    """``count`` summed over the data parallel groups (the ranks of a tensor parallel group hold the same rows)."""
    if ctx.data_parallel == 1:
        return count
    value = torch.tensor([count], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(value)
    return int(value.item()) // ctx.tensor_parallel


def most_over_ranks(ctx: DistributedContext, count: int) -> int:
    """The largest ``count`` of any rank (``count`` on one rank)."""
    if ctx.world_size == 1:
        return count
    most = torch.tensor([count], device=ctx.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


# --- data -------------------------------------------------------------------------------------


class RankInputs:
    """This rank's rows of the batches drawn for all ranks together.

    The wrapped inputs draw ``world_size * batch_size`` sequences per batch (the same on every
    rank, from the seed); rank r keeps rows [r * batch_size, (r + 1) * batch_size). Ranks see
    disjoint sequences, the data position (``state_dict``) is the same on every rank, so a resume
    is exact, and the step's sequences are those of one process with ``batch_size * world_size``.
    """

    def __init__(self, inputs, ctx: DistributedContext, batch_size: int) -> None:
        self.inputs, self.tokenizer, self.notes = inputs, inputs.tokenizer, inputs.notes
        self.rows = slice(ctx.data_rank * batch_size, (ctx.data_rank + 1) * batch_size)

    def batches(self, step: int) -> list:
        return [_rows(batch, self.rows) for batch in self.inputs.batches(step)]

    def state_dict(self) -> dict:
        return self.inputs.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inputs.load_state_dict(state)


def _rows(batch, rows: slice):
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dataclasses.replace(batch, **{k: v[rows] for k, v in fields.items() if isinstance(v, torch.Tensor)})


def build_rank_inputs(cfg: Config, config, ctx: DistributedContext, build_inputs):
    """``build_inputs`` for all ranks' sequences (batch_size * world_size), sliced to this rank's.

    Tensor parallel: the ranks of one tensor parallel group take the same sequences.
    """
    if ctx.data_parallel == 1:
        return build_inputs(cfg, config)
    everyone = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                  batch_size=cfg.train.batch_size * ctx.data_parallel))
    return RankInputs(build_inputs(everyone, config), ctx, cfg.train.batch_size)


# --- model and step ---------------------------------------------------------------------------


def shard_model(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """FSDP2 in place: each decoder layer one group, then the causal LM (embeddings, final norm, head) the root.

    ``reshard_after_forward=False`` everywhere: the step's many forwards reuse the gathered
    parameters (see the module docstring for the cost). The chunked step calls the decoder and
    reads the LM head's weight, never the causal LM's forward: one forward of one token here
    makes FSDP2 take the causal LM as its root (it takes the first module to run forward), and
    ``accumulate_gradients`` gathers the root's group explicitly (``unshard``) before each step.
    Gradients of the root's group are reduced by FSDP2's end-of-backward callback, which runs
    the post-backward of every group, also of those whose forward did not run.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    decoder, head = model.get_decoder(), model.get_output_embeddings()
    layers = getattr(decoder, "layers", None)
    if layers is None or head is None:
        raise ConfigError(f"{type(model).__name__}: data parallel training needs a decoder with .layers and an "
                          "LM head (a transformers *ForCausalLM model)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.int64, device=device), use_cache=False)
    for module in model.modules():  # back to the sharded parameters (what the optimizer must hold)
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def check_tensor_parallel(ctx: DistributedContext, config) -> None:
    """Refuse, before the model is built, a tensor parallel degree the model config cannot split."""
    from oomb.surgery import tensor_parallel as tp

    try:
        tp.check_tensor_parallel(config, ctx.tensor_parallel)
    except tp.TensorParallelError as e:
        raise ConfigError(f"train.tensor_parallel={ctx.tensor_parallel}: {e}") from e
    if ctx.data_parallel > 1:
        _refuse_replicated(ctx, tp.per_head_replicated_parameters(config), tp.splits(config, ctx.world_size))


def _refuse_replicated(ctx: DistributedContext, names: list[str], all_ranks_split: bool) -> None:
    if names:  # their gradient hooks would sit on the parameters FSDP2 replaces (every rank in one TP group?)
        ways = f"train.tensor_parallel={ctx.world_size} or 1" if all_ranks_split else "train.tensor_parallel=1"
        raise ConfigError(f"train.tensor_parallel={ctx.tensor_parallel} with data parallel over "
                          f"{ctx.data_parallel} groups: not supported for this model ({names[0]} is replicated "
                          f"but applied to each rank's own heads); use {ways}")


def split_model(model: torch.nn.Module, ctx: DistributedContext) -> torch.nn.Module:
    """Tensor parallel in place: each layer's heads and MLP columns split over the ranks."""
    from oomb.surgery import tensor_parallel as tp

    try:
        tp.apply_tensor_parallel(model, ctx.mesh["tp"])
    except tp.TensorParallelError as e:
        raise ConfigError(f"train.tensor_parallel={ctx.tensor_parallel}: {e}") from e
    if ctx.data_parallel > 1:  # checked before the model was built too; this is what the split found
        _refuse_replicated(ctx, tp.partially_reduced_parameters(model), tp.splits(model.config, ctx.world_size))
    return model


def param_groups(params) -> list[dict]:
    """One optimizer group per kind of parameter (plain, or DTensor on a given mesh): torch's foreach
    kernels (AdamW's default on CUDA) refuse a list that mixes plain tensors and DTensors or meshes."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        key = (p.device_mesh.mesh_dim_names, tuple(map(str, p.placements))) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    return [{"params": group} for group in groups.values()]


# --- checkpoints and export -------------------------------------------------------------------


def prepare_out_dir(ctx: DistributedContext, cfg: Config, prepare) -> tuple[Path, bool]:
    """Rank 0 makes the run folder (``prepare``: rundir.prepare_out_dir); every rank gets its path and
    whether rank 0 created it."""
    if ctx.world_size == 1:
        return prepare(cfg)
    barrier(ctx)  # every rank has checked the paths before rank 0 creates anything
    box = [(str(out), created) for out, created in [prepare(cfg)]] if ctx.is_main else [None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0][0]), box[0][1]


def save_checkpoint(ctx: DistributedContext, out_dir: Path, step: int, model, optimizer, scheduler,
                    data_state: dict | None = None) -> Path:
    """Every rank writes its shards (torch.distributed.checkpoint) into ``step-N.tmp``; rank 0 publishes.

    Layout: ``dcp/`` (DCP's files), ``rng-rank{r}.pt`` per rank, ``scheduler.pt``, ``state.json``
    (format, world size, step, data position) and ``manifest.json`` (size and sha256 of every
    file, what ``verify_checkpoint`` checks). The folder is renamed into place only after every
    rank's files are fsynced (a barrier), then ``latest`` is replaced: a crash leaves the
    previous checkpoint as it was.
    """
    import torch.distributed.checkpoint as dcp

    final = checkpoint_dir(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if ctx.is_main:  # debris of an earlier crash removed; a link refused, never followed (runfolder.runfiles)
        start_folder_write(tmp)
    barrier(ctx)
    try:
        model_state, optim_state = _trained_state(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp / "dcp")
        rng = tmp / f"rng-rank{ctx.rank}.pt"
        torch.save(rng_state(), rng)
        fsync_file(rng)
        for f in (tmp / "dcp").iterdir():
            fsync_file(f)
        barrier(ctx)
        if ctx.is_main:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            state = {"step": step, "torch": torch.__version__, "format": ctx.checkpoint_format,
                     "world_size": ctx.world_size, "tensor_parallel": ctx.tensor_parallel}
            if data_state is not None:
                state["data"] = data_state
            (tmp / "state.json").write_text(json.dumps(state))
            files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            manifest = {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_of(tmp / name)} for name in files}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            for name in ("scheduler.pt", "state.json", "manifest.json"):
                fsync_file(tmp / name)
            fsync_dir(tmp / "dcp")
            publish_dir(tmp, final)
            write_text_atomic(out_dir / CHECKPOINTS / LATEST, final.name)
    except BaseException:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(ctx)
    return final


def _trained_state(model, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts of what a checkpoint holds: ``_trained_only``, and of a frozen weight tied to a
    trained name (an LM head tied to a frozen embedding), nothing either."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_trained_only())
    trained = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in model_state.items() if k in trained}, optim_state


def _trained_only(loading: bool = False):
    """What a checkpoint holds of the model: the trained parameters, as one process's checkpoint does
    (``trainable_state_dict``); a frozen base (LoRA) is rebuilt from the model's source on resume. Loading, the
    frozen ones are left as built (not strict: DCP's load has already refused a trained one it lacks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


def check_checkpoint_format(ckpt: Path, ctx: DistributedContext) -> None:
    """Refuse, before loading, a checkpoint written by a different number of processes."""
    state = checkpoint_state(ckpt)
    sharded = state.get("format") in (FORMAT, TP_FORMAT)
    tp = state.get("tensor_parallel", 1)
    if not ctx.torchrun:
        if sharded:
            raise CheckpointError(f"{ckpt} was written by {state['world_size']} ranks under torchrun: resume it "
                                  f"with torchrun --nproc_per_node {state['world_size']}")
        return
    if not sharded:
        raise CheckpointError(f"{ckpt} was written by one process: resume it without torchrun")
    if state["world_size"] != ctx.world_size:
        raise CheckpointError(f"{ckpt} was written by {state['world_size']} ranks, this job has {ctx.world_size}: "
                              f"resume with torchrun --nproc_per_node {state['world_size']}")
    if tp != ctx.tensor_parallel:
        raise CheckpointError(f"{ckpt} was written with train.tensor_parallel={tp}, this job has "
                              f"{ctx.tensor_parallel}: resume with train.tensor_parallel={tp}")


def load_checkpoint(ctx: DistributedContext, ckpt: Path, model, optimizer, scheduler) -> int:
    """Restore this rank's shards, the scheduler and this rank's RNG; returns the step."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from oomb.train.runfolder.safe_dcp import load_dcp

    check_checkpoint_format(ckpt, ctx)
    model_state, optim_state = _trained_state(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    load_dcp(state, ckpt / "dcp")  # no pickled code runs from the checkpoint (oomb.train.runfolder.safe_dcp)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_trained_only(loading=True))
    scheduler.load_state_dict(load_plain(ckpt / "scheduler.pt"))
    set_rng_state(load_plain(ckpt / f"rng-rank{ctx.rank}.pt"))
    return checkpoint_state(ckpt)["step"]


def export_model(ctx: DistributedContext, model, out_dir: Path, *, tokenizer=None, merge_lora: bool = True,
                 base_model: str | None = None) -> Path:
    """Gather the full weights on rank 0 and write one transformers folder (``export/``), atomically. A LoRA
    (peft) model is exported as one process exports it (oomb.train.runfolder.checkpoint.export_model): the
    adapters merged into the base's weights, or with ``merge_lora=False`` the adapter folder, naming
    ``base_model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A tied weight (LM head = embeddings) appears under both names; keep the name one process saves.
    kept = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    full = {name: tensor for name, tensor in full.items() if name in kept}
    if ctx.is_main:
        peft_configs = getattr(model, "peft_config", None)
        if isinstance(peft_configs, dict) and merge_lora:
            from oomb.surgery.lora import merged_state_dict

            write_export(out_dir, model.get_base_model(), tokenizer, state_dict=merged_state_dict(model, full))
        else:
            if isinstance(peft_configs, dict) and base_model is not None:
                name_base_model(peft_configs, base_model)
            write_export(out_dir, model, tokenizer, state_dict=full)
    barrier(ctx)
    return out_dir / "export"
