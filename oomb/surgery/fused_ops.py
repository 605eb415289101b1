"""liger-kernel's fused RMSNorm, SwiGLU and RoPE for a transformers model.

A transformers RMSNorm in bf16 runs about six elementwise kernels and a reduction forward
(cast to fp32, square, mean, rsqrt, scale, cast back, weight) and more backward; its MLP's
``act_fn(gate) * up`` two forward and four backward. Every one of them reads and writes the
chunk's whole activation, and a chunked step runs each layer's forward twice (stage 1 and
the recomputation). liger-kernel does each in one Triton kernel per direction.

``use_fused_ops`` replaces module instances (never classes or forward methods, so other
models in the process are untouched): each RMSNorm of a Llama-family model becomes a
``LigerRMSNorm`` holding the SAME weight Parameter, each SiLU-gated MLP a ``LigerSwiGLUMLP``
holding the SAME projection modules. Parameter names, ``state_dict`` keys, optimizer state,
peft adapters on the projections and ``save_pretrained`` output are unchanged.

RoPE is no module: the attention forward calls its modeling module's ``apply_rotary_pos_emb``, about
ten elementwise kernels per direction over q and k in their transposed [B, H, C, D] views (0.34 s of
a 64K step of Qwen2.5-7B on an H200 against liger's 0.09 s). ``use_fused_rope`` points that
module function at liger's kernel, as liger's own ``apply_liger_kernel_to_*(rope=True)`` does: every
model of that family in the process gets it (the same rotation, rounded once instead of per op), and
``plain_rope`` puts transformers' function back.

Only module types whose arithmetic liger reproduces are swapped: RMSNorms computing
``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` (liger's "llama"
casting) and MLPs ``down(silu(gate(x)) * up(x))``. Other models (Gemma's
``1 + weight`` norms, GPT-OSS's clamped experts, ...) keep their modules.
"""

from __future__ import annotations

import torch

# transformers classes with the RMSNorm arithmetic above, and SwiGLU MLPs (gate_proj, up_proj,
# down_proj, act_fn from config.hidden_act). Qwen3's q_norm / k_norm are Qwen3RMSNorm too.
_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
_SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_SILU = ("silu", "swish")
# model_type -> the modeling module whose attention calls apply_rotary_pos_emb(q, k, cos, sin): rotate-half
# RoPE over the whole head, the rotation liger's rope kernel computes.
_ROPE_MODULES = {t: f"transformers.models.{t}.modeling_{t}" for t in ("llama", "mistral", "qwen2", "qwen3")}
_PLAIN_ROPE: dict[str, object] = {}  # model_type -> transformers' own function, while liger's is in place
MODES = ("auto", "liger", "none")


def liger_available() -> bool:
    try:
        import liger_kernel.transformers.rms_norm  # noqa: F401
        import liger_kernel.transformers.swiglu  # noqa: F401
    except ImportError:
        return False
    return True


def _fused_rms_norm(norm: torch.nn.Module) -> torch.nn.Module:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    # in_place=False: liger's in-place backward writes dX over dY, which autograd may still hold.
    fused = LigerRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon, casting_mode="llama", in_place=False)
    fused.weight = norm.weight
    return fused


def _fused_mlp(mlp: torch.nn.Module) -> torch.nn.Module:
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    with torch.device("meta"):  # its own projections are replaced at once: allocate nothing
        fused = LigerSwiGLUMLP(mlp.config, intermediate_size=mlp.gate_proj.out_features)
    fused.gate_proj, fused.up_proj, fused.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    return fused


def _swappable_mlp(module: torch.nn.Module) -> bool:
    # The projections (biases, peft adapters) run as they are; only act_fn(gate) * up is fused.
    config = getattr(module, "config", None)
    return config is not None and getattr(config, "hidden_act", None) in _SILU


def use_fused_rope(model: torch.nn.Module) -> str | None:
    """liger's RoPE kernel for ``model``'s family (module docstring); returns the model type, or None where
    the family's RoPE is not the rotation liger computes."""
    import importlib

    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _ROPE_MODULES:
        return None
    module = importlib.import_module(_ROPE_MODULES[model_type])
    plain = _PLAIN_ROPE.setdefault(model_type, module.apply_rotary_pos_emb)

    def rope_on_cuda(q, k, cos, sin, *args, **kwargs):
        # The module function serves every model of the family in the process, on any device: liger's Triton
        # kernel runs on CUDA tensors only (oomb's check of an architecture trains a tiny copy on the CPU).
        if q.is_cuda:
            return liger_rotary_pos_emb(q, k, cos, sin, *args, **kwargs)
        return plain(q, k, cos, sin, *args, **kwargs)

    module.apply_rotary_pos_emb = rope_on_cuda
    return model_type


def plain_rope() -> None:
    """transformers' own RoPE back in every family ``use_fused_rope`` changed."""
    import importlib

    for model_type, function in _PLAIN_ROPE.items():
        importlib.import_module(_ROPE_MODULES[model_type]).apply_rotary_pos_emb = function
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
    """Swap liger's fused RMSNorm / SwiGLU modules into ``model`` in place (``swap_fused_modules``) and route
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
    """The swap itself, wherever the model is (its forward then needs CUDA): each RMSNorm and SiLU-gated
    MLP of the supported types replaced by liger's module on the same Parameters; returns their names."""
    swapped = []
    # Collect first: replacing children while walking named_modules would visit the new modules.
    targets = [(name, module) for name, module in model.named_modules()
               if type(module).__name__ in _RMS_NORMS
               or (type(module).__name__ in _SWIGLU_MLPS and _swappable_mlp(module))]
    for name, module in targets:
        fused = _fused_rms_norm(module) if type(module).__name__ in _RMS_NORMS else _fused_mlp(module)
        fused.train(module.training)
        model.set_submodule(name, fused)
        swapped.append(name)
    return swapped
