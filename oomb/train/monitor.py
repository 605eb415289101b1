"""Watching a run: memory readings, TensorBoard events, a W&B run and the end-of-run plot.

Every step's record (metrics.jsonl) gains ``host_rss_gib`` (this process's resident
memory), ``peak_gpu_gib`` on CUDA (``torch.cuda.max_memory_allocated`` since the run
started), ``pinned_host_gib`` with ``train.offload`` (the offloaded pages' pinned host
pools, part of the RSS) and ``eta_s`` (seconds left at the mean step time of this session).
``train.report_to`` sends the same numbers to ``<out_dir>/tensorboard`` and to a Weights & Biases
run (oomb.train.reporting); at the end ``<out_dir>/training.png`` draws loss and memory against the step.
"""

from __future__ import annotations

import json
import os
import secrets
import string
from pathlib import Path

import psutil
import torch

from oomb.train.runfiles import WANDB_DIR, check, make_folder, open_file, read_text

GIB = 2**30
PLOT = "training.png"
TENSORBOARD = "tensorboard"
WANDB_RUN = "wandb-run.json"  # the W&B run's id and project, so a resumed run continues it
# Fields of a metrics record drawn as TensorBoard scalars (when present and not None).
_SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "host_rss_gib", "peak_gpu_gib",
            "pinned_host_gib")


def memory_fields(device: torch.device, pinned_bytes: int | None = None) -> dict[str, float]:
    """Host RSS, on CUDA the peak allocated GPU memory, and the given pinned host bytes, in GiB."""
    fields = {"host_rss_gib": psutil.Process(os.getpid()).memory_info().rss / GIB}
    if device.type == "cuda":
        fields["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    if pinned_bytes is not None:
        fields["pinned_host_gib"] = pinned_bytes / GIB
    return fields


class TensorBoardLog:
    """Metrics records as TensorBoard scalars (``torch.utils.tensorboard``), x-axis = optimizer step."""

    def __init__(self, out_dir: Path, resumed_after: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise RuntimeError("train.tensorboard=true needs the tensorboard package: pip install tensorboard") from e
        # A resumed run drops the events of steps after its checkpoint, as metrics.jsonl does.
        purge = resumed_after + 1 if resumed_after is not None else None
        self.writer = SummaryWriter(log_dir=str(make_folder(out_dir / TENSORBOARD)), purge_step=purge)

    def log(self, record: dict) -> None:
        for name in _SCALARS:
            if record.get(name) is not None:
                self.writer.add_scalar(f"train/{name}", record[name], record["step"])
        self.writer.flush()

    def close(self, failed: bool = False) -> None:  # failed: an event file has no run state to mark
        self.writer.close()


class WandbLog:
    """Metrics records as a Weights & Biases run, x-axis ``train/step``.

    The run's id and project are kept in ``<out_dir>/wandb-run.json``: a resumed oomb run continues
    the same W&B run. Steps that run again after a resume are logged again (W&B keeps history; the
    chart shows both), while metrics.jsonl moves the first ones aside. W&B's own files go under
    ``<out_dir>/wandb``; with WANDB_MODE=offline the whole run is there, for ``wandb sync``.
    """

    def __init__(self, out_dir: Path, config: dict) -> None:
        import wandb

        from oomb.train.checkpoint import write_text_atomic

        path = out_dir / WANDB_RUN
        make_folder(out_dir / WANDB_DIR)  # W&B writes into it: a link there is refused, not followed
        if check(path):
            ident = json.loads(read_text(path))
        else:  # written before the W&B run starts, so a run killed at any point later resumes it
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's form
            ident = {"id": run_id, "project": os.environ.get("WANDB_PROJECT") or "oomb"}
            write_text_atomic(path, json.dumps(ident))
        self.run = wandb.init(project=ident["project"], id=ident["id"], resume="allow", name=out_dir.name,
                              dir=str(out_dir), config=config)
        self.run.define_metric("train/step")
        self.run.define_metric("train/*", step_metric="train/step")

    def log(self, record: dict) -> None:
        values = {f"train/{name}": record[name] for name in _SCALARS if record.get(name) is not None}
        self.run.log({"train/step": record["step"], **values})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in read_text(path).splitlines() if line.strip()]


def plot_run(out_dir: Path) -> Path | None:
    """Draw loss and memory against the step from metrics.jsonl into ``training.png`` (atomically)."""
    records = read_metrics(out_dir / "metrics.jsonl") if check(out_dir / "metrics.jsonl") else []
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_mem) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in records], color="tab:blue", label="training")
    validated = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if validated:
        ax_loss.plot(*zip(*validated, strict=True), "o-", color="tab:orange", label="validation")
        ax_loss.legend()
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    for key, label in (("peak_gpu_gib", "peak GPU allocated"), ("host_rss_gib", "host RSS"),
                       ("pinned_host_gib", "pinned pages (offload)")):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            ax_mem.plot(*zip(*points, strict=True), label=label)
    ax_mem.set_ylabel("memory (GiB)")
    ax_mem.set_xlabel("step")
    ax_mem.grid(alpha=0.3)
    if ax_mem.lines:
        ax_mem.legend()
    fig.suptitle(out_dir.name)
    fig.tight_layout()
    final = out_dir / PLOT
    tmp = final.with_name(final.name + ".tmp.png")
    try:
        check(final)  # the rename below would replace a link silently
        with os.fdopen(open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:  # never through a link
            fig.savefig(f, dpi=120, format="png")
        os.replace(tmp, final)
    except BaseException:  # a full disk: no half-drawn file is left
        if os.path.isfile(tmp) and not os.path.islink(tmp):
            tmp.unlink()
        raise
    finally:
        plt.close(fig)
    return final
