"""4-bit base weights (QLoRA): which linear layers bitsandbytes' NF4 replaces, and the bytes they take.

The selection is transformers' own (its bitsandbytes quantizer): every plain ``torch.nn.Linear`` but
the output embedding, tied weights, the module of the model's last parameter and the model's
``_keep_in_fp32_modules``. Embeddings, norms, biases, the LM head and anything that is not an
``nn.Linear`` (GPT-OSS's expert tensors, its router) keep the model's dtype. A model folder loaded
with ``from_pretrained(quantization_config=...)``, a preset quantized by oomb.train.loop.quantize and the
memory plan therefore agree on what is 4-bit (tests/train/test_qlora.py compares them).

NF4 with double quantization (QLoRA's setting; bitsandbytes 0.50.2), for a weight of n values:

    packed codes               ceil(n / 2) B               two 4-bit codes per uint8
    absmax, one per 64 values  ceil(n / 64) B              themselves quantized to 8 bits
    their absmax, one per 256  4 * ceil(ceil(n / 64) / 256) B   float32
    code tables                64 B + 1024 B               16 NF4 levels, 256 8-bit levels (float32)
    offset                     4 B                         the mean taken off the absmax before quantizing

0.516 B per value (0.5 + 1/64 + 1/4096), against 2 B in bf16; each tensor's tables are its own
(bitsandbytes creates them per tensor). On the GPU the caching allocator rounds each of the small
tensors up to 512 B: about 2.5 KiB per quantized tensor, 0.5 MiB for Qwen2.5-7B's 196, not counted.
"""

from __future__ import annotations

import torch

QUANTIZE_KINDS = ("none", "nf4")
NF4_BLOCK = 64  # values per absmax (bitsandbytes' 4-bit blocksize on CUDA and CPU)
NESTED_BLOCK = 256  # absmax values per float32 absmax of the double quantization
_TABLE_BYTES = 16 * 4 + 256 * 4 + 4  # the NF4 code, the 8-bit absmax code, the offset


def nf4_weight_bytes(numel: int) -> int:
    """Bytes of one weight of ``numel`` values in NF4 with double quantization (see the module docstring)."""
    blocks = -(-numel // NF4_BLOCK)
    return -(-numel // 2) + blocks + 4 * -(-blocks // NESTED_BLOCK) + _TABLE_BYTES


def quantized_linear_names(model: torch.nn.Module) -> list[str]:
    """Names of the modules of a transformers model that a 4-bit bitsandbytes load replaces, as transformers
    selects them (works on the meta device)."""
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return [name for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and should_convert_module(name, keep)]
