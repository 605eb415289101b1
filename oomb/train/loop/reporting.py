"""Where each step's metrics go besides metrics.jsonl: ``train.report_to``.

    jsonl        <out_dir>/metrics.jsonl   always: resume rolls it back, the plot and tests read it
    tensorboard  <out_dir>/tensorboard     TensorBoardLog (oomb.train.loop.monitor)
    wandb        a Weights & Biases run    WandbLog; its files under <out_dir>/wandb

TensorBoard and W&B are views of metrics.jsonl, each with every field of its records (tokens, loss_tokens,
seconds, eta_s, ...: monitor.metric_fields) as ``train/<field>`` against ``train/step``. One that cannot be
written (a full disk, a lost connection) is turned off with a warning and the run goes on. A W&B run that
cannot start (not logged in) stops the run before the model is built, since that is where the user looks for it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rich.console import Console

from oomb.train.config.settings import Config, ConfigError, config_to_dict
from oomb.train.loop import monitor
from oomb.train.runfolder.runfiles import RunPathError

REPORTERS = ("jsonl", "tensorboard", "wandb")
_NAMES = {"tensorboard": "TensorBoard events", "wandb": "the W&B run"}
_STOP = {"tensorboard": "TensorBoard events stop", "wandb": "the W&B run stops"}


def check_report_to(cfg: Config) -> None:
    """Known names, and the packages of the views named installed; raises ConfigError before any work."""
    report_to = cfg.train.report_to
    unknown = [name for name in report_to if name not in REPORTERS]
    if unknown:
        raise ConfigError(f"train.report_to={report_to}: unknown {unknown}; choose from jsonl (metrics.jsonl, always "
                          "written), tensorboard and wandb, e.g. train.report_to=[jsonl,wandb]")
    for name, package, extra in (("wandb", "wandb", "oomb[wandb]"), ("tensorboard", "tensorboard", "tensorboard")):
        if name in report_to and importlib.util.find_spec(package) is None:
            raise ConfigError(f"train.report_to lists {name}, but the {package} package is not installed: "
                              f"pip install '{extra}', or leave {name} out of train.report_to")


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:400] if text else ''}"


class Reports:
    """The views of metrics.jsonl a run writes; none where ``enabled`` is False (the ranks besides the first)."""

    def __init__(self, cfg: Config, out: Path, console: Console, enabled: bool = True) -> None:
        self.cfg, self.out, self.console = cfg, out, console
        self.wanted = set(cfg.train.report_to) if enabled else set()
        self.views: dict[str, object] = {}

    def start_wandb(self) -> None:
        """Start (or, resuming, continue) the W&B run; raises ConfigError where it cannot start."""
        if "wandb" not in self.wanted:
            return
        try:
            self.views["wandb"] = monitor.WandbLog(self.out, config_to_dict(self.cfg))
        except RunPathError as e:  # a link in the run folder (oomb.train.runfolder.runfiles), not a W&B failure
            raise ConfigError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - wandb raises its own errors (not logged in, no network, bad entity)
            raise ConfigError(
                f"train.report_to lists wandb, but the W&B run could not start: {first_line(e)}.\nLog in (`wandb "
                f"login`, or set WANDB_API_KEY), or set WANDB_MODE=offline to keep the run in {self.out / 'wandb'} "
                "and `wandb sync` it later, or leave wandb out of train.report_to") from None

    def start_tensorboard(self, resumed_after: int | None) -> None:
        """TensorBoard events; a resumed run drops those of the steps after its checkpoint, as metrics.jsonl does."""
        if "tensorboard" not in self.wanted:
            return
        try:
            self.views["tensorboard"] = monitor.TensorBoardLog(self.out, resumed_after=resumed_after)
        except OSError as e:
            self.console.print(f"warning: TensorBoard events are not written: {e}", highlight=False)

    def log(self, record: dict) -> None:
        for name, view in list(self.views.items()):
            try:
                view.log(record)
            except Exception as e:  # noqa: BLE001 - each writer raises its own errors for a full disk or lost network
                self.console.print(f"warning: {_STOP[name]} at step {record['step'] - 1} ({first_line(e)}); "
                                   "metrics.jsonl goes on", highlight=False)
                self._close(name, failed=True)

    def close(self, failed: bool = False) -> None:
        for name in list(self.views):
            self._close(name, failed)

    def _close(self, name: str, failed: bool) -> None:
        view = self.views.pop(name)
        try:
            view.close(failed=failed)
        except Exception as e:  # noqa: BLE001
            self.console.print(f"warning: closing {_NAMES[name]} failed: {first_line(e)}", highlight=False)
