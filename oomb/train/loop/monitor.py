"""Watching a run: memory readings, TensorBoard events, a W&B run and the end-of-run plot.

Every step's record (metrics.jsonl) gains ``host_rss_gib`` (this process's resident
memory), on CUDA ``peak_gpu_gib`` (``torch.cuda.max_memory_allocated`` since the run
started), ``peak_gpu_reserved_gib`` (the caching allocator's peak: allocated plus the freed blocks it keeps) and
``gpu_outside_allocator_gib`` (the GPU memory in use that the allocator does not hold: the CUDA context and
libraries' own buffers, and any other process on the card), ``pinned_host_gib`` with ``train.offload`` (the
offloaded pages' pinned host pools, part of the RSS) and ``eta_s`` (seconds left at the mean step time of this session).
``train.report_to`` sends every field of the record (``metric_fields``: tokens, loss_tokens, seconds, eta_s,
val_tokens, ... as metrics.jsonl holds them) to ``<out_dir>/tensorboard`` and to a Weights & Biases run
(oomb.train.loop.reporting); at the end ``<out_dir>/training.png`` draws loss and memory against the step.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
from pathlib import Path

import psutil
import torch

from oomb.train.config.bounded import loads_json
from oomb.train.runfolder.runfiles import WANDB_DIR, check, make_folder, open_file, read_text

GIB = 2**30
PLOT = "training.png"
# The loss of a guess: passkey and needle answers are digits, so loss on the answer alone starts at ln 10 nats
# (a uniform guess among the ten) and falls below it as the model retrieves.
CHANCE_LOSS = math.log(10)
TENSORBOARD = "tensorboard"
WANDB_RUN = "wandb-run.json"  # the W&B run's id and project, so a resumed run continues it


def metric_fields(record: dict) -> tuple[dict[str, float], dict[str, str]]:
    """A metrics record's fields besides ``step`` (the x-axis), as TensorBoard and W&B get them: the numbers, and the
    words (a skipped step's reason and where its non-finite value was); None (not measured at this step) is left out."""
    numbers, words = {}, {}
    for name, value in record.items():
        if name == "step" or value is None:
            continue
        if isinstance(value, bool):
            numbers[name] = float(value)
        elif isinstance(value, int | float):
            numbers[name] = value
        else:
            words[name] = str(value)
    return numbers, words


def memory_fields(device: torch.device, pinned_bytes: int | None = None) -> dict[str, float]:
    """Host RSS, on CUDA the peak allocated and reserved GPU memory and the use outside the allocator, and the given
    pinned host bytes, in GiB. The card held up to peak reserved + outside the allocator; the step needed less where
    the allocator kept freed blocks it could have given back (it does so before it reports out of memory)."""
    fields = {"host_rss_gib": psutil.Process(os.getpid()).memory_info().rss / GIB}
    if device.type == "cuda":
        fields["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        fields["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        free, total = torch.cuda.mem_get_info(device)
        fields["gpu_outside_allocator_gib"] = max(0, total - free - torch.cuda.memory_reserved(device)) / GIB
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
        numbers, words = metric_fields(record)
        for name, value in numbers.items():
            self.writer.add_scalar(f"train/{name}", value, record["step"])
        for name, text in words.items():
            self.writer.add_text(f"train/{name}", text, record["step"])
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

        from oomb.train.runfolder.checkpoint import write_text_atomic

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
        numbers, words = metric_fields(record)
        self.run.log({"train/step": record["step"], **{f"train/{k}": v for k, v in {**numbers, **words}.items()}})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in read_text(path).splitlines() if line.strip()]


def run_settings(out_dir: Path) -> dict:
    """The run folder's config.json as a mapping; empty where it cannot be read (the plot draws without it)."""
    path = out_dir / "config.json"
    try:
        data = loads_json(read_text(path)) if check(path) else {}
    except (OSError, ValueError):  # a link refused (RunPathError), a damaged file: only the title is lost
        return {}
    return data if isinstance(data, dict) else {}


def plot_title(settings: dict, out_dir: Path) -> str:
    """What the plot shows: the model, the task at its length, where the loss is, then the run folder, e.g.
    "tiny (random init), passkey at 256 tokens, loss on the answer / runs/2026-12-07_10-00-00"."""
    model, data = settings.get("model") or {}, settings.get("data") or {}
    if not isinstance(model, dict) or not isinstance(data, dict) or not (model.get("path") or model.get("preset")):
        return out_dir.name
    name = str(model.get("path") or f"{model.get('preset')} (random init)")
    lora = (settings.get("lora") or {}).get("r") if isinstance(settings.get("lora"), dict) else None
    task = f"{data.get('task')} at {data.get('seq_len')} tokens"
    where = f", loss on the {data['loss_on']}" if data.get("loss_on") in ("answer", "assistant") else ""
    return f"{name}{f', LoRA r={lora}' if lora else ''}: {task}{where}\n{out_dir.name}"


def chance_loss(settings: dict) -> float | None:
    """The loss of a uniform guess where the run's loss is on passkey or needle answers (digits), else None."""
    data = settings.get("data") if isinstance(settings.get("data"), dict) else {}
    return CHANCE_LOSS if data.get("task") in ("passkey", "needle") and data.get("loss_on") == "answer" else None


def plot_run(out_dir: Path) -> Path | None:
    """Draw loss and memory against the step from metrics.jsonl into ``training.png`` (atomically): titled with the
    model and task (config.json), the chance loss drawn where the loss is on retrieval answers, memory from 0."""
    records = read_metrics(out_dir / "metrics.jsonl") if check(out_dir / "metrics.jsonl") else []
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    settings = run_settings(out_dir)
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_mem) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in records], color="tab:blue", label="training")
    validated = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if validated:
        ax_loss.plot(*zip(*validated, strict=True), "o-", color="tab:orange", label="validation")
    if (chance := chance_loss(settings)) is not None:
        ax_loss.axhline(chance, color="gray", linestyle="--", label=f"chance: a random digit (ln 10 = {chance:.2f})")
    if len(ax_loss.lines) > 1:
        ax_loss.legend()
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    for key, label in (("peak_gpu_gib", "peak GPU allocated"), ("host_rss_gib", "host RSS"),
                       ("pinned_host_gib", "pinned pages (offload)")):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            ax_mem.plot(*zip(*points, strict=True), label=label)
    ax_mem.set_ylabel("memory (GiB)")
    top = max((max(line.get_ydata()) for line in ax_mem.lines), default=0)
    if top > 0:  # from 0: a flat line stays flat, not 0.01 GiB of noise across the whole height
        ax_mem.set_ylim(0, top * 1.15)
    ax_mem.set_xlabel("step")
    ax_mem.grid(alpha=0.3)
    if ax_mem.lines:
        ax_mem.legend()
    fig.suptitle(plot_title(settings, out_dir), fontsize=10)
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
