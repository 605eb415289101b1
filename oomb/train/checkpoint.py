"""Checkpoints that are written atomically and resume exactly.

Layout of a run folder::

    <out_dir>/
      config.json              the resolved config of the run
      metrics.jsonl            one line per step
      checkpoints/
        step-00000004/         one complete checkpoint
          model.safetensors    trainable weights (safetensors: no pickled code)
          optimizer.pt         optimizer + scheduler state (tensors and plain data only)
          rng.pt               RNG states (Python, torch, CUDA)
          state.json           the step it was taken after, and the data position
          manifest.json        size and sha256 of every file above
        latest                 the name of the newest complete checkpoint
      export/                  the final model, loadable by transformers

A checkpoint is written into ``step-N.tmp``, each file fsynced, the folder renamed to
``step-N`` and then ``latest`` replaced through a rename: a crash at any point leaves
the previous checkpoint and ``latest`` as they were. ``manifest.json`` lets a resume
detect a truncated or altered checkpoint before loading it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CHECKPOINTS = "checkpoints"
LATEST = "latest"
_FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which and why."""


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return out_dir / CHECKPOINTS / f"step-{step:08d}"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters that train (all of them for full fine-tuning); tied ones (shared embeddings) once."""
    out, seen = {}, set()
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    return out


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters as contiguous CPU tensors (what a checkpoint stores)."""
    return {name: p.detach().to("cpu").contiguous() for name, p in _trainable_parameters(model).items()}


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a fsynced temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _publish_dir(tmp: Path, final: Path) -> None:
    """Move a fully written folder into place (replacing an older one of the same name)."""
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def save_checkpoint(
    out_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    data_state: dict | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and point ``latest`` at it.

    ``data_state`` (plain JSON data: where the data stream stands) goes into state.json.
    """
    final = checkpoint_dir(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():  # debris of an earlier crash while writing this very step
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(trainable_state_dict(model), tmp / "model.safetensors")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    state = {"step": step, "torch": torch.__version__}
    if data_state is not None:
        state["data"] = data_state
    (tmp / "state.json").write_text(json.dumps(state))
    manifest = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in _FILES}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for name in (*_FILES, "manifest.json"):
        _fsync_file(tmp / name)
    _publish_dir(tmp, final)  # the same step saved again (after a resume) is replaced whole
    write_text_atomic(out_dir / CHECKPOINTS / LATEST, final.name)
    return final


def find_checkpoint(path: Path) -> Path:
    """A checkpoint folder from a run folder (its ``latest``) or a checkpoint folder itself."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    latest = path / CHECKPOINTS / LATEST
    if latest.is_file():
        return path / CHECKPOINTS / latest.read_text().strip()
    raise CheckpointError(
        f"{path} holds no checkpoint: expected a run folder with {CHECKPOINTS}/{LATEST} "
        "or a checkpoint folder with manifest.json"
    )


def verify_checkpoint(ckpt: Path) -> None:
    """Raise CheckpointError if a file is missing, truncated or altered."""
    try:
        manifest = json.loads((ckpt / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has no readable manifest.json: {e}") from e
    for name, rec in manifest.items():
        f = ckpt / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is missing {name}")
        if f.stat().st_size != rec["bytes"]:
            raise CheckpointError(f"checkpoint {ckpt}: {name} has {f.stat().st_size} bytes, expected {rec['bytes']}")
        if _sha256(f) != rec["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt}: {name} does not match its checksum (altered or corrupted)")


def load_checkpoint(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> int:
    """Restore model, optimizer, scheduler and RNG from ``ckpt``; returns the step it was taken at."""
    load_weights(ckpt, model)
    # weights_only: plain tensors and containers only, never arbitrary pickled objects.
    opt = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    set_rng_state(torch.load(ckpt / "rng.pt", map_location="cpu", weights_only=True))
    return json.loads((ckpt / "state.json").read_text())["step"]


def load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Verify ``ckpt`` and copy its weights into ``model`` (built as the run built it); no optimizer state."""
    verify_checkpoint(ckpt)
    weights = load_file(ckpt / "model.safetensors")
    params = _trainable_parameters(model)
    if weights.keys() != params.keys():
        missing, extra = sorted(params.keys() - weights.keys()), sorted(weights.keys() - params.keys())
        raise CheckpointError(
            f"checkpoint {ckpt} does not fit this model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            if params[name].shape != tensor.shape:
                raise CheckpointError(f"checkpoint {ckpt}: {name} has shape {tuple(tensor.shape)}, "
                                      f"the model {tuple(params[name].shape)}")
            params[name].copy_(tensor)


def checkpoint_state(ckpt: Path) -> dict:
    """state.json of a checkpoint: ``step`` and, when the run had one, ``data`` (the data position)."""
    return json.loads((Path(ckpt) / "state.json").read_text())


def export_model(model, out_dir: Path, *, merge_lora: bool = True, tokenizer=None) -> Path:
    """Write the model as a transformers folder (``from_pretrained`` loads it), atomically.

    ``tokenizer`` (a transformers tokenizer) is saved into the same folder, so
    ``AutoTokenizer.from_pretrained`` loads it from there too.

    A LoRA (peft) model is exported with its adapters merged into a copy of the weights,
    or, with ``merge_lora=False``, as the adapter folder peft loads on top of the base.
    """
    final = out_dir / "export"
    tmp = out_dir / "export.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    if merge_lora and callable(getattr(model, "merge_and_unload", None)):
        import copy

        model = copy.deepcopy(model).merge_and_unload()  # the training model keeps its adapters
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    _publish_dir(tmp, final)
    return final
