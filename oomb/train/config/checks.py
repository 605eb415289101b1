"""Checks a run makes before any work: settings, devices and dtypes, the model folder.

Every failure raises ConfigError with the key to change; nothing is built or written before.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch

from oomb.engine.layer_recompute import RECOMPUTE_MODES
from oomb.kernels import BACKEND_NAMES, flash4_unavailable
from oomb.surgery.fused_ops import MODES as FUSED_OPS_MODES
from oomb.surgery.fused_ops import liger_available
from oomb.train.config.bounded import read_json
from oomb.train.config.demo import settle_shape
from oomb.train.config.device import resolve_device
from oomb.train.config.hub import model_folder
from oomb.train.config.presets import preset_names
from oomb.train.config.rope import check_rope
from oomb.train.config.settings import Config, ConfigError
from oomb.train.config.step import gpu_memory_cap, offload_gpu_bytes, page_selection
from oomb.train.loop.optim import wants_master_weights
from oomb.train.loop.quantize import check_quantize
from oomb.train.loop.reporting import check_report_to
from oomb.train.loop.schedule import check_schedule_values

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def check_config(cfg: Config) -> None:
    """Everything that can be checked before a model is built (floats are finite already: load_config)."""
    settle_shape(cfg)  # a Config built in Python: its auto sizes (load_config settles them too)
    t = cfg.train
    if t.final_eval_samples != "auto" and (isinstance(t.final_eval_samples, str) or t.final_eval_samples < 0):
        raise ConfigError(f"train.final_eval_samples={t.final_eval_samples!r}: use auto (100, fewer for a short run), "
                          "a number of held-out sequences, or 0 for none")
    for name, value in (("train.steps", t.steps), ("train.batch_size", t.batch_size),
                        ("train.grad_accum", t.grad_accum), ("train.page_size", t.page_size),
                        ("data.seq_len", cfg.data.seq_len), ("train.tensor_parallel", t.tensor_parallel),
                        ("data.passkey_digits", cfg.data.passkey_digits)):
        if isinstance(value, str):  # the keys whose auto is settled by now
            raise ConfigError(f"{name}={value!r}: use a whole number or auto")
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if cfg.data.seq_len < 2:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len}: a sequence needs at least 2 tokens (one to read, one to "
                          "predict); use data.seq_len >= 2")
    if t.chunk_size != "auto":
        if not isinstance(t.chunk_size, int) or isinstance(t.chunk_size, bool) or t.chunk_size <= 0:
            raise ConfigError(f"train.chunk_size={t.chunk_size!r}: use auto (the memory plan picks the fastest that "
                              f"fits) or a positive multiple of train.page_size={t.page_size}")
        if t.chunk_size % t.page_size:
            near = max(t.page_size, round(t.chunk_size / t.page_size) * t.page_size)
            raise ConfigError(f"train.chunk_size={t.chunk_size} must be a multiple of train.page_size={t.page_size}: "
                              f"try train.chunk_size={near}, or auto")
    if t.save_every < 0 or t.keep_last < 0:
        raise ConfigError(f"train.save_every and train.keep_last must be >= 0, got {t.save_every}, {t.keep_last}")
    if t.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(f"train.on_nonfinite={t.on_nonfinite!r}: use stop or skip")
    wants_master_weights(t.master_weights, torchrun=False)  # the value (torchrun's refusal: distributed.setup)
    _check_ranges(cfg)
    if cfg.model.path is None and cfg.model.preset not in preset_names():
        raise ConfigError(f"unknown model preset {cfg.model.preset!r}; built-in presets: {', '.join(preset_names())}")
    try:
        check_rope(cfg.model.rope)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    page_selection(cfg)  # page-sparse attention settings
    check_quantize(cfg)  # model.quantize: needs LoRA, one process
    if not (t.cache_attention is True or t.cache_attention is False or t.cache_attention in ("auto", "host")):
        raise ConfigError(f"train.cache_attention={t.cache_attention!r}: use auto (on where the memory plan fits "
                          "with it), true, host (in pinned host memory) or false")
    offload_gpu_bytes(t.offload_gpu_memory)  # a byte count or auto (ConfigError otherwise)
    gpu_memory_cap(cfg)  # train.gpu_memory: the same
    _check_fused_ops(cfg)
    _check_attention(cfg)
    check_report_to(cfg)
    if t.recompute not in ("auto", *RECOMPUTE_MODES):
        raise ConfigError(f"train.recompute={t.recompute!r}: use auto, {', '.join(RECOMPUTE_MODES)}")
    if t.recompute in ("layer", "layer-host") and t.layer_checkpointing:
        raise ConfigError(f"train.recompute={t.recompute} rebuilds one layer at a time from the inputs stage 1 kept: "
                          "not with train.layer_checkpointing=true (set train.recompute=chunk)")
    if t.cache_attention is True and t.offload:
        raise ConfigError("train.cache_attention=true keeps attention outputs on the GPU for stage 2 and "
                          "train.offload=true needs the GPU's memory for pages: set train.cache_attention=host "
                          "(in host memory) or false")


def check_model(cfg: Config) -> None:
    """The model before anything is built or written: its folder (check_model_path), then its architecture."""
    check_model_path(cfg)
    check_architecture(cfg)


def check_architecture(cfg: Config) -> None:
    """Refuse a model oomb cannot train exactly: its architecture is checked on a tiny random copy of its config
    (oomb.engine.support), which takes about a second once per config. After check_model_path (the folder, and
    whether its code may run)."""
    from oomb.engine.step import check_architecture
    from oomb.engine.support import UnsupportedModel
    from oomb.train.data.inputs import model_config

    try:
        check_architecture(model_config(cfg), trust_remote_code=cfg.model.trust_remote_code)
    except UnsupportedModel as e:
        raise ConfigError(f"{e}. docs/models.md lists the models oomb trains and why others are refused") from None


def _check_ranges(cfg: Config) -> None:
    """The ranges where the numbers mean something: outside them a run fails later or trains nothing."""
    t = cfg.train
    lr, warmup_steps = check_schedule_values(cfg)  # auto ones as they resolve
    if not 0 < lr <= 1:
        raise ConfigError(f"train.lr={lr:g} must be in (0, 1]: AdamW moves every weight by about the learning "
                          "rate each step (fine-tuning uses 1e-5 to 1e-4, pre-training about 3e-4)")
    if t.weight_decay < 0 or lr * t.weight_decay >= 1:
        raise ConfigError(f"train.weight_decay={t.weight_decay:g} must be >= 0 with train.lr * train.weight_decay "
                          "< 1 (each step multiplies the weights by 1 - lr * weight_decay); 0.0 to 0.1 is usual")
    if warmup_steps < 0 or t.grad_clip < 0 or not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("train.warmup_steps and train.grad_clip must be >= 0 and train.min_lr_ratio in [0, 1], "
                          f"got {warmup_steps}, {t.grad_clip:g}, {t.min_lr_ratio:g}")
    if not 0 <= t.seed < 2**63:
        raise ConfigError(f"train.seed={t.seed} must be in [0, 2**63)")
    if cfg.lora.r < 0:
        raise ConfigError(f"lora.r={cfg.lora.r} must be >= 0 (0 = full fine-tuning, 8 to 64 for LoRA adapters)")
    d = cfg.data
    if not 0 <= d.val_fraction < 1 or t.val_every < 0 or t.val_batches < 1:
        raise ConfigError(f"data.val_fraction must be in [0, 1), train.val_every >= 0 and train.val_batches >= 1, "
                          f"got {d.val_fraction:g}, {t.val_every}, {t.val_batches}")
    if cfg.lora.alpha <= 0:
        raise ConfigError(f"lora.alpha={cfg.lora.alpha:g} must be > 0 (the adapters' update is scaled by alpha / r)")


def _check_attention(cfg: Config) -> None:
    t = cfg.train
    if t.attention not in BACKEND_NAMES:
        raise ConfigError(f"train.attention={t.attention!r}: use one of {', '.join(BACKEND_NAMES)}")
    if t.attention == "fa4":
        if resolve_device(t.device).type != "cuda":
            raise ConfigError("train.attention=fa4 runs FlashAttention-4's CUDA kernels: it needs a CUDA device; "
                              "use train.attention=auto")
        if (reason := flash4_unavailable()) is not None:
            raise ConfigError(f"train.attention=fa4: {reason}; or train.attention=auto")


def _check_fused_ops(cfg: Config) -> None:
    t = cfg.train
    if t.fused_ops not in FUSED_OPS_MODES:
        raise ConfigError(f"train.fused_ops={t.fused_ops!r}: use one of {', '.join(FUSED_OPS_MODES)}")
    if t.fused_ops != "liger":
        return
    if t.tensor_parallel > 1:
        raise ConfigError("train.fused_ops=liger is not supported with train.tensor_parallel > 1 (not tested on "
                          "split layers): use train.fused_ops=auto, which leaves split models as they are")
    if not liger_available():
        raise ConfigError("train.fused_ops=liger needs liger-kernel: pip install liger-kernel, or train.fused_ops=auto")
    if resolve_device(t.device).type != "cuda":
        raise ConfigError("train.fused_ops=liger runs liger's Triton kernels: it needs a CUDA device (they do not "
                          "run in Triton's CPU interpreter); use train.fused_ops=auto")


def check_model_path(cfg: Config) -> None:
    """model.path is a Hugging Face folder, or hub id, whose code (if it ships any) the user said to trust, whose
    config.json is JSON within oomb.train.config.bounded's limits, and whose weights are not pickled (check_weights).

    A hub id's config and tokenizer files are fetched into the cache here (not yet its weights).
    """
    if cfg.model.path is None:
        return
    path = model_folder(cfg.model.path, weights=False)
    if not path.is_dir():
        raise ConfigError(f"model.path={cfg.model.path!r} is a file: give a Hugging Face model folder or hub id")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r} has no config.json: not a Hugging Face model folder")
    check_remote_code(path, cfg.model.trust_remote_code)
    check_weights(path, cfg.model.path)


# transformers' names for pickled PyTorch weights: one file, or shards.
_PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model-*.bin")


def check_weights(path: Path, name: str, key: str = "model.path") -> None:
    """Refuse a model folder whose weights are pickled (pytorch_model*.bin) with no safetensors beside them.

    Unpickling can run code; transformers reads such files with torch.load(weights_only=True), which refuses
    anything but tensors with an UnpicklingError deep in the load. oomb reads a local folder's weights from
    safetensors only, and says so before any work. (A hub id's snapshot holds only its config files at this point;
    oomb.train.config.hub fetches .bin weights only where the repository has no safetensors.)
    """
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return
    pickled = sorted(p.name for pattern in _PICKLED_WEIGHTS for p in path.glob(pattern))
    if not pickled:
        return
    shown = ", ".join(pickled[:2]) + (f" and {len(pickled) - 2} more" if len(pickled) > 2 else "")
    raise ConfigError(
        f"{key}={name!r} holds its weights as pickled PyTorch files ({shown}) and no .safetensors: oomb loads a "
        "folder's weights from safetensors only (unpickling a file can run code in it). Convert them once, where you "
        "trust the file: python -c \"import sys, transformers as t; t.AutoModelForCausalLM.from_pretrained(sys.argv[1])"
        f".save_pretrained(sys.argv[1])\" {shlex.quote(str(path))} (it writes model.safetensors beside them), "
        "then run again")


def check_remote_code(path: Path, trusted: bool, *, how: str = "model.trust_remote_code=true on the command line"
                      ) -> None:
    """Refuse a model folder that needs its own Python code unless trusted (``how`` says how to trust it)."""
    try:
        fields = read_json(path / "config.json")  # within bounded's size and nesting limits
    except (OSError, ValueError) as e:  # ValueError: TooLarge, TooDeep, UnicodeDecodeError, JSONDecodeError
        raise ConfigError(f"model.path: {path / 'config.json'} cannot be read as a model's config: {e}") from None
    auto_map = fields.get("auto_map") or {} if isinstance(fields, dict) else {}
    if trusted or not auto_map:
        return
    from transformers import CONFIG_MAPPING

    if fields.get("model_type") not in CONFIG_MAPPING:  # a known type loads with transformers' own code
        code = ", ".join(sorted({str(v) for v in auto_map.values()}))
        raise ConfigError(
            f"model.path={str(path)!r} needs Python code shipped in the folder ({code}) for model_type "
            f"{fields.get('model_type')!r}, which transformers does not know. oomb never runs code from a model "
            f"folder unless you set {how}: read that code first."
        )
