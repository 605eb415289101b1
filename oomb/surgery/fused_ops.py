"""liger-kernel's fused RMSNorm, gated MLP and RoPE for a transformers model.

A transformers RMSNorm in bf16 runs about six elementwise kernels and a reduction forward
(cast to fp32, square, mean, rsqrt, scale, cast back, weight) and more backward; its MLP's
``act_fn(gate) * up`` two forward and four backward. Every one of them reads and writes the
chunk's whole activation, and a chunked step runs each layer's forward twice (stage 1 and
the recomputation). liger-kernel does each in one Triton kernel per direction.

``use_fused_ops`` replaces module instances (never classes or forward methods, so other
models in the process are untouched): each RMSNorm of a supported type becomes a
``LigerRMSNorm`` holding the SAME weight Parameter, each gated MLP a ``LigerSwiGLUMLP`` or
``LigerGEGLUMLP`` holding the SAME projection modules. Parameter names, ``state_dict`` keys,
optimizer state, peft adapters on the projections and ``save_pretrained`` output are unchanged.

RoPE is no module: the attention forward calls its modeling module's ``apply_rotary_pos_emb``, about
ten elementwise kernels per direction over q and k in their transposed [B, H, C, D] views (0.34 s of
a 64K step of Qwen2.5-7B on an H200 against liger's 0.09 s). ``use_fused_rope`` points that
module function at liger's kernel, as liger's own ``apply_liger_kernel_to_*(rope=True)`` does: every
model of that family in the process gets it (the same rotation, rounded once instead of per op), and
``plain_rope`` puts transformers' function back.

Only module types whose arithmetic liger reproduces are swapped (``_RMS_NORMS``, ``_GATED_MLPS``,
``_ROPES``; liger-kernel 0.8.5, transformers 5.17):

- RMSNorms ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` (Llama, Mistral,
  Qwen2, Qwen3, Granite): liger's "llama" casting, the weight multiplied in the input dtype;
  GPT-OSS's ``(weight * normed_fp32).to(x.dtype)``: "gemma" casting (all in fp32, one cast at the
  end), offset 0 -- not the "llama" casting liger's own ``apply_liger_kernel_to_gpt_oss`` gives it;
  Gemma-3's ``(normed_fp32 * (1 + weight.float())).to(x.dtype)``: "gemma" casting, offset 1.
- MLPs ``down(silu(gate(x)) * up(x))`` (SwiGLU) and Gemma-3's ``down(gelu_tanh(gate(x)) * up(x))``
  (GEGLU; liger's kernel is torch's ``gelu(approximate="tanh")``, gelu_pytorch_tanh, and nothing else).
- RoPE rotating the halves of the whole head (rotate-half): the families above, GPT-OSS through
  ``liger_rotary_pos_emb_gpt_oss`` (its cos/sin are half the head wide).

Other modules keep transformers' arithmetic: GPT-OSS's experts (a clamped, offset GLU), Gemma-3's
MLP with another activation, and every family not in the tables (LayerNorms, Gemma 1/2, OLMo, ...).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class _Norm(NamedTuple):
    """The ``LigerRMSNorm`` computing a transformers RMSNorm class's arithmetic (liger_kernel/ops/rms_norm.py)."""

    casting_mode: str  # "llama": x and rstd in fp32, cast back before the weight; "gemma": all fp32, cast last
    offset: float  # liger multiplies by (offset + weight)
    eps: str  # the attribute holding the class's epsilon


_LLAMA_NORM = _Norm("llama", 0.0, "variance_epsilon")
# transformers RMSNorm class -> its liger construction. Qwen3's and Gemma-3's q_norm / k_norm are their RMSNorm classes.
_RMS_NORMS = {
    **dict.fromkeys(("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "GraniteRMSNorm"), _LLAMA_NORM),
    # (weight * normed_fp32).to(dtype): the weight multiplies in fp32 (promoted), so liger's "gemma" casting
    "GptOssRMSNorm": _Norm("gemma", 0.0, "variance_epsilon"),
    # (normed_fp32 * (1.0 + weight.float())).to(dtype), eps kept as `eps`
    "Gemma3RMSNorm": _Norm("gemma", 1.0, "eps"),
}


class _Mlp(NamedTuple):
    """The liger module computing ``down(act(gate(x)) * up(x))`` for a transformers MLP class."""

    liger: str  # "swiglu" (LigerSwiGLUMLP) or "geglu" (LigerGEGLUMLP)
    act_attr: str  # the config attribute the class builds its act_fn from
    acts: tuple[str, ...]  # the activations liger's kernel computes


_SWIGLU = _Mlp("swiglu", "hidden_act", ("silu", "swish"))
# transformers MLP class (gate_proj, up_proj, down_proj, act_fn from the config) -> its liger module
_GATED_MLPS = {
    **dict.fromkeys(("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GraniteMLP"), _SWIGLU),
    # LigerGEGLUMLP reads no activation: it always computes the tanh form, so only gelu_pytorch_tanh matches
    "Gemma3MLP": _Mlp("geglu", "hidden_activation", ("gelu_pytorch_tanh",)),
}


class _Rope(NamedTuple):
    module: str  # the modeling module whose attention calls apply_rotary_pos_emb(q, k, cos, sin)
    liger: str  # the function of liger_kernel.transformers.rope computing the same rotation


def _modeling(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


# model_type -> its RoPE. Rotate-half over the whole head with cos/sin as wide as the head: liger_rotary_pos_emb
# (rotary_dim = cos's width). Gemma-3's text model and the multimodal one share modeling_gemma3. GPT-OSS rotates the
# halves too, but its cos/sin are half the head wide: liger_rotary_pos_emb_gpt_oss passes rotary_dim = head_dim.
_ROPES = {
    **{t: _Rope(_modeling(t), "liger_rotary_pos_emb") for t in ("llama", "mistral", "qwen2", "qwen3", "granite")},
    **dict.fromkeys(("gemma3", "gemma3_text"), _Rope(_modeling("gemma3"), "liger_rotary_pos_emb")),
    "gpt_oss": _Rope(_modeling("gpt_oss"), "liger_rotary_pos_emb_gpt_oss"),
}
# modeling module -> transformers' own function while liger's is in place (per module, not per model type: two
# model types sharing a module must not keep the routed function as the "plain" one)
_PLAIN_ROPE: dict[str, object] = {}
MODES = ("auto", "liger", "none")


def liger_available() -> bool:
    try:
        import liger_kernel.transformers.geglu  # noqa: F401
        import liger_kernel.transformers.rms_norm  # noqa: F401
        import liger_kernel.transformers.swiglu  # noqa: F401
    except ImportError:
        return False
    return True


def _fused_rms_norm(norm: torch.nn.Module, recipe: _Norm) -> torch.nn.Module:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    # in_place=False: liger's in-place backward writes dX over dY, which autograd may still hold.
    fused = LigerRMSNorm(norm.weight.shape[0], eps=getattr(norm, recipe.eps), offset=recipe.offset,
                         casting_mode=recipe.casting_mode, in_place=False)
    fused.weight = norm.weight
    return fused


def _fused_mlp(mlp: torch.nn.Module, recipe: _Mlp) -> torch.nn.Module:
    from liger_kernel.transformers.geglu import LigerGEGLUMLP
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    with torch.device("meta"):  # its own projections are replaced at once: allocate nothing
        if recipe.liger == "swiglu":
            fused = LigerSwiGLUMLP(mlp.config, intermediate_size=mlp.gate_proj.out_features)
        else:
            fused = LigerGEGLUMLP(mlp.config)  # sized by the config; the width is the projections' below
            fused.intermediate_size = mlp.gate_proj.out_features
    fused.gate_proj, fused.up_proj, fused.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    return fused


def _swappable_mlp(module: torch.nn.Module, recipe: _Mlp) -> bool:
    # The projections (biases, peft adapters) run as they are; only act_fn(gate) * up is fused.
    config = getattr(module, "config", None)
    return config is not None and getattr(config, recipe.act_attr, None) in recipe.acts


def _fused_module(module: torch.nn.Module) -> torch.nn.Module | None:
    """liger's module computing ``module``'s arithmetic on its Parameters, or None where the tables have none."""
    kind = type(module).__name__
    if kind in _RMS_NORMS:
        fused = _fused_rms_norm(module, _RMS_NORMS[kind])
    elif kind in _GATED_MLPS and _swappable_mlp(module, _GATED_MLPS[kind]):
        fused = _fused_mlp(module, _GATED_MLPS[kind])
    else:
        return None
    fused.train(module.training)
    return fused


def use_fused_rope(model: torch.nn.Module) -> str | None:
    """liger's RoPE kernel for ``model``'s family (module docstring); returns the model type, or None where
    the family's RoPE is not a rotation liger computes."""
    import importlib

    from liger_kernel.transformers import rope as liger_rope

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _ROPES:
        return None
    rope = _ROPES[model_type]
    module = importlib.import_module(rope.module)
    plain = _PLAIN_ROPE.setdefault(rope.module, module.apply_rotary_pos_emb)
    fused = getattr(liger_rope, rope.liger)

    def rope_on_cuda(q, k, cos, sin, unsqueeze_dim=1):
        # The module function serves every model of the family in the process, on any device: liger's Triton
        # kernel runs on CUDA tensors only (oomb's check of an architecture trains a tiny copy on the CPU), and
        # reads q and k as [B, H, T, D] (unsqueeze_dim 1, as every attention of these families calls it).
        if q.is_cuda and unsqueeze_dim == 1:
            return fused(q, k, cos, sin)
        return plain(q, k, cos, sin, unsqueeze_dim)

    module.apply_rotary_pos_emb = rope_on_cuda
    return model_type


def plain_rope() -> None:
    """transformers' own RoPE back in every family ``use_fused_rope`` changed."""
    import importlib

    for module, function in _PLAIN_ROPE.items():
        importlib.import_module(module).apply_rotary_pos_emb = function
    _PLAIN_ROPE.clear()


def run_mode(mode: str, tensor_parallel: int) -> str:
    """The fused-ops mode a run applies: ``mode``, or "none" where the heads are split over ranks (the split
    layers run transformers' own modules)."""
    return mode if tensor_parallel == 1 else "none"


def will_fuse(mode: str, device_type: str) -> bool:
    """Whether ``use_fused_ops(model, mode)`` swaps modules for a model on ``device_type`` (the memory plan asks
    before the model exists; "liger" without liger-kernel is an error there, counted as fused here)."""
    return device_type == "cuda" and (mode == "liger" or (mode == "auto" and liger_available()))


def use_fused_ops(model: torch.nn.Module, mode: str = "auto") -> list[str]:
    """Swap liger's fused RMSNorm / gated MLP modules into ``model`` in place (``swap_fused_modules``) and route
    its family's RoPE through liger's kernel (``use_fused_rope``); returns the swapped module names, and
    "rope" where RoPE was routed.

    ``mode``: "auto" (on a CUDA model when liger-kernel is installed), "liger" (required: an error
    without liger-kernel or on a model off CUDA) or "none" (nothing). liger 0.8.5's kernels do not
    run in Triton's CPU interpreter (they call ``.to`` on float arguments), so CPU models keep
    transformers' modules.
    """
    if mode not in MODES:
        raise ValueError(f"fused ops mode {mode!r}: use one of {', '.join(MODES)}")
    if mode == "none":
        return []
    if not liger_available():
        if mode == "liger":
            raise ImportError("fused ops 'liger' need liger-kernel: pip install liger-kernel")
        return []
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        if mode == "liger":
            raise ValueError("fused ops 'liger' run liger's Triton kernels: the model must be on a CUDA device")
        return []
    swapped = swap_fused_modules(model)
    return swapped + (["rope"] if use_fused_rope(model) is not None else [])


def swap_fused_modules(model: torch.nn.Module) -> list[str]:
    """The swap itself, wherever the model is (its forward then needs CUDA): each RMSNorm and gated MLP of the
    supported types (``_RMS_NORMS``, ``_GATED_MLPS``) replaced by liger's module on the same Parameters; returns
    their names."""
    # Collect first: replacing children while walking named_modules would visit the new modules.
    targets = [(name, fused) for name, module in model.named_modules() if (fused := _fused_module(module)) is not None]
    for name, fused in targets:
        model.set_submodule(name, fused)
    return [name for name, _ in targets]
