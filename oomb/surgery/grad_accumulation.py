"""Weight gradients added into ``.grad`` by the matmul that computes them.

A chunked step runs every layer's backward once per chunk, so each weight's gradient is computed
once per chunk and summed into ``.grad``. Autograd does that in two kernels: the weight-gradient
matmul writes dY^T X into a new tensor, then AccumulateGrad adds it to ``.grad`` (reading both,
writing ``.grad``). For Qwen2.5-7B that add moves about 43 GiB per chunk; bf16 adds, these among
them, took 0.46 s of a 131,072-token sparse step on an H100 (16 chunks of 8192, profiled with autograd's
add). cuBLAS can add the product into the existing gradient inside the matmul (beta = 1),
which reads ``.grad`` once in its epilogue and writes it once: no second kernel, no temporary
gradient, and one rounding to bf16 instead of two.

``use_fused_grad_accumulation`` swaps each trained ``torch.nn.Linear`` of a model's decoder layers
for a ``GradAccumulatingLinear`` holding the SAME Parameters (state_dict keys, optimizer state and
``save_pretrained`` output unchanged; it is an ``nn.Linear``). Its forward is ``F.linear``; only
its backward differs, and only where writing ``.grad`` directly is what AccumulateGrad would do:

- the weight is a plain leaf Parameter that requires a gradient (not a DTensor: FSDP2 and tensor
  parallelism reduce gradients in hooks on accumulation, which this path would skip);
- it has no hooks of its own (``register_hook``, ``register_post_accumulate_grad_hook``);
- no process group of several ranks is running.

Elsewhere (and under ``torch.no_grad``, as in stage 1) it is plain ``F.linear``. The weight's gradient
is not returned to autograd, so ``torch.autograd.grad`` with respect to such a weight sees none:
oomb's step and trainer use ``backward()`` only. ``plain_linears`` puts ``nn.Linear`` back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


class _LinearIntoGrad(torch.autograd.Function):
    """y = x W^T + b, whose backward adds dY^T X into ``W.grad`` in the same matmul (beta = 1)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        add_product_into_grad(weight, dy2.t(), x2)
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, db


def add_product_into_grad(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """param.grad += alpha * a @ b, the add inside the matmul (beta = 1, one kernel); the product where no .grad."""
    if param.grad is None:
        param.grad = torch.mm(a, b) if alpha == 1.0 else torch.mm(a, b).mul_(alpha)
    else:
        param.grad.addmm_(a, b, alpha=alpha)


def writes_grad_directly(weight: torch.Tensor) -> bool:
    """Whether adding into ``weight.grad`` from the backward is what AccumulateGrad would do (module docstring)."""
    if not (weight.requires_grad and weight.is_leaf) or type(weight.data) is not torch.Tensor:
        return False
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return False
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class GradAccumulatingLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose backward adds the weight's gradient into ``.grad`` inside the matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and writes_grad_directly(self.weight):
            return _LinearIntoGrad.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    @classmethod
    def holding(cls, linear: torch.nn.Linear) -> GradAccumulatingLinear:
        """One holding ``linear``'s own Parameters (nothing allocated, nothing copied)."""
        return _rebuilt(cls, linear)


def _rebuilt(cls: type, linear: torch.nn.Linear) -> torch.nn.Linear:
    """A ``cls`` (an ``nn.Linear`` type) holding ``linear``'s own Parameters, in its training mode."""
    with torch.device("meta"):  # its own weight and bias are replaced at once: allocate nothing
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
    new.weight, new.bias = linear.weight, linear.bias
    new.train(linear.training)
    return new


def _decoder_linears(model: torch.nn.Module, kind: type) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module of exactly ``kind`` inside the model's decoder layers: the embedding and the
    output head stay as they are (the head's gradient comes from the fused loss), and so do peft's adapters and
    the base layers they wrap (``lora_`` names, frozen bases) and quantized layers (other types)."""
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    if not isinstance(layers, torch.nn.ModuleList):
        return []
    layers = {id(layer) for layer in layers}
    found = []
    for name, module in model.named_modules():
        if id(module) not in layers:
            continue
        for sub, child in module.named_modules():
            if type(child) is kind and "lora_" not in sub and "base_layer" not in sub:
                found.append((f"{name}.{sub}", child))
    return found


def fused_grad_accumulation_applies(model: torch.nn.Module, fused_ops: str, world_size: int = 1) -> bool:
    """Whether a run (``train.fused_grad_accumulation``) or a bench swaps the linear layers in: a CUDA model, fused
    ops not turned off, one process (several ranks reduce gradients in FSDP's and tensor parallel's hooks)."""
    param = next(model.parameters(), None)
    return fused_ops != "none" and param is not None and param.device.type == "cuda" and world_size == 1


def use_fused_grad_accumulation(model: torch.nn.Module) -> list[str]:
    """Swap ``GradAccumulatingLinear`` into the decoder layers' trained ``nn.Linear``s (module docstring); returns
    their names. Idempotent; ``plain_linears`` undoes it."""
    swapped = []
    for name, linear in _decoder_linears(model, torch.nn.Linear):
        if linear.weight.requires_grad:
            model.set_submodule(name, GradAccumulatingLinear.holding(linear))
            swapped.append(name)
    return swapped


def plain_linears(model: torch.nn.Module) -> list[str]:
    """Put ``nn.Linear`` (same Parameters) back where ``use_fused_grad_accumulation`` swapped; returns the names."""
    names = []
    for name, module in _decoder_linears(model, GradAccumulatingLinear):
        model.set_submodule(name, _rebuilt(torch.nn.Linear, module))
        names.append(name)
    return names
