"""The run folder: where a run starts or resumes, its lock, and the files written beside checkpoints.

    <out_dir>/
      .lock                  held (flock) by the process training in the folder; names it
      config.json            the resolved config (config.before-step-N.json: one a resume replaced)
      metrics.jsonl          one line per step (metrics.rolled-back.jsonl: lines of steps run again)
      checkpoints/ export/   oomb.train.checkpoint

Nothing in a run folder is trusted as code or as a path: a resumed run takes
``model.trust_remote_code`` from the command line only, and ``latest`` must name one of the
run's own checkpoints (oomb.train.checkpoint.find_checkpoint).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
from pathlib import Path

from oomb.train.checkpoint import (
    CheckpointError,
    checkpoint_state,
    find_checkpoint,
    newest_good_checkpoint,
    verify_checkpoint,
    write_text_atomic,
)
from oomb.train.config import Config, ConfigError, config_json, config_to_dict, load_config
from oomb.train.faults import resume_command

LOCK = ".lock"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
ROLLED_BACK = "metrics.rolled-back.jsonl"


def run_dir_of(ckpt: Path) -> Path:
    return ckpt.parent.parent  # <run>/checkpoints/step-N


def load_run_config(config_path: str | None, overrides: list[str]) -> Config:
    """The run's config; with resume=... and no config file, the resumed run's config.json is the base.

    A run folder may come from anyone: its config.json never turns on running the model folder's
    code; ``model.trust_remote_code=true`` must be given again on the command line.
    """
    cfg = load_config(config_path, overrides)
    if cfg.resume is not None and config_path is None:
        run_dir = run_dir_of(resume_checkpoint(cfg))
        cfg = load_config(run_dir / CONFIG, overrides)
        given = {item.partition("=")[0] for item in overrides}
        if "model.trust_remote_code" not in given:
            cfg.model.trust_remote_code = False
    if cfg.resume is not None:
        _keep_started_schedule(cfg)
    return cfg


def _keep_started_schedule(cfg: Config) -> None:
    """train.lr / warmup_steps left at auto on a resume are the values the run started with (its config.json
    holds them resolved), not the rule's answer today: a resumed run keeps its schedule unless one is given."""
    auto = [key for key in ("lr", "warmup_steps") if getattr(cfg.train, key) == "auto"]
    if not auto:
        return
    try:
        started = load_config(run_dir_of(resume_checkpoint(cfg)) / CONFIG).train
    except ConfigError:
        return  # no such run or a damaged config.json: check_paths says so before any work
    for key in auto:
        if getattr(started, key) != "auto":
            setattr(cfg.train, key, getattr(started, key))


def resume_checkpoint(cfg: Config) -> Path:
    """The checkpoint ``resume=`` names: a run folder's newest, or one checkpoint folder of a run."""
    if not Path(cfg.resume).exists():
        raise ConfigError(f"resume={cfg.resume!r} does not exist: give a run folder or one of its checkpoints")
    try:
        ckpt = find_checkpoint(Path(cfg.resume))
    except CheckpointError as e:
        raise ConfigError(f"resume={cfg.resume!r}: {e}") from e
    run = run_dir_of(ckpt)
    if ckpt.parent.name != "checkpoints" or not (run / CONFIG).is_file() \
            or ckpt.resolve().parent != (run / "checkpoints").resolve():
        raise ConfigError(f"resume={cfg.resume!r}: {ckpt} is not inside an oomb run folder "
                          "(<run>/checkpoints/step-N beside <run>/config.json)")
    return ckpt


def check_paths(cfg: Config) -> Path | None:
    """The run folder, before any work; returns the verified checkpoint to resume from."""
    if cfg.resume is not None:
        ckpt = resume_checkpoint(cfg)
        run = run_dir_of(ckpt)
        _check_writable(run, f"resume={cfg.resume!r}: the run folder {run}")
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            good = newest_good_checkpoint(run, excluding=ckpt)
            offer = (f"The newest good checkpoint of this run is {good}; continue from it with:\n  "
                     f"{resume_command(good)}" if good is not None else "No other checkpoint of this run is intact.")
            raise ConfigError(f"cannot resume: {e}.\n{offer}") from e
        done = checkpoint_state(ckpt).get("step", 0)
        if done > cfg.train.steps:
            raise ConfigError(f"resume={cfg.resume!r}: {ckpt} is after step {done}, past train.steps="
                              f"{cfg.train.steps}; to train on, set train.steps above {done} (e.g. "
                              f"train.steps={done + max(cfg.train.steps, 1)})")
        return ckpt
    out = Path(cfg.out_dir) if cfg.out_dir is not None else Path("runs")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir={str(out)!r} is a file, not a folder")
    if cfg.out_dir is not None and out.is_dir() and any(out.iterdir()):
        raise _holds_files(out)
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    _check_writable(parent, f"out_dir={str(out)!r}: {parent}")
    return None


def _holds_files(out: Path) -> ConfigError:
    """The refusal of a new run into a folder that holds files (a run's: it says how to continue that run)."""
    advice = f", or continue that run with resume={str(out)!r}" if (out / "config.json").exists() else ""
    return ConfigError(f"out_dir {out} already holds files; oomb never overwrites a run. Choose another "
                       f"out_dir=...{advice}")


def _check_writable(folder: Path, what: str) -> None:
    """Create and remove a file in ``folder``: permission bits do not bind root, and a file system may be read-only."""
    if not folder.is_dir():
        raise ConfigError(f"{what} is not a writable folder (it is a file), so the run cannot be written")
    probe = folder / f".oomb-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{what} is not a writable folder ({e.strerror}), so the run cannot be written") from None


def prepare_out_dir(cfg: Config) -> tuple[Path, bool]:
    """The run folder, created for a new run; returns it and whether this call created it."""
    if cfg.resume is not None:
        return run_dir_of(resume_checkpoint(cfg)), False
    if cfg.out_dir is None:
        out = Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    else:
        out = Path(cfg.out_dir)
    if out.exists() and any(out.iterdir()):
        raise _holds_files(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    return out, created


def remove_unstarted_run(out: Path, created: bool) -> str:
    """Remove what a run that never finished a step wrote (the folder too if it made it); says what is left.

    Best effort: on a read-only or failing disk some of it may stay; an empty folder does not
    stop the same command from running again.
    """
    for name in (CONFIG, METRICS, LOCK):
        try:
            (out / name).unlink(missing_ok=True)
        except OSError:
            pass
    if created:
        shutil.rmtree(out, ignore_errors=True)
    if not out.exists():
        return "nothing was left behind"
    left = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    return f"{out} is left empty" if not left else f"{out} still holds {left}: remove them"


class RunLock:
    """An exclusive lock on a run folder while a process trains in it (released when the process ends).

    Two processes training in one folder would overwrite each other's checkpoints and lose
    metrics. ``flock`` is released by the kernel when the holder dies, so a killed run never
    leaves a stale lock; the file names the holder for the message the next process prints.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 4096).decode(errors="replace").strip()
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise ConfigError(f"the run folder {self.path.parent} is in use: {_describe_holder(holder)}. Two "
                              "processes in one run folder would overwrite each other's checkpoints and metrics; "
                              "wait for it to end or stop it first") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": datetime.datetime.now().isoformat(
            timespec="seconds"), "command": " ".join(sys.argv)}
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(holder).encode())
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (unlinking it would race a new holder)
            self._fd = None


def _describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        return (f"process {h['pid']} on {h['host']} has trained in it since {h['since']} ({h['command']}); "
                f"stop it with kill -INT {h['pid']} (it writes a checkpoint first)")
    except (ValueError, KeyError, TypeError):
        return "another process holds its lock"


def write_config(out: Path, cfg: Config) -> None:
    write_text_atomic(out / CONFIG, config_json(cfg))


def record_resumed_config(out: Path, cfg: Config, step: int) -> Path | None:
    """Make <run>/config.json the config this resumed run uses, keeping the one it replaces.

    A later ``resume=<run>`` starts from config.json: without this it would go back to the
    settings of the first start and drop the ones given when resuming. Returns the kept file.
    """
    path = out / CONFIG
    new = config_to_dict(cfg)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = None
    if old is not None and {k: v for k, v in old.items() if k != "resume"} == {
            k: v for k, v in new.items() if k != "resume"}:
        return None
    kept = out / f"config.before-step-{step:08d}.json"
    n = 1
    while kept.exists():  # resumed at this step before: keep every earlier config
        kept, n = out / f"config.before-step-{step:08d}.{n}.json", n + 1
    if old is not None:
        write_text_atomic(kept, path.read_text())  # a copy first: config.json is never missing, even after a crash
    write_text_atomic(path, config_json(cfg))
    return kept if old is not None else None


def roll_back_metrics(out: Path, step: int) -> None:
    """Keep the metrics of steps <= ``step``; lines of steps that will run again move to a side file."""
    path = out / METRICS
    if not path.is_file():
        return
    keep, redo = [], []
    for line in path.read_text().splitlines():
        try:
            done = json.loads(line)["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a kill: kept aside
            done = False
        (keep if done else redo).append(line)
    if redo:
        side = MetricsLog(path.with_name(ROLLED_BACK))  # whole lines or none, as metrics.jsonl itself
        try:
            for line in redo:
                side.append_line(line)
        except OSError:
            side.close(remove_if_empty=True)
            raise
        side.close()
    write_text_atomic(path, "".join(line + "\n" for line in keep))


class MetricsLog:
    """metrics.jsonl, one whole line per step or none: a write the disk cannot take is undone."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path is not None else None

    def append(self, record: dict) -> None:
        self.append_line(json.dumps(record))

    def append_line(self, text: str) -> None:
        if self._fd is None:
            return
        line = (text + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            if os.write(self._fd, line) != len(line):  # a short write: the disk filled up mid-line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            os.ftruncate(self._fd, size)  # no half line for the next reader
            raise

    def close(self, remove_if_empty: bool = False) -> None:
        if self._fd is not None:
            empty = os.fstat(self._fd).st_size == 0
            os.close(self._fd)
            self._fd = None
            if remove_if_empty and empty:
                self.path.unlink(missing_ok=True)
