"""Loading torch.distributed.checkpoint (DCP) folders without running code from them.

DCP stores its ``.metadata`` as a pickle and non-tensor values (an optimizer's param_groups)
as ``torch.save`` bytes, and its default reader and planner unpickle both with full pickle:
a run folder copied from elsewhere could run any code on resume. Here the metadata is first
read by an unpickler that builds only DCP's own metadata classes, and every bytes value by
``torch.load(weights_only=True)``; only what passes is handed to DCP's own reader and
planner. Anything else is refused with CheckpointError, and nothing from it runs.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from oomb.train.runfolder.checkpoint import CheckpointError

# What DCP's .metadata holds (torch 2.11-2.13): its dataclasses, torch sizes, dtypes and layouts, paths.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout looked up by its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = name in _METADATA_CLASSES.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, whose metadata must unpickle into DCP's metadata classes alone."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        check_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        return super().read_metadata(*args, **kwargs)


def check_metadata(path: Path) -> None:
    """Raise CheckpointError unless ``path`` unpickles into DCP's metadata classes alone (nothing else is built)."""
    try:
        _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except (pickle.UnpicklingError, AttributeError, EOFError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} is not plain checkpoint metadata (refused, nothing from it was run): "
                              f"{e}") from e


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, whose non-tensor values must be tensors and plain data (weights_only)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"checkpoint value {read_item.dest_index.fqn!r} holds objects other than tensors "
                                  f"and plain data (refused, nothing from it was run): {str(e).splitlines()[0]}") from e
        super().load_bytes(read_item, io.BytesIO(data))  # the same bytes, now known to be plain data


def load_dcp(state: dict, folder: Path) -> None:
    """``torch.distributed.checkpoint.load(state, folder)`` with the safe reader and planner."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    # Checked here too: DCP's loader catches a failed global read and falls back to per-rank files.
    for path in sorted(Path(folder).glob("*.metadata")):
        check_metadata(path)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner())
    except CheckpointException as e:  # DCP gathers each rank's failure; ours are refusals to report as such
        refusals = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if refusals:
            raise refusals[0] from None
        raise
