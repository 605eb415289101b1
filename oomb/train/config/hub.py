"""Hugging Face hub ids for models and datasets, cached where transformers and datasets cache them.

A name that is not a local path is tried as a hub id; a local path always wins::

    model.path=Qwen/Qwen2.5-7B           snapshot in $HF_HOME/hub (HF_HUB_CACHE), then a local folder
    model.path=Qwen/Qwen2.5-7B@COMMIT    that commit (a branch or tag too); a new run pins the id it is given
    data.paths=[HuggingFaceFW/fineweb-edu:sample-10BT:train]   datasets.load_dataset(..., streaming=True)

A new run pins a hub model (and tokenizer) given without a revision to the commit it resolved
(``pin_model_revision``), so config.json records ``NAME@COMMIT`` and a resume builds the same base;
a pinned commit already in the cache is used without asking the hub. Models resolve to the
snapshot folder ``huggingface_hub.snapshot_download`` fills — the cache ``from_pretrained`` reads —
in two steps: config and tokenizer files first (every
check before the model is built reads them), the weights only when the model is built,
so a run that its data or memory check refuses downloads no weights. Only top-level files
are taken: safetensors weights, or ``.bin`` where a repository has none.

Datasets stream: ``NAME[@REVISION][:CONFIG][:SPLIT]`` (split ``train`` by default) is read row by
row from the hub, never prepared as a whole. A new run pins each hub dataset without a revision to
the commit the hub holds when it starts (``pin_dataset_revisions``), so config.json records
``NAME@COMMIT...`` and a resumed run reads the same rows even after the dataset was updated. A
local folder holding a dataset repository (README.md with its configs, data/ files) is read the
same way when its name carries a split (``./my-dataset:train``). Streams are not cached on disk: offline
(``HF_HUB_OFFLINE=1``) a hub dataset needs a local copy (``hf download --repo-type
dataset NAME --local-dir DIR``, then ``DIR:train``).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from oomb.train.config.settings import ConfigError

# Files of a model repository that configure it, tokenize for it, or hold its remote code.
_CONFIG_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py"]
_TOP_LEVEL_ONLY = ["*/*"]  # fnmatch's * crosses "/": this leaves out every file in a subfolder
_resolved: dict[tuple[str, bool], Path] = {}  # (id, with weights) -> snapshot folder, once per process


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is spelled like a hub repository id (``owner/name`` or ``name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


# Suffixes that name a file, never a hub repository: a missing path ending in one is a mistyped local path.
FILE_SUFFIXES = frozenset((".txt", ".md", ".jsonl", ".json", ".parquet", ".csv", ".arrow", ".py", ".gz", ".zst",
                           ".safetensors", ".bin", ".yaml", ".yml"))


def looks_local(name: str) -> bool:
    """Whether ``name`` reads as a local path and never as a hub id: it starts with ".", "/" or "~", its first
    part is a folder here (``data/missing``, where ``data/`` exists), or it ends in a file suffix (``.txt``)."""
    path = Path(name)
    if name.startswith((".", "/", "~", "\\")):
        return True
    if len(path.parts) > 1 and Path(path.parts[0]).is_dir():
        return True
    return path.suffix.lower() in FILE_SUFFIXES


def split_revision(name: str) -> tuple[str, str | None] | None:
    """``ID[@REVISION]`` as (ID, REVISION or None), or None where ID is no hub id or the revision is empty
    (``@`` never appears in a hub id)."""
    repo, at, revision = name.partition("@")
    if not is_hub_id(repo) or (at and not revision):
        return None
    return repo, revision or None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def model_folder(name: str, *, weights: bool, key: str = "model.path", tokenizer_only: bool = False) -> Path:
    """The local folder of a model: ``name`` itself when it exists, else its hub snapshot.

    ``weights=False`` fetches the config and tokenizer files only; ``tokenizer_only`` takes a
    repository without config.json (a tokenizer alone). Raises ConfigError, naming the setting
    ``key``, saying what was tried (the local path, the cache, the hub) and what to change.
    """
    local = Path(name).expanduser()
    if local.exists():
        return local
    if looks_local(name):
        raise ConfigError(f"{key}={name!r} does not exist ({local.absolute()}): give a local Hugging Face model "
                          "folder, or a hub id such as Qwen/Qwen2.5-0.5B")
    if (hub := split_revision(name)) is None:
        raise ConfigError(f"{key}={name!r} does not exist: give a local Hugging Face model folder or a hub id "
                          "such as Qwen/Qwen2.5-0.5B (at a revision: Qwen/Qwen2.5-0.5B@COMMIT)")
    repo, revision = hub
    if (name, weights) in _resolved:
        return _resolved[(name, weights)]
    cached = _cached_commit(repo, revision, weights) if revision else None
    # Without a revision each call resolves the main branch again; seconds apart, both find the same snapshot.
    folder = cached or _resolved.get((name, False)) or _snapshot(repo, _CONFIG_FILES, key, revision)
    if weights and cached is None:
        folder = _snapshot(repo, ["*.safetensors"], key, revision)
        if not any(folder.glob("*.safetensors")):
            folder = _snapshot(repo, ["*.bin"], key, revision)
        if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
            raise ConfigError(f"{key}={name!r}: the hub snapshot {folder} holds no weights (.safetensors or .bin), "
                              "and none could be fetched: give a repository with transformers weights, or fetch "
                              "them where huggingface.co is reachable (HF_HUB_OFFLINE unset)")
    if not tokenizer_only and not (folder / "config.json").is_file():
        raise ConfigError(f"{key}={name!r}: the hub repository has no config.json at its top level, so it is not "
                          f"a transformers model (snapshot: {folder})")
    _resolved[(name, weights)] = folder
    return folder


def pin_model_revision(name: str | None, key: str = "model.path", tokenizer_only: bool = False) -> str | None:
    """``name`` as ``NAME@COMMIT`` where it is a hub id without a revision: the commit of the snapshot it resolves
    to now (its folder's name in the cache); local folders, pinned ids and None unchanged."""
    if name is None or Path(name).expanduser().exists() or "@" in name:
        return name
    folder = model_folder(name, weights=False, key=key, tokenizer_only=tokenizer_only)
    return f"{name}@{folder.name}" if folder.parent.name == "snapshots" else name


def _cached_commit(repo: str, commit: str, weights: bool) -> Path | None:
    """The cache's snapshot of ``repo`` at ``commit`` where it holds the config (and, with ``weights``, every
    weight file its index names, or one where it has no index); else None. snapshot_download would list the
    repository on the hub for a commit whose file listing it did not cache itself, even offline."""
    import json

    folder = Path(_cache()) / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    if not (folder / "config.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        return None
    if not weights:
        return folder
    for index, kind in (("model.safetensors.index.json", "*.safetensors"), ("pytorch_model.bin.index.json", "*.bin")):
        if (folder / index).is_file():
            shards = set(json.loads((folder / index).read_text())["weight_map"].values())
            return folder if all((folder / shard).is_file() for shard in shards) else None
        if any(folder.glob(kind)):
            return folder
    return None


def tokenizer_folder(name: str, key: str = "data.tokenizer") -> Path:
    """The local folder of a tokenizer (or of a model holding one): ``model_folder`` without weights."""
    return model_folder(name, weights=False, key=key, tokenizer_only=True)


def _snapshot(name: str, patterns: list[str], key: str, revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    pinned = {} if revision is None else {"revision": revision}  # its default is the main branch, not None
    with _hub_errors(name, "model", f"{key}={name!r}"):
        return Path(snapshot_download(name, allow_patterns=patterns, ignore_patterns=_TOP_LEVEL_ONLY, **pinned))


@contextmanager
def _hub_errors(name: str, kind: str, where: str):
    """A hub request for ``name`` (a ``kind``, "model" or "dataset") whose failures become ConfigErrors that begin
    with ``where`` (the setting) and say what was tried and what to change."""
    import httpx
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        yield
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ConfigError(f"{where}: no local path {Path(name).absolute()}, and the Hugging Face hub has no {kind} "
                          f"by that id that this machine may read (private or gated repositories need a login: hf "
                          f"auth login, or HF_TOKEN) ({type(e).__name__})") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, httpx.HTTPError) as e:  # OSError: offline mode too
        raise ConfigError(f"{where}: {not_reachable(name, kind, e)}") from None


def not_reachable(name: str, kind: str, error: BaseException) -> str:
    """What was tried for hub id ``name`` that is neither a local path nor reachable, and what to do."""
    tried = f"no local path {Path(name).absolute()}"
    cached = ("streamed, never cached" if kind == "dataset" else f"not in the cache {_cache()} (HF_HOME)")
    download = ("hf download --repo-type dataset" if kind == "dataset" else "hf download") + f" {name} --local-dir DIR"
    local = "DIR:train" if kind == "dataset" else "DIR"
    if _offline():
        return (f"{tried}; as a hub {kind} id it is {cached}, and HF_HUB_OFFLINE=1 forbids downloading it. "
                f"Unset HF_HUB_OFFLINE, or copy it here ({download}) and give {local}")
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (f"{tried}; as a hub {kind} id it is {cached}, and huggingface.co could not be reached "
            f"({type(error).__name__}: {first}). Check the network (HF_ENDPOINT), or copy it here ({download}) "
            f"and give {local}")


# --- datasets --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetRef:
    """``NAME[@REVISION][:CONFIG][:SPLIT]``: a hub dataset id (at a branch, tag or commit), or a local dataset
    repository folder (no revision)."""

    name: str
    config: str | None
    split: str
    revision: str | None = None

    def __str__(self) -> str:
        name = self.name if self.revision is None else f"{self.name}@{self.revision}"
        return ":".join(p for p in (name, self.config, self.split) if p is not None)


def parse_dataset_ref(text: str) -> DatasetRef | None:
    """``text`` as a dataset to stream, or None when it is neither a local folder with a split nor a hub id.

    ``NAME`` (split train), ``NAME:SPLIT`` or ``NAME:CONFIG:SPLIT``, NAME optionally ``ID@REVISION`` for a hub
    id (``@`` never appears in one). A bare local folder is not a reference: folders are searched for files
    unless their name carries a split.
    """
    parts = text.split(":")
    if len(parts) > 3 or not all(parts):
        return None
    name = parts[0]
    config, split = (None, "train") if len(parts) == 1 else (None, parts[1]) if len(parts) == 2 else parts[1:]
    if Path(name).expanduser().is_dir():
        return DatasetRef(str(Path(name).expanduser()), config, split) if len(parts) > 1 else None
    if looks_local(name):  # a mistyped file or folder here, not a dataset to ask the hub for
        return None
    hub = split_revision(name)
    return None if hub is None else DatasetRef(hub[0], config, split, hub[1])


def pin_dataset_revisions(paths: list[str] | None, key: str = "data.paths") -> list[str] | None:
    """``paths`` with every hub dataset that names no revision pinned to the commit the hub holds now
    (``owner/name:train`` -> ``owner/name@COMMIT:train``); files, folders, patterns and pinned ids unchanged.
    Raises ConfigError, naming ``key``, where the hub cannot say (offline, unreachable, no such dataset)."""
    if paths is None:
        return None
    pinned = []
    for text in paths:
        ref = None if Path(text).expanduser().exists() else parse_dataset_ref(text)
        if ref is not None and ref.revision is None and not Path(ref.name).is_dir():
            text = str(dataclasses.replace(ref, revision=_dataset_commit(ref.name, key)))
        pinned.append(text)
    return pinned


def _dataset_commit(name: str, key: str) -> str:
    """The commit a hub dataset's main branch points at now."""
    from huggingface_hub import HfApi

    with _hub_errors(name, "dataset", key):
        return HfApi().dataset_info(name).sha


# --- local paths, made absolute ---------------------------------------------------------------------


def absolute_path(name: str | None) -> str | None:
    """``name`` made absolute where it is a local file or folder (``~`` expanded); a hub id, a path that does
    not exist (its error names it as given) and None unchanged."""
    if name is None or not Path(name).expanduser().exists():
        return name
    return os.path.abspath(Path(name).expanduser())


def absolute_data_paths(paths: list[str] | None) -> list[str] | None:
    """data.paths entries made absolute: files and folders that exist, glob patterns, and the folder of a local
    dataset repository read with its split (``./folder:train``); hub ids and missing paths unchanged."""
    if paths is None:
        return None
    found = []
    for text in paths:
        if glob.has_magic(text) and not Path(text).expanduser().exists():
            text = os.path.abspath(Path(text).expanduser())
        elif not Path(text).expanduser().exists() and (ref := parse_dataset_ref(text)) is not None:
            if Path(ref.name).is_dir():
                text = str(dataclasses.replace(ref, name=os.path.abspath(ref.name)))
        else:
            text = absolute_path(text)
        found.append(text)
    return found


def make_paths_absolute(cfg) -> None:
    """model.path, data.tokenizer, data.paths, data.val_paths and a data.chat_template file made absolute in
    ``cfg`` (a oomb.train.config.settings.Config), so the config.json a run records reads the same files from
    any working directory (a resume elsewhere, ``oomb eval``)."""
    cfg.model.path = absolute_path(cfg.model.path)
    d = cfg.data
    d.tokenizer = absolute_path(d.tokenizer)
    d.paths, d.val_paths = absolute_data_paths(d.paths), absolute_data_paths(d.val_paths)
    template = d.chat_template
    if template is not None and "{{" not in template and "{%" not in template and Path(template).expanduser().is_file():
        d.chat_template = absolute_path(template)
