"""The run folder: where a run starts or resumes, its lock, and the files written beside checkpoints.

    <out_dir>/
      .lock                  held (flock) by the process training in the folder; names it
      config.json            the resolved config (config.before-step-N.json: one a resume replaced)
      inputs.json            its data files and base model, compared on resume (oomb.train.runfolder.inputs_record)
      metrics.jsonl          one line per step (metrics.rolled-back.jsonl: lines of steps run again)
      checkpoints/ export/   oomb.train.runfolder.checkpoint

Nothing in a run folder is trusted as code or as a path: a resumed run takes
``model.trust_remote_code`` from the command line only, ``latest`` must name one of the
run's own checkpoints (oomb.train.runfolder.checkpoint.find_checkpoint), and a link or a special file
anywhere in the folder, or a hard link where the run writes in place (IN_PLACE), is refused before anything
in it is read (oomb.train.runfolder.runfiles).

A run that stopped before its first checkpoint (killed, crashed, a full disk) holds its config.json
and no checkpoint: ``resume=<run>`` starts it again from step 1 with that config (``resume_target``).
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

from oomb.train.config.bounded import loads_json
from oomb.train.config.settings import Config, ConfigError, config_json, config_to_dict, load_config
from oomb.train.loop.faults import EXIT_SIGINT, EXIT_WRITE, RunStopped, resume_command
from oomb.train.loop.monitor import TENSORBOARD, WANDB_RUN
from oomb.train.loop.run import write_failure
from oomb.train.runfolder.checkpoint import (
    CHECKPOINTS,
    LATEST,
    CheckpointError,
    checkpoint_state,
    find_checkpoint,
    list_checkpoints,
    newest_good_checkpoint,
    verify_checkpoint,
    write_text_atomic,
)
from oomb.train.runfolder.inputs_record import INPUTS, write_inputs
from oomb.train.runfolder.runfiles import WANDB_DIR, RunPathError, check, check_tree, open_file, read_text

LOCK = ".lock"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHUNKS = "chunks.jsonl"  # train.log_chunks: each chunk's start (oomb.train.loop.chunk_progress)
ROLLED_BACK = "metrics.rolled-back.jsonl"
# What a run killed before it wrote its config.json leaves: a folder holding only these takes a new run.
UNSTARTED = (LOCK, INPUTS, INPUTS + ".tmp", CONFIG + ".tmp")
IN_PLACE = (LOCK, METRICS, ROLLED_BACK, CHUNKS)  # written in place, not renamed into place: no hard link may name them


def run_dir_of(ckpt: Path) -> Path:
    return ckpt.parent.parent  # <run>/checkpoints/step-N


def load_run_config(config_path: str | None, overrides: list[str]) -> Config:
    """The run's config; with resume=... and no config file, the resumed run's config.json is the base.

    A run folder may come from anyone: its config.json never turns on running the model folder's
    code, nor accepts changed inputs; ``model.trust_remote_code=true``, ``data.accept_changed=true`` and
    ``model.accept_changed=true`` must be given on the command line.
    """
    cfg = load_config(config_path, overrides)
    if cfg.resume is not None and config_path is None:
        run_dir, _ = resume_target(cfg)
        cfg = load_config(run_dir / CONFIG, overrides)
        given = {item.partition("=")[0] for item in overrides}
        for key in ("model.trust_remote_code", "model.accept_changed", "data.accept_changed"):
            if key not in given:
                section, name = key.split(".")
                setattr(getattr(cfg, section), name, False)
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
        started = load_config(resume_target(cfg)[0] / CONFIG).train
    except ConfigError:
        return  # no such run or a damaged config.json: check_paths says so before any work
    for key in auto:
        if getattr(started, key) != "auto":
            setattr(cfg.train, key, getattr(started, key))


def resume_target(cfg: Config) -> tuple[Path, Path | None]:
    """The run folder ``resume=`` names and its checkpoint to continue from: the run's newest, or the one named.

    None for a run that stopped before its first checkpoint: a run folder with its config.json and no
    checkpoint starts again from step 1 with that config. The folder is checked whole (check_tree) before
    anything in it but ``latest`` is read: a link or a special file anywhere in it is refused.
    """
    given = Path(cfg.resume)
    if not given.is_dir():
        raise ConfigError(f"resume={cfg.resume!r} {'is a file' if given.exists() else 'does not exist'}: give a run "
                          "folder or one of its checkpoints")
    try:
        ckpt = find_checkpoint(given)
    except CheckpointError as e:
        if not _stopped_before_first_checkpoint(given):
            raise ConfigError(f"resume={cfg.resume!r}: {e}") from e
        ckpt = None
    run = given if ckpt is None else run_dir_of(ckpt)
    if ckpt is not None and (ckpt.parent.name != CHECKPOINTS or not os.path.lexists(run / CONFIG)
                             or ckpt.resolve().parent != (run / CHECKPOINTS).resolve()):
        try:  # a link named step-N in a run's checkpoints/ (to another run's): say so
            check(ckpt, "folder")
            why = ""
        except RunPathError as e:
            why = f": {e}"
        raise ConfigError(f"resume={cfg.resume!r}: {ckpt} is not inside an oomb run folder "
                          f"(<run>/checkpoints/step-N beside <run>/config.json){why}")
    try:
        check_tree(run)
        for name in IN_PLACE:
            check(run / name, written=True)
    except RunPathError as e:
        raise ConfigError(f"resume={cfg.resume!r}: {e}") from None
    return run, ckpt


def _stopped_before_first_checkpoint(run: Path) -> bool:
    """A run folder with its config.json, and neither a checkpoint nor a ``latest`` naming one."""
    try:
        return check(run / CONFIG) and not os.path.lexists(run / CHECKPOINTS / LATEST) and not list_checkpoints(run)
    except RunPathError:
        return False  # find_checkpoint's refusal names the link


def check_paths(cfg: Config) -> Path | None:
    """The run folder, before any work; returns the verified checkpoint to resume from (None: a new run, or a
    resumed one that stopped before its first checkpoint)."""
    if cfg.resume is not None:
        run, ckpt = resume_target(cfg)
        _check_writable(run, f"resume={cfg.resume!r}: the run folder {run}")
        if ckpt is None:
            return None
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
    if out.is_symlink() and not out.exists():
        raise ConfigError(f"out_dir={str(out)!r} is a link to {os.readlink(out)}, which does not exist: make that "
                          "folder first, or give another out_dir")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir={str(out)!r} is a file, not a folder")
    if cfg.out_dir is not None and out.is_dir():
        _check_new_run_folder(out)
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    _check_writable(parent, f"out_dir={str(out)!r}: {parent}")
    return None


def _check_new_run_folder(out: Path) -> None:
    """A new run's out_dir that exists: empty, or holding only what a run killed before its config.json leaves
    (UNSTARTED, checked as files: a link there is refused)."""
    if any(entry.name not in UNSTARTED for entry in out.iterdir()):
        raise _holds_files(out)
    try:
        for name in UNSTARTED:
            check(out / name, written=True)
    except RunPathError as e:
        raise ConfigError(f"out_dir={str(out)!r}: {e}") from None


def _holds_files(out: Path) -> ConfigError:
    """The refusal of a new run into a folder that holds files (a run's: it says how to continue that run)."""
    if not os.path.lexists(out / CONFIG):
        return ConfigError(f"out_dir {out} already holds files; oomb never overwrites a run. Choose another "
                           "out_dir=...")
    try:  # a run's folder: a link or a special file in it first, or the resume advised below would refuse it
        check_tree(out)
        unsaved = _stopped_before_first_checkpoint(out)
    except RunPathError as e:
        return ConfigError(f"out_dir={str(out)!r} already holds a run's files, and {e}, or choose another "
                           "out_dir=...")
    except OSError:
        unsaved = False
    what = ("of a run that stopped before its first checkpoint; oomb never overwrites a run. Start it again from "
            "step 1 with its config.json (key=value settings after it change that config) with" if unsaved else
            "of a run; oomb never overwrites a run. Continue it with")
    return ConfigError(f"out_dir {out} already holds files {what}:\n  {resume_command(out)}\nor choose another "
                       "out_dir=...")


def _check_writable(folder: Path, what: str) -> None:
    """Create and remove a file in ``folder``: permission bits do not bind root, and a file system may be read-only."""
    if not folder.is_dir():
        raise ConfigError(f"{what} is not a writable folder (it is a file), so the run cannot be written")
    probe = folder / f".oomb-write-test-{os.getpid()}"
    try:  # a new file, never one put there (O_EXCL: not through a link either)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{what} is not a writable folder ({e.strerror}), so the run cannot be written") from None


def prepare_out_dir(cfg: Config) -> tuple[Path, bool]:
    """The run folder, created for a new run; returns it and whether this call created it."""
    if cfg.resume is not None:
        return resume_target(cfg)[0], False
    if cfg.out_dir is None:
        out = Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    else:
        out = Path(cfg.out_dir)
    if out.is_dir():
        _check_new_run_folder(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    return out, created


def remove_unstarted_run(out: Path, created: bool) -> str:
    """Remove what a new run that never finished a step wrote (the folder too if it made it); says what is left.

    Best effort: on a read-only or failing disk some of it may stay; an empty folder does not
    stop the same command from running again. Nothing is followed (unlink and rmtree remove a link
    itself), and a folder that holds a logged step or a checkpoint is kept whole.
    """
    try:
        if check(out / METRICS) and os.stat(out / METRICS).st_size or list_checkpoints(out):
            return f"{out} is kept: it holds a trained step"
    except OSError:
        return f"{out} is kept"
    for name in (CONFIG, CONFIG + ".tmp", INPUTS, INPUTS + ".tmp", METRICS, CHUNKS, LOCK, WANDB_RUN):
        try:
            (out / name).unlink(missing_ok=True)
        except OSError:
            pass
    for name in (WANDB_DIR, TENSORBOARD, CHECKPOINTS):  # W&B's files; what a first save left (step-N.tmp)
        if os.path.isdir(out / name) and not os.path.islink(out / name):
            shutil.rmtree(out / name, ignore_errors=True)
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
        fd = open_file(self.path, os.O_RDWR | os.O_CREAT)  # never a link: truncating it would truncate what it names
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
        old = loads_json(read_text(path))  # nesting bounded (oomb.train.config.bounded)
    except (OSError, ValueError):  # a link is refused by the write below
        old = None
    if old is not None and {k: v for k, v in old.items() if k != "resume"} == {
            k: v for k, v in new.items() if k != "resume"}:
        return None
    kept = out / f"config.before-step-{step:08d}.json"
    n = 1
    while check(kept):  # resumed at this step before: keep every earlier config (a link there is refused)
        kept, n = out / f"config.before-step-{step:08d}.{n}.json", n + 1
    if old is not None:
        write_text_atomic(kept, read_text(path))  # a copy first: config.json is never missing, even after a crash
    write_text_atomic(path, config_json(cfg))
    return kept if old is not None else None


def roll_back_metrics(out: Path, step: int) -> None:
    """Keep the metrics of steps <= ``step``; lines of steps that will run again move to a side file."""
    path = out / METRICS
    if not check(path):
        return
    keep, redo = [], []
    for line in read_text(path).splitlines():
        try:
            done = loads_json(line)["step"] <= step
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill (or nested too deep): kept aside
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
    """metrics.jsonl, one whole line per step or none: a write the disk cannot take is undone.

    The file is opened (never through a link) at the first line: a run stopped before its first step leaves none.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd: int | None = None

    def append(self, record: dict) -> None:
        self.append_line(json.dumps(record))

    def append_line(self, text: str) -> None:
        if self.path is None:
            return
        if self._fd is None:
            self._fd = open_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
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


# ---------------------------------------------------------------------------------- stops before the loop


def open_run_folder(cfg: Config, out: Path, created: bool, main_rank: bool,
                    inputs: dict | None = None) -> RunLock | None:
    """Lock the run folder and write ``inputs`` (inputs.json: a new run's, or a resumed run's where it changed)
    and, for a new run, its config.json (before the model is built)."""
    if not main_rank:
        return None
    lock = None
    try:
        lock = RunLock(out).acquire()
        if inputs is not None:
            write_inputs(out, inputs)
        if cfg.resume is None:
            write_config(out, cfg)
    except OSError as e:
        if lock is not None:
            lock.release()
        left = "" if cfg.resume is not None else f" and {remove_unstarted_run(out, created)}"
        raise RunStopped(f"could not write to the run folder {out}: {write_failure(e, out.parent)}.\nNothing was "
                         f"trained{left}; then run the same command again", EXIT_WRITE) from None
    return lock


def nothing_trained(cfg: Config, out: Path, created: bool, main_rank: bool) -> str:
    """The end of a refusal that came once the run folder was open (W&B, the model): a new run's files are
    removed, so the same command runs once the cause is fixed; a resumed run's folder is as it was."""
    if cfg.resume is not None or not main_rank:
        return ""
    return f"\nNothing was trained; {remove_unstarted_run(out, created)}"


def interrupted(cfg: Config, out: Path | None, created: bool, main_rank: bool, run) -> RunStopped:
    """Ctrl-C outside the loop, which catches signals itself: while the data is read (``out`` None: no run folder
    yet), while the model, the optimizer or the resume are built (nothing trained: a new run leaves nothing), or
    after the last step (the plot, the export). ``run``: the oomb.train.loop.run.Run, once built."""
    if run is not None and run.saved_step is not None and run.saved_step > run.start:
        return RunStopped(f"interrupted after step {run.saved_step} of {cfg.train.steps}, before the run's last "
                          f"files were written: {run.newest_checkpoint()}. Continue with (it writes them):\n  "
                          f"{resume_command(out)}", EXIT_SIGINT)
    left = ("nothing was written" if out is None else remove_unstarted_run(out, created)
            if cfg.resume is None and main_rank else "the run folder is as it was")
    return RunStopped(f"interrupted before the first step: nothing was trained; {left}. Run the same command again "
                      f"to {'start' if cfg.resume is None else 'continue'}", EXIT_SIGINT)


def crash_note(out: Path) -> str:
    """Printed under the traceback of an error oomb did not expect (a bug): the run folder is kept, and says how
    to go on once the cause is fixed."""
    try:
        saved = f"its newest checkpoint is {find_checkpoint(out)}"
    except CheckpointError:
        saved = "it has no checkpoint yet (resume= starts it again from step 1 with its config.json)"
    return (f"oomb: the run stopped on the error above; the run folder {out} is kept and {saved}. Once the cause "
            f"is fixed, continue with:\n  {resume_command(out)}")
