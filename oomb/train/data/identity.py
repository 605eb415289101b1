"""What bytes a file holds, in bounded time; and the watch that stops a run whose data files change under it.

    identify(path)   a FileId: the file's size, modification time, inode, and its content fingerprint:
                     sha256 of the whole file up to WHOLE_BYTES (64 MiB); for a larger file, sha256 of its
                     size and SAMPLES (256) blocks of SAMPLE_BYTES (64 KiB) spread evenly from its first byte
                     to its last: 16 MiB read whatever the size, so a 50 GB file costs what a 16 MiB one does

A sampled fingerprint sees a change of size (rows appended, a file cut short) and a change inside any sampled
block (a file rewritten or replaced); an edit of a file over 64 MiB that keeps its size and touches none of the
256 blocks is not seen.

The watch: a run arms it with its data files as they were when it started (``watch``). The row readers
(oomb.train.data.rows) call ``check_file`` when they open a file (a text file at each piece, a .jsonl reader
after each line too, as its rows are read), and the trainer calls ``changed_files`` at each checkpoint. Either
compares the file's size, modification time and inode with those at the start, a stat and no read; where they
differ the file is fingerprinted again, so a file touched or copied back as it was goes on, and a file whose
size or fingerprint differs raises DataChanged, naming it (the run stops with exit code 6, docs/failures.md).
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from oomb.train.data.corpus import DataError

WHOLE_BYTES = 64 << 20  # files up to this size are hashed whole
SAMPLES = 256  # blocks hashed of a larger file, evenly spaced
SAMPLE_BYTES = 64 << 10
FINGERPRINT = (f"sha256 of the whole file up to {WHOLE_BYTES >> 20} MiB; of a larger file, sha256 of its size "
               f"(8 bytes, little-endian) and {SAMPLES} blocks of {SAMPLE_BYTES >> 10} KiB spread evenly from its "
               "first byte to its last")


class DataChanged(DataError):
    """A data file whose size or content is not what it was when the run started; the message names it."""


@dataclass(frozen=True)
class FileId:
    """A regular file as it was seen: ``path`` (absolute), ``size`` in bytes, its content ``fingerprint`` (hex),
    and the stat values that say cheaply whether it may have changed since."""

    path: str
    size: int
    fingerprint: str
    mtime_ns: int = 0
    inode: int = 0

    def same_stat(self, st: os.stat_result) -> bool:
        return (st.st_size, st.st_mtime_ns, st.st_ino) == (self.size, self.mtime_ns, self.inode)


def sha256_of(path: str | Path) -> str:
    """The hex sha256 of a whole file, read a MiB at a time (also the checksums of a checkpoint's manifest)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(1 << 20):
            digest.update(data)
    return digest.hexdigest()


def fingerprint(path: str | Path, size: int) -> str:
    """The content fingerprint of the file ``path`` of ``size`` bytes (the module's docstring says how)."""
    if size <= WHOLE_BYTES:
        return sha256_of(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(size.to_bytes(8, "little"))
        last = size - SAMPLE_BYTES
        for i in range(SAMPLES):
            f.seek(last * i // (SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def identify(path: str | Path) -> FileId:
    """The FileId of the regular file ``path`` (made absolute). Raises OSError where it cannot be read, and
    DataError where it changed while it was read (twice in a row)."""
    path = os.path.abspath(path)
    for _ in range(2):
        before = os.stat(path)
        if not stat.S_ISREG(before.st_mode):
            raise DataError(f"{path} is not a regular file")
        digest = fingerprint(path, before.st_size)
        after = os.stat(path)
        if (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino):
            return FileId(path, before.st_size, digest, before.st_mtime_ns, before.st_ino)
    raise DataError(f"{path} changed while oomb read it (is something writing it?): keep a run's data files "
                    "unchanged while it starts and trains")


def describe_change(size: int, was_size: int) -> str:
    """How a file that changed differs from what it was: its size, or else its content at the same size."""
    if size > was_size:
        return f"{size:,} bytes, was {was_size:,} (grown: rows appended, or the file rewritten)"
    if size < was_size:
        return f"{size:,} bytes, was {was_size:,} (shrunk: rows removed, or the file rewritten or cut short)"
    return f"other content at the same size ({size:,} bytes)"


# --- the watch of a run's data files -------------------------------------------------------------------------

_watched: dict[str, FileId] = {}  # absolute path -> the file as the run started; empty: no run watches


def watch(files) -> None:
    """Watch ``files`` (FileIds) from now on, in place of any watched before."""
    _watched.clear()
    _watched.update((f.path, f) for f in files)


def unwatch() -> None:
    _watched.clear()


def _changed(path: str, st: os.stat_result | None) -> str | None:
    """How the watched file ``path`` changed (None: it did not, or it is not watched); ``st``: its stat now
    (None: taken here). A file whose stat differs but whose content does not is watched with its new stat."""
    was = _watched.get(path)
    if was is None:
        return None
    try:
        st = os.stat(path) if st is None else st
    except FileNotFoundError:
        return "removed or moved away"
    if was.same_stat(st):
        return None
    if st.st_size != was.size:
        return describe_change(st.st_size, was.size)
    try:
        now = identify(path)
    except DataError as e:
        return str(e).removeprefix(f"{path} ")
    except OSError as e:
        return f"it cannot be read any more ({e})"
    if now.fingerprint != was.fingerprint:
        return describe_change(now.size, was.size)
    _watched[path] = now  # touched, or copied back as it was: the same bytes
    return None


def check_file(path: str | Path, st: os.stat_result | None = None) -> None:
    """Raise DataChanged where the watched file ``path`` is not what it was when the run started; ``st``: the
    stat of the file a reader holds open (os.fstat), else the path's now. A missing file is left to the open
    that follows (it names the error)."""
    if not _watched:
        return
    key = os.path.abspath(path)
    if st is None and not os.path.exists(key):
        return
    how = _changed(key, st)
    if how is not None:
        raise DataChanged(f"{key} changed during the run: {how}")


def check_folder(folder: str | Path) -> None:
    """``check_file`` for every watched file inside ``folder`` (a saved dataset's arrow files)."""
    if not _watched:
        return
    inside = os.path.join(os.path.abspath(folder), "")
    for path in [p for p in _watched if p.startswith(inside)]:
        check_file(path)


def changed_files() -> list[str]:
    """Every watched file that is not what it was when the run started: "PATH: how" (the checkpoints' check)."""
    found = []
    for path in list(_watched):
        how = _changed(path, None)
        if how is not None:
            found.append(f"{path}: {how}")
    return found
