"""The device a run trains on, from its name in the config (train.device): what a single process and the
context of a run (oomb.train.loop.distributed.setup) both start from."""

from __future__ import annotations

import torch

from oomb.train.config.settings import ConfigError


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """``auto`` -> cuda when visible, else cpu; ``option`` names the setting in error messages."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"{option} {name!r} is not a device name (use auto, cpu, cuda or cuda:N)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        sep = "=" if option.startswith("train.") else " "
        raise ConfigError(f"{option} asks for CUDA but no CUDA device is visible; use {option}{sep}cpu")
    return device
