"""The files and folders of a run folder, reached without following links: a run never reads or writes outside it.

A run folder may come from anyone (copied, shared, left writable), and a link in it would turn the run's
own writes, deletes and reads into ones elsewhere: a ``checkpoints/`` linked into another run would have
that run's checkpoints rotated away, a linked ``.lock`` or ``metrics.rolled-back.jsonl`` would truncate or
append to the file it names. So every entry of a run folder is checked with ``lstat`` (never followed):
a symbolic link, a named pipe, a socket or a device anywhere in it is refused, naming the path and what to
do (RunPathError), and files are opened with O_NOFOLLOW and checked again once open. A file the run writes
in place (``.lock``, ``metrics.jsonl``, ``metrics.rolled-back.jsonl``, a temporary file) must have one name:
a hard link would take the writes to its other names, outside the run. Files replaced by a rename
(config.json, ``latest``) or only read (a checkpoint's) may be hard links: nothing is written through them,
so a run copied with ``cp -al`` resumes once those three files are copied.

The run folder itself may be a link the user named (``out_dir=link``, ``resume=link``): the folder it
points to is the run's. Only the links W&B makes inside ``<run>/wandb`` to its own files there
(``latest-run``, ``debug.log``) are let be: oomb opens nothing under ``wandb/``, and W&B replaces
those links instead of writing through them.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

WANDB_DIR = "wandb"  # W&B's own files (WANDB_MODE=offline keeps the whole W&B run there)
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"),
          (stat.S_ISREG, "a file"))


class RunPathError(OSError):
    """An entry of a run folder is a link, a special file, or a folder where a file belongs (or the reverse)."""

    def __str__(self) -> str:
        return self.strerror  # the message alone: it names the path


def kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a file or a folder")


def refusal(path: Path, mode: int, wanted: str | None = "file") -> RunPathError:
    """The error for ``path`` (of stat mode ``mode``) where a regular ``wanted`` ("file" or "folder") belongs."""
    what = kind_of(mode)
    if stat.S_ISLNK(mode):
        try:
            what += f" to {os.readlink(path)}"
        except OSError:
            pass
        why = ("oomb never follows a link inside a run folder, where the run's reads, writes and deletes would land "
               "on what it names (another run's checkpoints, any file)")
        todo = "Remove the link, or replace it with a copy of what it names"
    elif stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        why, todo = f"the run keeps a {wanted} there", "Move it out of the run folder"
    else:
        why = "a run folder holds only files and folders (opening a pipe or a device can block, or act on the device)"
        todo = "Remove it"
    return RunPathError(errno.ELOOP if stat.S_ISLNK(mode) else errno.EINVAL,
                        f"{path} is {what}{f', not a {wanted}' if wanted else ''}: {why}. {todo}, then run the "
                        "command again")


def hard_link_refusal(path: Path, names: int) -> RunPathError:
    """The error for a file the run writes in place that has other names (hard links) too."""
    return RunPathError(errno.EMLINK, f"{path} is a file with {names} names (hard links): the run writes it in "
                        "place, so its other names, outside the run folder, would change too. Replace it with a "
                        "copy of its own (cp it to a new name, then move that over it), then run the command again")


def check(path: Path, wanted: str = "file", *, written: bool = False) -> bool:
    """Whether ``path`` exists, checked with lstat: a regular ``wanted`` ("file" or "folder"), else RunPathError.

    ``written``: the run writes the file in place, so it must have no other name (hard link) either.
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not (stat.S_ISDIR(st.st_mode) if wanted == "folder" else stat.S_ISREG(st.st_mode)):
        raise refusal(path, st.st_mode, wanted)
    if written and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        raise hard_link_refusal(path, st.st_nlink)
    return True


def check_below(root: Path, path: Path, wanted: str = "file") -> bool:
    """Whether ``path`` (inside the run folder ``root``) exists, every folder between them checked as ``check``."""
    parts = Path(path).relative_to(root).parts
    at = Path(root)
    for i, part in enumerate(parts):
        at = at / part
        if not check(at, wanted if i == len(parts) - 1 else "folder"):
            return False
    return True


def make_folder(path: Path) -> Path:
    """``path`` as a real folder: made if missing (its parent must exist), refused if it is anything else."""
    if not check(path, "folder"):
        try:
            os.mkdir(path)
        except FileExistsError:  # made or linked since the check: look again
            check(path, "folder")
    return path


def open_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that never follows a link at ``path`` and returns a descriptor of a regular file only.

    O_NONBLOCK: a named pipe put there since the check opens at once (and is refused) instead of waiting
    for a writer or reader; it changes nothing for a regular file. A file opened for writing must have one
    name (no hard link elsewhere).
    """
    written = bool(flags & (os.O_WRONLY | os.O_RDWR))
    check(path, written=written)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a link or a pipe put there since the check
            raise refusal(path, os.lstat(path).st_mode) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or written and st.st_nlink > 1:
        os.close(fd)
        raise refusal(path, st.st_mode) if not stat.S_ISREG(st.st_mode) else hard_link_refusal(path, st.st_nlink)
    return fd


def read_bytes(path: Path) -> bytes:
    fd = open_file(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def read_text(path: Path) -> str:
    return read_bytes(path).decode()


def write_new(path: Path, data: bytes) -> None:
    """Write ``data`` into ``path`` (created or truncated, never through a link) and fsync it."""
    fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` through a fsynced temporary file and a rename; neither is followed if a link."""
    tmp = path.with_name(path.name + ".tmp")
    check(path)  # a rename would replace a link silently: say so instead
    try:
        write_new(tmp, text.encode())
        os.replace(tmp, path)
    except BaseException as e:
        if not isinstance(e, RunPathError):  # a refused tmp is not ours to remove
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def check_tree(root: Path) -> None:
    """Raise RunPathError for the first link or special file anywhere under the folder ``root`` (not followed).

    ``root`` itself may be a link (the folder the user named). Inside ``root/wandb``, links that stay inside
    it are W&B's own (see the module's docstring).
    """
    folders = [Path(root)]
    while folders:
        folder = folders.pop()
        with os.scandir(folder) as entries:
            found = sorted(entries, key=lambda entry: entry.name)
        for entry in found:
            path, mode = Path(entry.path), entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                folders.append(path)
            elif not stat.S_ISREG(mode) and not _wandb_own_link(Path(root), path, mode):
                raise refusal(path, mode, None)


def _wandb_own_link(root: Path, path: Path, mode: int) -> bool:
    """A relative link inside ``root/wandb`` that names something inside it (W&B's ``latest-run``, ``debug.log``)."""
    wandb = root / WANDB_DIR
    if not stat.S_ISLNK(mode) or wandb not in path.parents:
        return False
    target = os.readlink(path)
    inside = os.path.normpath(os.path.join(path.parent.relative_to(wandb), target))
    return not os.path.isabs(target) and inside != ".." and not inside.startswith("../")
