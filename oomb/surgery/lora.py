"""peft's LoRA layers with the adapter's matmuls fused into the frozen layer's.

peft computes an adapted linear layer as ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``: the
base output [tokens, out] is written, the adapter's own [tokens, out] product is written, read and
scaled into a third, and the sum written again; a bf16 model's float32 adapters (peft's
``autocast_adapter_dtype``) also copy x to float32 for every adapter, and save that copy. Backward
autograd writes the scaled dY [tokens, out] and adds two [tokens, in] input gradients. A chunked step
runs all of it twice (stage 1, then the recompute and its backward).

``use_fused_lora`` changes the class of each eligible peft LoRA layer of the decoder to a subclass
whose forward does, for x [N, in], frozen W [out, in], A [r, in], B [out, r] and s = scaling::

    y  = x W^T (+ b);  xa = x A^T;  y.addmm_(xa, B^T, alpha=s)      the adapter added in the GEMM's epilogue
    dA = s (dY B)^T x;  dB = s dY^T xa;  dx = dY W, dx.addmm_(s dY B, A)

saving x (the layer input, shared by q/k/v and by gate/up) and xa [N, r] only; W's gradient is never
computed. The adapters run in the base's dtype (A and B cast, [r, in] and [out, r]; Unsloth does the
same), their gradients cast back to the adapters' dtype: exact against peft where the dtypes agree
(tests/engine/test_fused_lora.py, fp32 and fp64), and in a bf16 model the adapter product is rounded
to bf16 where peft keeps it in float32. With ``into_grad`` (a run's fused gradient accumulation, CUDA)
dA and dB are added into ``.grad`` inside their matmuls where the dtypes agree, as
oomb.surgery.grad_accumulation does for full fine-tuning.

A base that is not a plain ``nn.Linear`` (bitsandbytes' 4-bit layer of QLoRA) runs its own forward and
backward through autograd: only the adapter is fused, ``addmm(base_out, xa, B^T, alpha=s)``, and its
input gradient added by autograd to the base's.

The swap changes only ``__class__`` (the same module, Parameters, names, hooks and state-dict keys), so
``merge_and_unload``, ``save_pretrained`` and loading adapters work as with peft's class, and peft's
own forward runs whenever the fused one does not apply: adapters disabled or merged, ``adapter_names``
given, several active adapters, autocast, a trained base weight. Layers left alone at the swap (and
named by ``fusion_refusal``): dropout > 0, DoRA or another LoRA variant, a bias on lora_B,
``fan_in_fan_out``, other peft layer types (embeddings, convolutions, 8-bit bases, fused experts'
``target_parameters``). ``plain_lora`` puts peft's classes back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from oomb.surgery.grad_accumulation import add_product_into_grad, writes_grad_directly

_PLAIN: dict[type, type] = {}  # fused class -> the peft class it extends
_FUSED: dict[type, type] = {}  # peft class -> its fused subclass


def _adapter_grads(ctx, dy2, x2, xa, A, B):
    """dA, dB (None where added into .grad or not needed) and dxa = s dY B (for the input gradient)."""
    s, dt = ctx.scaling, dy2.dtype
    dxa = torch.mm(dy2, B.to(dt)).mul_(s)  # [N, r]
    dA = dB = None
    if ctx.into_grad:
        if ctx.needs_A:
            add_product_into_grad(A, dxa.t(), x2)
        if ctx.needs_B:
            add_product_into_grad(B, dy2.t(), xa, s)
    else:
        dA = torch.mm(dxa.t(), x2).to(A.dtype) if ctx.needs_A else None
        dB = torch.mm(dy2.t(), xa).to(B.dtype).mul_(s) if ctx.needs_B else None
    return dA, dB, dxa


def _flags(ctx, A, B, dt, into_grad):
    ctx.needs_A, ctx.needs_B = A.requires_grad, B.requires_grad
    ctx.into_grad = into_grad and A.dtype == B.dtype == dt and writes_grad_directly(A) and writes_grad_directly(B)


class _LoraLinear(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T over a frozen W, b; the adapter added by the epilogue of one GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias, A, B, scaling, into_grad):
        x2 = x.reshape(-1, x.shape[-1])
        y, xa = _lora_linear_math(x2, weight, bias, A, B, scaling)
        ctx.save_for_backward(x, xa, weight, A, B)
        ctx.scaling = scaling
        _flags(ctx, A, B, x.dtype, into_grad)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, xa, weight, A, B = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dA, dB, dxa = _adapter_grads(ctx, dy2, x2, xa, A, B)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(dy2, weight)
            dx.addmm_(dxa, A.to(dx.dtype))  # dx += s (dY B) A, in the GEMM's epilogue
            dx = dx.view(x.shape)
        return dx, None, None, dA, dB, None, None


def _lora_linear_math(x2, weight, bias, A, B, scaling):
    """(y [N, out], xa [N, r]): the forward of ``_LoraLinear`` on a 2-D input."""
    xa = torch.mm(x2, A.to(x2.dtype).t())
    y = F.linear(x2, weight, bias)  # a fresh tensor: the adapter is added into it in place
    y.addmm_(xa, B.to(x2.dtype).t(), alpha=scaling)
    return y, xa


class _AdapterAdded(torch.autograd.Function):
    """y = base_out + s (x A^T) B^T, for a base layer that runs its own forward and backward (4-bit)."""

    @staticmethod
    def forward(ctx, base_out, x, A, B, scaling, into_grad):
        dt = base_out.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(dt)
        xa = torch.mm(x2, A.to(dt).t())
        y = torch.addmm(base_out.reshape(-1, base_out.shape[-1]), xa, B.to(dt).t(), alpha=scaling)
        ctx.save_for_backward(x, xa, A, B)
        ctx.scaling = scaling
        _flags(ctx, A, B, dt, into_grad)
        return y.view(base_out.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, xa, A, B = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).to(dy.dtype)
        dA, dB, dxa = _adapter_grads(ctx, dy2, x2, xa, A, B)
        dx = torch.mm(dxa, A.to(dy.dtype)).view(x.shape).to(x.dtype) if ctx.needs_input_grad[1] else None
        return dy, dx, dA, dB, None, None


class _FusedLora:
    """The fused forward, mixed in before a peft LoRA class (module docstring); peft's forward otherwise."""

    fused_lora_into_grad: bool = False

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = None if args or kwargs else self._fused_adapter(x)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        scaling, into_grad = float(self.scaling[adapter]), self.fused_lora_into_grad
        base = self.base_layer
        if type(base) is torch.nn.Linear:
            if not torch.is_grad_enabled():
                y, _ = _lora_linear_math(x.reshape(-1, x.shape[-1]), base.weight, base.bias, A, B, scaling)
                return y.view(*x.shape[:-1], y.shape[-1])
            return _LoraLinear.apply(x, base.weight, base.bias, A, B, scaling, into_grad)
        return _AdapterAdded.apply(base(x), x, A, B, scaling, into_grad)

    def _fused_adapter(self, x: torch.Tensor) -> str | None:
        """The one active adapter where the fused forward computes what peft's would, else None."""
        if self.disable_adapters or self.merged or torch.is_autocast_enabled(x.device.type):
            return None
        active = self.active_adapters
        if len(active) != 1 or _adapter_refusal(self, active[0]) is not None:
            return None
        base = self.base_layer
        if type(base) is torch.nn.Linear and (
                x.dtype != base.weight.dtype or any(p.requires_grad for p in base.parameters())):
            return None  # peft's path: its own error for a wrong dtype, autograd's gradient for a trained base
        return active[0]


def _adapter_refusal(layer: torch.nn.Module, adapter: str) -> str | None:
    """Why ``adapter`` of a LoRA layer cannot run fused, or None."""
    if adapter not in layer.lora_A:
        return f"adapter {adapter!r} not on this layer"
    if not isinstance(layer.lora_dropout[adapter], torch.nn.Identity):
        return "dropout > 0"
    if adapter in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(adapter):
        return "a LoRA variant (DoRA, ...)"
    if layer.lora_B[adapter].bias is not None or getattr(layer, "lora_bias", {}).get(adapter):
        return "a bias on lora_B"
    if type(layer.lora_A[adapter]) is not torch.nn.Linear or type(layer.lora_B[adapter]) is not torch.nn.Linear:
        return "adapters that are not nn.Linear"
    return None


def _peft_classes() -> tuple[type, ...]:
    """The peft LoRA layer classes the fused forward extends: Linear, and Linear4bit where peft defines it."""
    from peft.tuners.lora import layer

    try:  # peft's 4-bit layers import bitsandbytes, which a LoRA run without QLoRA need not have
        from peft.tuners.lora import bnb
    except ImportError:
        return (layer.Linear,)
    return tuple(c for c in (layer.Linear, getattr(bnb, "Linear4bit", None)) if c is not None)


def fusion_refusal(layer: torch.nn.Module) -> str | None:
    """Why ``use_fused_lora`` leaves this peft LoRA layer as it is, or None where it swaps it."""
    kind = _PLAIN.get(type(layer), type(layer))
    if kind not in _peft_classes():
        return f"{kind.__name__} is not a peft LoRA Linear or Linear4bit"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out (a Conv1D base)"
    if layer.merged:
        return "adapters merged"
    if len(layer.active_adapters) != 1:
        return f"{len(layer.active_adapters)} active adapters"
    return _adapter_refusal(layer, layer.active_adapters[0])


def _fused_class(kind: type) -> type:
    if kind not in _FUSED:
        fused = type(f"Fused{kind.__name__}", (_FusedLora, kind), {"__module__": __name__})
        _FUSED[kind], _PLAIN[fused] = fused, kind
    return _FUSED[kind]


def _decoder_lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every peft LoRA layer inside the model's decoder layers."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    if not isinstance(layers, torch.nn.ModuleList):
        return []
    inside = {id(m) for layer in layers for m in layer.modules()}
    return [(name, m) for name, m in model.named_modules() if id(m) in inside and isinstance(m, LoraLayer)]


def use_fused_lora(model: torch.nn.Module, *, into_grad: bool = False) -> list[str]:
    """Give each eligible peft LoRA layer of the decoder the fused forward (module docstring); returns their
    names. ``into_grad``: add the adapters' gradients into ``.grad`` inside their matmuls. Idempotent (a
    second call swaps nothing more); ``plain_lora`` undoes it."""
    swapped = []
    for name, module in _decoder_lora_layers(model):
        if type(module) in _PLAIN or fusion_refusal(module) is not None:
            continue
        module.__class__ = _fused_class(type(module))
        module.fused_lora_into_grad = into_grad
        swapped.append(name)
    return swapped


def plain_lora(model: torch.nn.Module) -> list[str]:
    """peft's own classes back where ``use_fused_lora`` swapped; returns the names."""
    names = []
    for name, module in model.named_modules():
        if type(module) in _PLAIN:
            module.__class__ = _PLAIN[type(module)]
            module.__dict__.pop("fused_lora_into_grad", None)
            names.append(name)
    return names


def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with each LoRA layer's adapter merged into its weight, from ``state``, a full
    state dict of the peft ``model`` (gathered from ranks that each hold a shard: the model's own Parameters are
    not whole here, so peft's merge_and_unload cannot run). As peft merges on a CPU: W + s (B A) in float32,
    rounded once to W's dtype. Keys lose peft's ``base_model.model.`` prefix and ``.base_layer``; ValueError for peft
    state this does not merge (another adapter kind, modules_to_save)."""
    from peft.tuners.lora import LoraLayer

    scalings = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            if len(module.active_adapters) != 1 or module.merged:
                raise ValueError(f"{name}: {len(module.active_adapters)} active adapters (or merged): merge one")
            adapter = module.active_adapters[0]
            scalings[name] = (adapter, float(module.scaling[adapter]))
    merged, used = {}, set()
    for key, tensor in state.items():
        module, _, leaf = key.rpartition(".")
        owner = module.removesuffix(".base_layer")
        if owner in scalings and module.endswith(".base_layer") and leaf == "weight":
            adapter, scaling = scalings[owner]
            a, b = (f"{owner}.lora_A.{adapter}.weight", f"{owner}.lora_B.{adapter}.weight")
            delta = (state[b].float() @ state[a].float()) * scaling
            tensor = (tensor.float() + delta).to(tensor.dtype)  # one rounding, as peft's merge on a CPU
            used.update((a, b))
        elif ".lora_" in key or "modules_to_save" in key or "original_module" in key:
            continue  # merged above, or refused below
        merged[key.removeprefix("base_model.model.").replace(".base_layer.", ".")] = tensor
    left = [k for k in state if (".lora_" in k or "modules_to_save" in k) and k not in used]
    if left:
        raise ValueError(f"peft state that is not a LoRA adapter on a linear layer's weight: {left[:3]}")
    return merged
