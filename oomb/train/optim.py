"""Optimizers for `oomb train`: torch AdamW, or bitsandbytes' 8-bit AdamW for smaller states.

Memory per trainable parameter for the two moments: adamw keeps them in the parameter
dtype (2 x 2 bytes in bf16, 2 x 4 in fp32); adamw8bit keeps them as 8-bit blocks with a
float32 scale per 256 values (about 2 bytes in all). paged_adamw8bit keeps the same 8-bit
states in CUDA unified memory, which the driver moves to host memory when the GPU runs
short. bitsandbytes quantizes tensors of 4096 values or more; smaller ones (norms,
biases) keep 32-bit states.
"""

from __future__ import annotations

import torch

from oomb.train.config import ConfigError

OPTIMIZERS = {
    "adamw": "torch.optim.AdamW (states in the parameter dtype)",
    "adamw8bit": "bitsandbytes AdamW8bit (8-bit states; CPU or CUDA)",
    "paged_adamw8bit": "bitsandbytes PagedAdamW8bit (8-bit states in CUDA unified memory; CUDA only)",
}
_CUDA_ONLY = {"paged_adamw8bit"}


def check_optimizer(name: str, device: torch.device) -> None:
    """Refuse an unknown optimizer, a missing library, or a CUDA-only one off CUDA, before work starts."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer={name!r}: choose one of "
                          + "; ".join(f"{k}: {v}" for k, v in OPTIMIZERS.items()))
    if name in _CUDA_ONLY and device.type != "cuda":
        raise ConfigError(f"train.optimizer={name} pages its states through CUDA unified memory and needs a CUDA "
                          f"device (this run uses {device}); on CPU use adamw8bit or adamw")
    if name != "adamw":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"train.optimizer={name} needs the bitsandbytes package: "
                              "pip install bitsandbytes (or pip install 'oomb[lowmem]')") from e


def build_optimizer(name: str, params, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    import bitsandbytes as bnb

    cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
    return cls(params, lr=lr, weight_decay=weight_decay)
