"""The model `oomb eval` measures: a Hugging Face folder, an oomb run or checkpoint, or a preset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from oomb.train.config.checks import check_remote_code
from oomb.train.config.hub import model_folder, split_revision, tokenizer_folder
from oomb.train.config.presets import build_model, preset_names
from oomb.train.config.rope import rope_is_scaled
from oomb.train.config.settings import Config, ConfigError, load_config
from oomb.train.runfolder.checkpoint import CheckpointError, find_checkpoint, load_weights


class EvalError(ValueError):
    """A problem with the evaluation's input the user must fix; the message says what."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    source: str  # "huggingface", "checkpoint" or "preset"
    name: str  # what the user gave
    tokenizer_dir: Path | None  # where a tokenizer may live (None: none)
    run_config: Config | None  # the training run's config, for a checkpoint or a run's export folder


def resolve_device(name: str) -> torch.device:
    from oomb.train.config.checks import resolve_device as resolve

    try:
        return resolve(name, option="--device")
    except ConfigError as e:
        raise EvalError(str(e)) from e


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_eval_model(spec: str, device: torch.device, dtype_name: str = "auto", *,
                    trust_remote_code: bool = False) -> LoadedModel:
    """A model from a Hugging Face folder, an oomb run or checkpoint folder, or a preset name (random init).

    ``dtype_name`` "auto" keeps a checkpoint's training dtype, else bfloat16 on CUDA and float32 on CPU.
    ``trust_remote_code`` (the command line's --trust-remote-code, never a run folder's config.json):
    run Python code shipped in the model folder.
    """
    path = Path(spec)
    if path.exists():
        if not path.is_dir():
            raise EvalError(f"model {spec!r} is a file; give a Hugging Face model folder, an oomb run or "
                            "checkpoint folder, or a preset name")
        try:
            ckpt = find_checkpoint(path)
        except CheckpointError:
            ckpt = None
        if ckpt is not None:
            return _from_checkpoint(spec, ckpt, device, dtype_name, trust_remote_code)
        if (path / "config.json").is_file():
            loaded = _from_huggingface(spec, path, device, _dtype(dtype_name, device), trust_remote_code)
            loaded.run_config = _run_config_of_export(path)
            return loaded
        raise EvalError(f"{path} is neither a Hugging Face model folder (config.json and weights) nor an oomb "
                        "run folder (checkpoints/latest) or checkpoint folder (manifest.json)")
    if spec in preset_names():
        torch.manual_seed(0)
        model = build_model(spec, dtype=_dtype(dtype_name, device), device=device)
        return LoadedModel(model, "preset", spec, None, None)
    if split_revision(spec) is not None:  # a hub id (at a revision too): fetched into the cache, or found there
        try:
            folder = model_folder(spec, weights=True, key="model")
        except ConfigError as e:
            raise EvalError(f"{e}; nor is it a built-in preset ({', '.join(preset_names())})") from None
        return _from_huggingface(spec, folder, device, _dtype(dtype_name, device), trust_remote_code)
    raise EvalError(f"model {spec!r}: no such folder, and not a built-in preset ({', '.join(preset_names())})")


def _run_config_of_export(path: Path) -> Config | None:
    """The config of the run whose ``export/`` folder ``path`` is (its task, seed and passkey digits are the
    evaluation's defaults, as for the run's checkpoints), or None for any other model folder."""
    run_file = path.parent / "config.json"
    if path.name != "export" or not (path.parent / "checkpoints").is_dir() or not run_file.is_file():
        return None
    try:
        return load_config(run_file)
    except (ConfigError, OSError, ValueError):  # not an oomb run's config after all
        return None


def _from_huggingface(spec: str, path: Path, device: torch.device, dtype: torch.dtype,
                      trust_remote_code: bool) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    try:
        check_remote_code(path, trust_remote_code, how="--trust-remote-code")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                     trust_remote_code=trust_remote_code)
    except ConfigError as e:
        raise EvalError(str(e)) from None
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot load a causal LM from {path}: {e}") from e
    return LoadedModel(model.to(device), "huggingface", spec, path, None)


def _from_checkpoint(spec: str, ckpt: Path, device: torch.device, dtype_name: str,
                     trust_remote_code: bool) -> LoadedModel:
    from oomb.train.config.checks import resolve_dtype
    from oomb.train.loop.model import build
    from oomb.train.runfolder.rundir import run_dir_of

    config_file = run_dir_of(ckpt) / "config.json"
    if not config_file.is_file():
        raise EvalError(f"checkpoint {ckpt} has no run config at {config_file}: it is needed to build the model")
    try:
        cfg = load_config(config_file)
        cfg.model.trust_remote_code = trust_remote_code  # the command line's, never the run folder's
        if cfg.model.path is not None:
            try:
                folder = model_folder(cfg.model.path, weights=False)
            except ConfigError as e:
                raise EvalError(f"checkpoint {ckpt} was trained from model.path={cfg.model.path!r}, whose weights "
                                f"are needed to build the model: {e}") from None
            if not folder.is_dir():
                raise EvalError(f"checkpoint {ckpt} was trained from model.path={cfg.model.path!r}, which is not a "
                                "folder any more; its weights are needed to build the model")
            check_remote_code(folder, trust_remote_code, how="--trust-remote-code")
        dtype = resolve_dtype(cfg.model.dtype, device) if dtype_name == "auto" else DTYPES[dtype_name]
        model = build(cfg, device, dtype)
        load_weights(ckpt, model)
    except (ConfigError, CheckpointError) as e:
        raise EvalError(f"cannot load checkpoint {ckpt}: {e}") from e
    tokenizer = cfg.data.tokenizer or cfg.model.path  # what the run tokenized with
    try:
        tokenizer_dir = tokenizer_folder(tokenizer) if tokenizer else None
    except ConfigError as e:
        raise EvalError(f"the tokenizer of checkpoint {ckpt}'s run: {e}") from None
    return LoadedModel(model, "checkpoint", spec, tokenizer_dir, cfg)


def base_config(model: torch.nn.Module):
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return base.config


def check_positions(config, length: int, what: str) -> None:
    """Refuse ``length`` beyond the model's trained positions unless its RoPE is scaled."""
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and length > max_pos and not rope_is_scaled(config):
        raise EvalError(
            f"{what} {length} is longer than the model's max_position_embeddings={max_pos} and its config sets "
            "no RoPE scaling: positions past the trained range are meaningless. Use lengths <= "
            f"{max_pos}, or a model whose config has rope_parameters with a scaling type (e.g. yarn)"
        )


