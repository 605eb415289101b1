"""QLoRA: the base model in 4 bits (bitsandbytes NF4) under LoRA adapters, trained through chunked_backward.

    check_quantize(cfg)               model.quantize's value and what it needs: LoRA adapters, one process
    check_quantize_runs(cfg, device)  bitsandbytes (and accelerate, for model.path) installed, and a 4-bit layer
                                      running forward and backward on the run's device
    bnb_config(dtype)                 the BitsAndBytesConfig a model.path folder is loaded with
    quantize_linears(model, dtype)    a built model's linear layers replaced in place by NF4 ones (presets:
                                      random init, then quantized)
    finish_quantized(model)           what both paths share: the flags peft reads, no CPU inference layout
    merged_export_model(model)        the dequantized base with the adapters merged, a plain transformers model

Which layers are 4-bit, and their bytes, is oomb.surgery.quantize (transformers' selection), shared with
the memory plan. The compute dtype is model.dtype (bfloat16 on CUDA by default): bitsandbytes casts a
layer's input to it, so any other choice would add a cast per layer and chunk.

peft's ``prepare_model_for_kbit_training`` is not called, on purpose:

- it casts every 16-bit parameter that is not 4-bit to fp32: embeddings, LM head and norms. transformers'
  RMSNorm returns ``weight * x`` in the weight's dtype, so every hidden state would become fp32, and the
  paged store takes the embeddings' dtype: twice the K/V bytes per token (Qwen2.5-7B: 224 KiB instead of
  112 KiB, with gradient pages), which is what bounds the context. Qwen2.5-7B's embeddings and untied LM
  head (1.09 B parameters) would also take 2.2 GB more. The norms already compute in fp32 inside, and
  frozen weights need no fp32 copy.
- it turns on gradient checkpointing (reentrant by default) and makes the embeddings' output require
  grad for it: oomb's chunked step already keeps one chunk's activations, and train.layer_checkpointing
  is its own switch (non-reentrant, exact inside chunks).
- the rest of what it does, freezing the base, peft's get_peft_model does.
"""

from __future__ import annotations

import copy
import importlib.util

import torch

from oomb.surgery.quantize import QUANTIZE_KINDS, quantized_linear_names
from oomb.train.config.settings import Config, ConfigError

__all__ = ["bnb_config", "check_quantize", "check_quantize_runs", "finish_quantized", "is_quantized",
           "merged_export_model", "quantize_linears"]

# bitsandbytes' settings of QLoRA's NF4: the same for a folder (BitsAndBytesConfig) and a preset (Linear4bit).
_NF4 = dict(quant_type="nf4", compress_statistics=True, quant_storage=torch.uint8)


def check_quantize(cfg: Config) -> None:
    """model.quantize: a known value, with what a 4-bit base needs (checked before anything is built)."""
    kind = cfg.model.quantize
    if kind not in QUANTIZE_KINDS:
        raise ConfigError(f"model.quantize={kind!r}: use none, or nf4 (the base model's linear layers in 4 bits "
                          "under LoRA adapters: QLoRA)")
    if kind == "none":
        return
    if cfg.lora.r == 0:
        raise ConfigError("model.quantize=nf4 keeps the base model's weights in 4 bits, frozen: only LoRA adapters "
                          "can train on them. Set lora.r (e.g. lora.r=16, with lora.targets=all-linear as the QLoRA "
                          "paper does), or model.quantize=none for full fine-tuning")
    if cfg.train.tensor_parallel > 1:
        raise ConfigError(f"model.quantize=nf4 with train.tensor_parallel={cfg.train.tensor_parallel}: 4-bit "
                          "weights are packed blocks that the split over heads cannot cut; run one process "
                          "(train.tensor_parallel=1), or model.quantize=none")


_RUNS_ON: dict[str, str | None] = {}  # device type -> None (4-bit layers run there) or the error


def check_quantize_runs(cfg: Config, device: torch.device) -> None:
    """Refuse model.quantize=nf4 where it cannot run: bitsandbytes missing, accelerate missing for a model.path
    load (transformers needs it), or a bitsandbytes that cannot run a 4-bit layer forward and backward on the
    run's device (bitsandbytes 0.50.2 runs them on CPU and CUDA); tried once per device type."""
    if cfg.model.quantize == "none":
        return
    bnb = _bitsandbytes()
    if cfg.model.path is not None and importlib.util.find_spec("accelerate") is None:
        raise ConfigError("model.quantize=nf4 with model.path loads the folder through transformers' bitsandbytes "
                          "quantizer, which needs accelerate: pip install accelerate (or pip install 'oomb[qlora]')")
    if device.type not in _RUNS_ON:
        try:
            with torch.random.fork_rng(devices=[]):  # the layer's init draws from the CPU generator: not the run's
                layer = bnb.nn.Linear4bit(128, 64, bias=False, compute_dtype=torch.float32, **_NF4).to(device)
            x = torch.linspace(-1, 1, 256, device=device).reshape(2, 128).requires_grad_()
            layer(x).sum().backward()
            _RUNS_ON[device.type] = None if x.grad is not None else "no gradient reached the layer's input"
        except (RuntimeError, NotImplementedError, ValueError, AssertionError) as e:
            _RUNS_ON[device.type] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if (error := _RUNS_ON[device.type]) is not None:
        raise ConfigError(f"model.quantize=nf4: bitsandbytes {bnb.__version__} cannot run a 4-bit layer on "
                          f"{device.type} ({error}). bitsandbytes 0.50.2 runs them on CPU and CUDA: pip install -U "
                          "bitsandbytes; or model.quantize=none")


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as e:
        raise ConfigError("model.quantize=nf4 needs the bitsandbytes package: pip install bitsandbytes (or pip "
                          "install 'oomb[qlora]'); or model.quantize=none") from e
    return bitsandbytes


def bnb_config(dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for QLoRA's NF4, computing in ``dtype`` (the model's)."""
    _bitsandbytes()
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=_NF4["quant_type"],
                              bnb_4bit_use_double_quant=_NF4["compress_statistics"],
                              bnb_4bit_quant_storage=_NF4["quant_storage"], bnb_4bit_compute_dtype=dtype)


def quantize_linears(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Replace the linear layers transformers would quantize (oomb.surgery.quantize) by NF4 ``Linear4bit``
    layers computing in ``dtype``, each quantized on its weight's device from that weight: the same layers
    and bytes as ``from_pretrained`` with bnb_config(dtype) makes of the same weights. Returns their names.

    One layer at a time: the 16-bit weight of a layer is freed as its 4-bit one replaces it, so the peak
    is the 16-bit model's (a preset is built whole in model.dtype first).
    """
    bnb = _bitsandbytes()
    names = quantized_linear_names(model)
    for name in names:
        linear = model.get_submodule(name)
        with torch.device("meta"):
            layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      compute_dtype=dtype, **_NF4)
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, module=layer,
                                         **_NF4).to(linear.weight.device)  # .to quantizes
        if linear.bias is not None:
            layer.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
        model.set_submodule(name, layer)
    return names


def finish_quantized(model: torch.nn.Module) -> None:
    """What a 4-bit model needs before LoRA and training, however it was quantized.

    peft gives a layer its 4-bit LoRA wrapper only when the model says it is loaded in 4 bits (transformers
    sets it for a folder, nobody for a preset). On a CPU with AVX512-BF16, bitsandbytes rewrites a 4-bit
    weight into an inference layout the first time the layer runs in eval mode without gradients (an
    evaluation, a validation pass); after that it multiplies through a kernel autograd does not see, so
    the training steps that follow would get no gradient through the layer: turned off for every layer.
    """
    import bitsandbytes as bnb

    model.is_loaded_in_4bit = model.is_quantized = True
    model.quantization_method = "bitsandbytes"
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a transformers or peft model) holds a 4-bit base."""
    return bool(getattr(model, "is_loaded_in_4bit", False))


def merged_export_model(model: torch.nn.Module) -> torch.nn.Module:
    """The export of a QLoRA model with lora.merge_on_export: a plain transformers model, on the CPU, in the
    model's dtype, whose linear weights are the 4-bit base dequantized with the adapters' updates added (in fp32,
    then rounded once). It computes what the trained model computed, not the original 16-bit base plus the
    adapters: the base's quantization error stays in. The training model is left as it is.
    """
    import bitsandbytes as bnb
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoModelForCausalLM

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    dtype = base.get_input_embeddings().weight.dtype
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):  # the export is plain: from_pretrained must not quantize it
        delattr(config, "quantization_config")
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {}
    for key in plain.state_dict():
        owner, _, name = key.rpartition(".")
        module = base.get_submodule(owner)
        layer = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
        value = getattr(layer, name)
        if isinstance(layer, bnb.nn.Linear4bit) and name == "weight":
            value = bnb.functional.dequantize_4bit(value.data, value.quant_state)
        if isinstance(module, BaseTunerLayer) and name == "weight":  # one device weight at a time, in fp32
            value = value.float() + sum(module.get_delta_weight(a).float() for a in module.active_adapters)
        state[key] = value.detach().to("cpu", dtype)
    plain.load_state_dict(state, assign=True)
    plain.tie_weights()
    buffers = dict(base.named_buffers())
    for key, buffer in list(plain.named_buffers()):  # the non-persistent ones (RoPE's) are not in the state dict
        if buffer.is_meta and key in buffers:
            owner, _, name = key.rpartition(".")
            plain.get_submodule(owner).register_buffer(name, buffers[key].detach().to("cpu"), persistent=False)
    return plain
