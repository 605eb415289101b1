"""Checkpoints that are written atomically and resume exactly.

Layout of a run folder::

    <out_dir>/
      config.json              the resolved config of the run
      metrics.jsonl            one line per step
      checkpoints/
        step-00000004/         one complete checkpoint
          model.safetensors    trainable weights (safetensors: no pickled code)
          optimizer.pt         optimizer + scheduler state (tensors and plain data only; with
                               train.master_weights, the fp32 master weights too)
          rng.pt               RNG states (Python, torch, CUDA)
          state.json           the step it was taken after, the data position, master weights or not
          manifest.json        size and sha256 of every file above
        latest                 the name of the newest complete checkpoint
      export/                  the final model, loadable by transformers

A checkpoint is written into ``step-N.tmp``, each file fsynced, the folder renamed to
``step-N`` and then ``latest`` replaced through a rename: a crash at any point leaves
the previous checkpoint and ``latest`` as they were. A write that fails (disk full, no
permission) removes its ``step-N.tmp``; a kill mid-write leaves it, and the next save
removes it. ``manifest.json`` lets a resume detect a truncated or altered checkpoint
before loading it. ``rotate_checkpoints`` keeps the newest N. A link or a special file where
a checkpoint's folder or file belongs is refused, never followed (oomb.train.runfolder.runfiles).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from oomb.train.config.bounded import loads_json
from oomb.train.config.hub import split_revision
from oomb.train.data.identity import sha256_of
from oomb.train.loop.optim import MASTER_WEIGHTS_KEY, MasterWeights
from oomb.train.loop.quantize import is_quantized, merged_export_model
from oomb.train.runfolder.runfiles import (
    RunPathError,
    check,
    check_below,
    fsync_dir,
    make_folder,
    read_text,
    write_text_atomic,
)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
_FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which and why."""


class NonFiniteCheckpointError(CheckpointError):
    """A checkpoint was not written: the weights or optimizer state hold a NaN or an inf."""


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return out_dir / CHECKPOINTS / f"step-{step:08d}"


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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


def start_folder_write(tmp: Path) -> Path:
    """The empty folder ``tmp`` (``step-N.tmp``, ``export.tmp``) to write into; its parent is made if missing.

    Debris of an earlier crash there is removed; a link there, or where the folder will be published, is
    refused (RunPathError), never followed or deleted through.
    """
    make_folder(tmp.parent)
    check(tmp.with_name(tmp.name.removesuffix(".tmp")), "folder")
    if check(tmp, "folder"):  # debris of an earlier crash while writing this very folder
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, final: Path) -> None:
    """Move a fully written folder into place (replacing an older one of the same name)."""
    fsync_dir(tmp)
    old = final.with_name(final.name + ".replaced.tmp")
    if check(final, "folder"):  # set aside by one rename; deleted once the new folder is in place
        if check(old, "folder"):
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


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
    make_folder(out_dir / CHECKPOINTS)  # before anything is computed: a link there is refused at once
    weights = trainable_state_dict(model)
    optimizer_state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    bad = nonfinite_names(weights) + [f"optimizer state {n}" for n in nonfinite_names(_tensors(optimizer_state))]
    if bad:  # the trainer checks every update; this guards every other caller
        raise NonFiniteCheckpointError(f"refusing to write checkpoint step {step}: non-finite values (NaN or inf) in "
                                       f"{bad[:3]}")
    try:
        start_folder_write(tmp)
        save_file(weights, tmp / "model.safetensors")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        state = {"step": step, "torch": torch.__version__, "master_weights": isinstance(optimizer, MasterWeights),
                 "finite": True}
        if data_state is not None:
            state["data"] = data_state
        (tmp / "state.json").write_text(json.dumps(state))
        manifest = {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_of(tmp / name)} for name in _FILES}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for name in (*_FILES, "manifest.json"):
            fsync_file(tmp / name)
    except BaseException as e:  # disk full, no permission, ...: leave no half-written folder behind
        if not isinstance(e, RunPathError):  # a link refused at tmp is not ours to remove
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)  # the same step saved again (after a resume) is replaced whole
    write_text_atomic(out_dir / CHECKPOINTS / LATEST, final.name)
    return final


def find_checkpoint(path: Path) -> Path:
    """A checkpoint folder from a run folder (its ``latest``) or a checkpoint folder itself.

    ``latest`` must name a ``step-N`` folder inside the run's ``checkpoints/``: it is data in a
    folder that may come from elsewhere, never a path to follow. A run whose ``latest`` was never
    written (killed during its very first write) resumes from its newest ``step-N`` folder,
    which exists only once complete (it is renamed into place). A link or a special file on the way is
    refused (CheckpointError), never followed.
    """
    try:
        return _find_checkpoint(Path(path))
    except RunPathError as e:
        raise CheckpointError(str(e)) from None


def _find_checkpoint(path: Path) -> Path:
    if check(path / "manifest.json"):
        return path
    folder = path / CHECKPOINTS
    latest = folder / LATEST
    if check_below(path, latest):
        name = read_text(latest).strip()
        ckpt = folder / name
        try:  # a link there is named as one: what it names is never a checkpoint of this run
            found, why = bool(_STEP_DIR.fullmatch(name)) and check(ckpt, "folder"), ""
        except RunPathError as e:
            found, why = False, f": {e}"
        if not found:
            raise CheckpointError(f"{latest} names {name!r}, which is not a checkpoint folder (step-N) of this run"
                                  f"{why or f'; give one of its checkpoints instead: {_listing(path)}'}")
        return ckpt
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise CheckpointError(
        f"{path} holds no checkpoint: expected a run folder with {CHECKPOINTS}/{LATEST} "
        "or a checkpoint folder with manifest.json"
    )


def _listing(run_dir: Path) -> str:
    names = [str(p) for p in list_checkpoints(run_dir)]
    return ", ".join(names) if names else "(none)"


_STEP_DIR = re.compile(r"step-(\d+)")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders (complete or not), oldest step first; ``*.tmp`` debris excluded."""
    folder = Path(run_dir) / CHECKPOINTS
    found = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and _STEP_DIR.fullmatch(p.name)] \
        if check(folder, "folder") else []
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def newest_good_checkpoint(run_dir: Path, *, excluding: Path | None = None) -> Path | None:
    """The newest checkpoint of the run that passes ``verify_checkpoint`` (checksums every file)."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        if excluding is not None and ckpt.resolve() == Path(excluding).resolve():
            continue
        try:
            verify_checkpoint(ckpt)
        except CheckpointError:
            continue
        return ckpt
    return None


def rotate_checkpoints(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints up to ``latest``; 0 keeps all. Returns the deleted.

    The checkpoint ``latest`` names is always kept. Folders of later steps (left by a run
    that was resumed from an older checkpoint) are kept too: the run replaces each when it
    gets there. ``*.tmp`` debris of interrupted writes is removed. A folder is renamed to
    ``*.tmp`` before it is deleted, so a crash mid-delete never leaves a partial ``step-N``.
    """
    folder = Path(run_dir) / CHECKPOINTS
    latest_file = folder / LATEST
    if not check_below(run_dir, latest_file):
        return []
    name = read_text(latest_file).strip()
    if not _STEP_DIR.fullmatch(name):
        return []  # not a name oomb wrote: resume says so; nothing is deleted on its word
    latest = folder / name
    for debris in folder.glob("*.tmp"):
        if check(debris, "folder"):  # a link among them is refused, never deleted through
            shutil.rmtree(debris, ignore_errors=True)
    if keep_last <= 0:
        return []
    latest_step = int(latest.name.split("-")[1])
    older = [p for p in list_checkpoints(run_dir) if int(p.name.split("-")[1]) < latest_step]
    doomed = older[: max(0, len(older) - (keep_last - 1))]
    for ckpt in doomed:
        trash = ckpt.with_name(ckpt.name + ".deleting.tmp")
        os.replace(ckpt, trash)
        shutil.rmtree(trash)
    if doomed:
        fsync_dir(folder)
    return doomed


def verify_checkpoint(ckpt: Path) -> None:
    """Raise CheckpointError if a file is missing, truncated, altered, unlisted, or holds non-finite values.

    The manifest must list every file of the folder (so none the loader reads escapes the
    checksums) and nothing outside it. Checkpoints oomb writes carry ``"finite": true`` in
    state.json (checked before writing); older ones get their weights and optimizer state read.
    """
    ckpt = Path(ckpt)
    manifest = _read_manifest(ckpt)
    present = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if not p.is_dir() or p.is_symlink()}
    unlisted = sorted(present - set(manifest) - {"manifest.json"})
    if unlisted:
        raise CheckpointError(f"checkpoint {ckpt} holds files its manifest.json does not list: {unlisted[:5]}")
    missing = [name for name in _FILES if name not in manifest] if "dcp" not in {n.split("/")[0] for n in manifest} \
        else [name for name in ("state.json",) if name not in manifest]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt}: its manifest.json does not list {missing}")
    for name, rec in manifest.items():
        f = ckpt / name
        try:
            if not check_below(ckpt, f):
                raise CheckpointError(f"checkpoint {ckpt} is missing {name}")
        except RunPathError as e:
            raise CheckpointError(f"checkpoint {ckpt}: {e}") from None
        if f.stat().st_size != rec["bytes"]:
            raise CheckpointError(f"checkpoint {ckpt}: {name} has {f.stat().st_size} bytes, expected {rec['bytes']}")
        if sha256_of(f) != rec["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt}: {name} does not match its checksum (altered or corrupted)")
    try:
        state = checkpoint_state(ckpt)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: state.json is not readable JSON: {e}") from e
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"checkpoint {ckpt}: state.json holds no step number")
    if state.get("finite") is not True and "model.safetensors" in manifest:  # written before the check existed
        bad = nonfinite_names(load_file(ckpt / "model.safetensors"))
        bad += [f"optimizer state {n}" for n in nonfinite_names(_tensors(load_plain(ckpt / "optimizer.pt")))]
        if bad:
            raise CheckpointError(f"checkpoint {ckpt} holds non-finite values (NaN or inf) in {bad[:3]}")


def _read_manifest(ckpt: Path) -> dict[str, dict]:
    """manifest.json as {relative path: {"bytes": int, "sha256": str}}, its shape checked."""
    try:
        manifest = loads_json(read_text(ckpt / "manifest.json"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has no readable manifest.json: {e}") from e
    def well_formed(name, rec) -> bool:
        parts = Path(name).parts
        return (isinstance(rec, dict) and isinstance(rec.get("bytes"), int) and isinstance(rec.get("sha256"), str)
                and bool(parts) and not Path(name).is_absolute() and ".." not in parts and name != "manifest.json")
    if not isinstance(manifest, dict) or not all(well_formed(n, r) for n, r in manifest.items()):
        raise CheckpointError(f"checkpoint {ckpt}: manifest.json is not a mapping of the folder's files to their "
                              'size and checksum ({"model.safetensors": {"bytes": ..., "sha256": ...}, ...})')
    return manifest


def nonfinite_names(named: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of ``named`` that hold a NaN or an inf."""
    return [name for name, t in named.items()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict/list (an optimizer state dict), by a dotted path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list | tuple) else ()
    out = {}
    for key, value in items:
        out.update(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def load_checkpoint(
    ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, *, verify: bool = True
) -> int:
    """Restore model, optimizer, scheduler and RNG from ``ckpt``; returns the step it was taken at.

    ``verify=False`` skips the checksums when the caller has just run ``verify_checkpoint``.
    Master weights: a checkpoint without them starts the optimizer's masters from its weights;
    one with them loaded into an optimizer without masters continues from its (rounded) weights.
    """
    load_weights(ckpt, model, verify=verify)  # first: masters missing from the checkpoint start from these
    opt = load_plain(ckpt / "optimizer.pt")
    if not isinstance(optimizer, MasterWeights):
        opt["optimizer"].pop(MASTER_WEIGHTS_KEY, None)
    try:
        optimizer.load_state_dict(opt["optimizer"])
    except ValueError as e:
        raise CheckpointError(f"checkpoint {ckpt}: the optimizer state does not fit this run's optimizer: {e}") from e
    scheduler.load_state_dict(opt["scheduler"])
    set_rng_state(load_plain(ckpt / "rng.pt"))
    return checkpoint_state(ckpt)["step"]


def load_weights(ckpt: Path, model: torch.nn.Module, *, verify: bool = True) -> None:
    """Verify ``ckpt`` and copy its weights into ``model`` (built as the run built it); no optimizer state."""
    if verify:
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


def load_plain(path: Path):
    """torch.load with weights_only: tensors and plain containers only, never pickled code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain data (refused, nothing from it was run): "
            f"{str(e).splitlines()[0]}"
        ) from e


def checkpoint_state(ckpt: Path) -> dict:
    """state.json of a checkpoint: ``step`` and, when the run had one, ``data`` (the data position)."""
    return loads_json(read_text(Path(ckpt) / "state.json"))  # nesting bounded


def export_model(model, out_dir: Path, *, merge_lora: bool = True, tokenizer=None, base_model: str | None = None
                 ) -> Path:
    """Write the model as a transformers folder (``from_pretrained`` loads it), atomically.

    ``tokenizer`` (a transformers tokenizer) is saved into the same folder, so
    ``AutoTokenizer.from_pretrained`` loads it from there too.

    A LoRA (peft) model is exported with its adapters merged into a copy of the weights,
    or, with ``merge_lora=False``, as the adapter folder peft loads on top of the base, whose
    adapter_config.json names ``base_model`` (an absolute path or a hub id; peft would record the
    path as the run was given it, relative to where it started). A 4-bit base (QLoRA) is merged as
    oomb.train.loop.quantize.merged_export_model says: dequantized, in the model's dtype, no bitsandbytes needed.
    """
    peft_configs = getattr(model, "peft_config", None)
    if merge_lora and is_quantized(model):  # QLoRA: the 4-bit base dequantized, the adapters merged in
        model = merged_export_model(model)
    elif merge_lora and callable(getattr(model, "merge_and_unload", None)):
        import copy

        model = copy.deepcopy(model).merge_and_unload()  # the training model keeps its adapters
    elif isinstance(peft_configs, dict) and base_model is not None:
        name_base_model(peft_configs, base_model)
    return write_export(out_dir, model, tokenizer)


def name_base_model(peft_configs: dict, base_model: str) -> None:
    """Make each adapter's config name ``base_model`` (a path, or a hub id pinned as NAME@REVISION by
    oomb.train.config.hub, which peft's config keeps apart as the id and the revision)."""
    hub = None if Path(base_model).exists() else split_revision(base_model)
    name, revision = hub if hub is not None else (base_model, None)
    for adapter in peft_configs.values():
        adapter.base_model_name_or_path = name
        adapter.revision = revision or adapter.revision


def write_export(out_dir: Path, model, tokenizer=None, **save_kwargs) -> Path:
    """``model.save_pretrained`` (and the tokenizer's) into ``export.tmp``, then renamed to ``export``.

    A failed write (a full disk) removes ``export.tmp``; a kill leaves it, and the next export
    removes it. ``save_kwargs`` go to ``save_pretrained`` (a gathered ``state_dict``).
    """
    final, tmp = out_dir / "export", start_folder_write(out_dir / "export.tmp")
    try:
        model.save_pretrained(tmp, safe_serialization=True, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, final)
    return final
