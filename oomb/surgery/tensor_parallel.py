"""Tensor parallelism over attention heads and MLP columns (torch's DTensor tensor-parallel API).

    apply_tensor_parallel(model, mesh)   # once, before the optimizer is built
    oomb.chunked_backward(model, input_ids, ...)   # unchanged: the engine reads the split from the model

Each rank of the 1-D ``mesh`` holds 1/T of every decoder layer's attention heads and MLP
columns (T = mesh size), Megatron style::

    q/k/v_proj, gate/up_proj   ColwiseParallel   weight (and bias) rows split: local heads / columns
    o_proj, down_proj          RowwiseParallel   weight columns split; output all-reduced (sum)
    GPT-OSS sinks [H]          split like the query heads
    embeddings, norms, LM head, GPT-OSS router and experts   replicated (every rank computes them)

transformers' attention modules reshape with ``view(*shape, -1, head_dim)``, so after the split
each rank's attention call (oomb's) sees only its H/T query heads and H_kv/T KV heads, and the
paged store of each rank holds only its KV heads: page memory per rank is 1/T of one process's.
T must divide the number of KV heads (and of query heads, and the MLP width).

Gradients: a replicated parameter gets the same (full) gradient on every rank, because the
gradient that flows from the split layers back into the replicated residual stream is
all-reduced by ColwiseParallel's input (the transpose of RowwiseParallel's forward all-reduce).
The exception is a replicated parameter inside the attention that acts on the local heads only
(Qwen3's q_norm/k_norm weights, [head_dim]): its gradient is summed over the ranks by a hook,
one all-reduce of head_dim values per layer and backward. Split parameters are DTensors whose
local shard holds this rank's gradient rows.

Communication per decoder layer and chunk of B x C tokens, hidden size h, b bytes per value:
one all-reduce of B x C x h x b bytes after attention and one after the MLP in every forward
(the step runs two forwards per chunk but the last: fill and recompute), and in the backward one
per ColwiseParallel input (q, k, v, gate, up: 5). Page-sparse selection adds an all-gather of
the page scores per layer and chunk (``oomb.sparse.select_pages``), unless per-head lists.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")

# The process group a model's heads are split over, set by apply_tensor_parallel(); read by the engine.
_GROUPS: weakref.WeakKeyDictionary[torch.nn.Module, dist.ProcessGroup] = weakref.WeakKeyDictionary()
_PARTIAL: weakref.WeakKeyDictionary[torch.nn.Module, list[str]] = weakref.WeakKeyDictionary()


class TensorParallelError(ValueError):
    """A model or setting that tensor parallelism cannot split; the message says what to change."""


def check_tensor_parallel(config, degree: int) -> None:
    """Raise TensorParallelError unless ``degree`` ranks can split this model config's heads and MLP."""
    if degree < 1:
        raise TensorParallelError(f"the tensor parallel degree must be >= 1, got {degree}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads % degree or heads % degree:
        divisors = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and heads % d == 0]
        raise TensorParallelError(
            f"tensor parallel degree {degree} does not divide the model's {kv_heads} KV heads and {heads} query "
            f"heads: each rank must hold whole KV heads (and their query groups); use one of {divisors}")
    width = getattr(config, "intermediate_size", None)
    if not getattr(config, "num_local_experts", 0) and width is not None and width % degree:
        raise TensorParallelError(f"tensor parallel degree {degree} does not divide the MLP width {width}")


def splits(config, degree: int) -> bool:
    """Whether check_tensor_parallel accepts ``degree`` for this model config."""
    try:
        check_tensor_parallel(config, degree)
    except TensorParallelError:
        return False
    return True


def apply_tensor_parallel(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Split ``model``'s decoder layers over the 1-D device ``mesh`` in place; returns the model.

    Refuses (TensorParallelError) models whose layers are not laid out as q/k/v/o_proj attention
    plus a gate/up/down_proj MLP or GPT-OSS experts, and a mesh size that does not divide the
    heads. Build the optimizer after this call: split parameters are replaced by DTensors.
    """
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if base in _GROUPS:
        raise TensorParallelError(f"{type(base).__name__} is already split over tensor parallel ranks")
    if mesh.ndim != 1:
        raise TensorParallelError(f"apply_tensor_parallel takes a 1-D device mesh, got {mesh.ndim} dimensions")
    degree = mesh.size()
    check_tensor_parallel(base.config, degree)
    layers = getattr(base.get_decoder(), "layers", None)
    if layers is None:
        raise TensorParallelError(f"{type(base).__name__}: tensor parallelism needs a decoder with .layers")
    partial: list[str] = []
    for i, layer in enumerate(layers):
        plan = _layer_plan(i, layer)
        parallelize_module(layer, mesh, {
            name: (RowwiseParallel() if name.rsplit(".", 1)[-1] in ("o_proj", "down_proj") else ColwiseParallel())
            for name in plan})
        # The attention's (and a split MLP's) input enters as one replicated DTensor, so the gradients
        # of q, k and v (gate and up) add up as partial sums and are all-reduced once, not once each.
        layer.self_attn.register_forward_pre_hook(_replicated_input(mesh), with_kwargs=True)
        if "mlp.down_proj" in plan:
            layer.mlp.register_forward_pre_hook(_replicated_input(mesh), with_kwargs=True)
        sinks = getattr(layer.self_attn, "sinks", None)
        if sinks is not None:  # GPT-OSS: one sink logit per query head, split with the heads
            layer.self_attn.sinks = torch.nn.Parameter(distribute_tensor(sinks.data, mesh, [Shard(0)]),
                                                       requires_grad=sinks.requires_grad)
        for name, p in layer.self_attn.named_parameters():  # replicated, but applied to this rank's heads only
            if not isinstance(p, DTensor) and p.requires_grad:  # (Qwen3's q/k norms): each rank's gradient is partial
                p.register_hook(_sum_over(mesh.get_group()))
                partial.append(f"model.layers.{i}.self_attn.{name}")
    _GROUPS[base] = mesh.get_group()
    _PARTIAL[base] = partial
    return model


def _replicated_input(mesh):
    """A forward pre-hook: the module's ``hidden_states`` (keyword or first argument) as a Replicate DTensor."""
    from torch.distributed.tensor import DTensor, Replicate

    def hook(module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = DTensor.from_local(kwargs["hidden_states"], mesh, [Replicate()], run_check=False)
        elif args:
            args = (DTensor.from_local(args[0], mesh, [Replicate()], run_check=False), *args[1:])
        return args, kwargs

    return hook


def _sum_over(group: dist.ProcessGroup):
    """A gradient hook: the sum of every rank's partial gradient (one small all-reduce per backward)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


def _layer_plan(i: int, layer: torch.nn.Module) -> list[str]:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = [f"self_attn.{n}" for n in _ATTENTION if isinstance(getattr(attention, n, None), torch.nn.Linear)]
    if len(names) != len(_ATTENTION):
        raise TensorParallelError(f"decoder layer {i} has no self_attn with q_proj, k_proj, v_proj and o_proj "
                                  "linear layers: oomb's tensor parallel plan does not know this architecture")
    if all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in _MLP):
        names += [f"mlp.{n}" for n in _MLP]
    elif getattr(mlp, "experts", None) is None:  # mixture-of-experts MLPs stay replicated
        raise TensorParallelError(f"decoder layer {i}'s MLP is neither gate/up/down_proj nor experts: "
                                  "oomb's tensor parallel plan does not know this architecture")
    return names


def tensor_parallel_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The process group ``model``'s heads are split over (None: not tensor parallel)."""
    return _GROUPS.get(model)


def per_head_replicated_parameters(config) -> list[str]:
    """Names of the parameters of ``config``'s model that stay replicated inside the attention and act
    on each rank's own heads (Qwen3's q/k norm weights), found on a meta-device model (no memory)."""
    import re

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    split = re.compile(r"self_attn\.([qkvo]_proj\.(weight|bias)|sinks)$")
    return [name for name, _ in model.named_parameters() if ".self_attn." in name and not split.search(name)]


def partially_reduced_parameters(model: torch.nn.Module) -> list[str]:
    """Replicated parameters whose gradients a hook sums over the ranks (Qwen3's q/k norm weights)."""
    return list(_PARTIAL.get(model, ()))


def tensor_parallel_degree(model: torch.nn.Module) -> int:
    group = tensor_parallel_group(model)
    return 1 if group is None else dist.get_world_size(group)
