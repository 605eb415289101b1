"""training.png: titled with the model and the task, the chance loss where the loss is on retrieval answers, memory
from 0."""

import json
import math

import matplotlib
import pytest

from oomb.train.loop import monitor


def _run(tmp_path, config, rss=(0.50, 0.51, 0.505)):
    run = tmp_path / "2026-12-07_10-00-00"
    run.mkdir()
    records = [{"step": i + 1, "loss": 2.5 - i / 2, "host_rss_gib": gib} for i, gib in enumerate(rss)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (run / "config.json").write_text(json.dumps(config))
    return run


def _drawn(run, monkeypatch):
    """The figure plot_run drew (taken as it is closed)."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (figures.append(fig), close(fig)))
    assert monitor.plot_run(run) == run / "training.png"
    assert (run / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    return fig


DEMO = {"model": {"preset": "tiny", "path": None}, "lora": {"r": 0},
        "data": {"task": "passkey", "seq_len": 256, "loss_on": "answer"}}


def test_the_demo_plot_names_model_and_task_draws_chance_and_memory_from_zero(tmp_path, monkeypatch):
    run = _run(tmp_path, DEMO)
    fig = _drawn(run, monkeypatch)
    ax_loss, ax_mem = fig.axes
    assert fig._suptitle.get_text() == ("tiny (random init): passkey at 256 tokens, loss on the answer\n"
                                        "2026-12-07_10-00-00")
    chance = [line for line in ax_loss.lines if list(line.get_ydata()) == [math.log(10)] * 2]
    assert len(chance) == 1 and "chance" in chance[0].get_label()
    assert ax_mem.get_ylim()[0] == 0 and ax_mem.get_ylim()[1] >= 0.51  # 0.01 GiB of change is not the whole axis


def test_other_runs_get_no_chance_line_and_a_folder_without_config_its_name(tmp_path, monkeypatch):
    text = {"model": {"preset": None, "path": "Qwen/Qwen2.5-0.5B@abc"}, "lora": {"r": 16},
            "data": {"task": "text", "seq_len": 4096, "loss_on": "all"}}
    fig = _drawn(_run(tmp_path, text), monkeypatch)
    assert fig._suptitle.get_text().startswith("Qwen/Qwen2.5-0.5B@abc, LoRA r=16: text at 4096 tokens\n")
    assert len(fig.axes[0].lines) == 1  # the training loss alone
    assert monitor.plot_title({}, tmp_path / "run") == "run"
    assert monitor.chance_loss(text) is None and monitor.chance_loss(DEMO) == pytest.approx(2.302585)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert monitor.run_settings(tmp_path / "bare") == {}
    (tmp_path / "bare" / "config.json").write_text("[" * 100_000)  # damaged: the plot is drawn, untitled
    assert monitor.run_settings(tmp_path / "bare") == {}
