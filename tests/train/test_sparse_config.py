"""`oomb train` with page-sparse attention: the train.page_budget keys reach chunked_backward, runs resume."""

import json
import shutil
from pathlib import Path

import pytest

from oomb.cli import main
from oomb.sparse import PageSelection
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.config.step import page_selection

# 256-token sequences in 128-token chunks of 32-token pages: the last chunk has 4 past pages, so a
# budget of 2 leaves pages out.
FAST = ["data.seq_len=256", "train.chunk_size=128", "train.page_size=32", "train.device=cpu", "train.lr=0.01",
        "train.warmup_steps=1", "train.export=false"]
SPARSE = ["train.page_budget=2", "train.select_block=64", "train.local_pages=1", "train.select_per_head=true"]


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_config_keys_build_the_selection():
    assert page_selection(load_config(None, [])) is None  # dense by default
    cfg = load_config(None, SPARSE + ["train.sink_pages=1"])
    assert page_selection(cfg) == PageSelection(page_budget=2, block=64, sink_pages=1, local_pages=1, per_head=True,
                                                chunk_pages=2)  # auto: the budget
    assert page_selection(load_config(None, ["train.page_budget=2"])).score == "bound"  # the default
    assert page_selection(load_config(None, ["train.page_budget=2", "train.select_score=mean"])).score == "mean"


def test_sparse_run_trains_and_resumes_exactly(tmp_path):
    dense, run = tmp_path / "dense", tmp_path / "run"
    assert main(["train", f"out_dir={dense}", "train.steps=2", *FAST]) == 0
    assert main(["train", f"out_dir={run}", "train.steps=4", "train.save_every=2", *FAST, *SPARSE]) == 0
    losses = _losses(run)
    assert losses[0] != _losses(dense)[0]  # the first forward left pages out: sparse attention ran
    assert losses[-1] < losses[0]
    assert json.loads((run / "config.json").read_text())["train"]["page_budget"] == 2

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert main(["train", f"resume={copy / 'checkpoints' / 'step-00000002'}"]) == 0
    assert _losses(copy) == losses  # the resumed run's config keeps the budget: same pages, same losses
    final = "checkpoints/step-00000004/model.safetensors"
    assert (copy / final).read_bytes() == (run / final).read_bytes()


@pytest.mark.parametrize("args,match", [
    (["train.page_budget=0"], "page_budget must be >= 1"),
    (["train.page_budget=4", "train.sink_pages=3", "train.local_pages=2"], "count towards the budget"),
    (["train.sink_pages=1"], "train.sink_pages only apply to page-sparse attention: set train.page_budget"),
    (["train.select_per_head=true", "train.select_block=64"], "train.select_block, train.select_per_head only"),
    (["train.page_budget=2.5"], "train.page_budget .* must be int or NoneType"),
    (["train.page_budget=2", "train.select_score=max"], "page score must be one of"),
    (["train.select_score=mean"], "train.select_score only apply to page-sparse attention"),
])
def test_bad_sparse_settings_stop_before_work(tmp_path, capsys, args, match):
    out = tmp_path / "out"
    assert main(["train", f"out_dir={out}", *FAST, *args]) == 2
    import re

    assert re.search(match, capsys.readouterr().out.replace("\n", "")), match
    assert not out.exists()
    with pytest.raises(ConfigError):
        page_selection(load_config(None, args)) if "2.5" not in args[0] else load_config(None, args)


@pytest.mark.parametrize("chunk_pages", ["null", "auto"])
def test_offload_run_gives_the_same_losses_and_weights(tmp_path, chunk_pages):
    """The same selection with and without offload: the same run, free blocks and the default cap."""
    on_gpu, offloaded = tmp_path / "device", tmp_path / "offload"
    sparse = [*SPARSE, f"train.chunk_pages={chunk_pages}"]
    assert main(["train", f"out_dir={on_gpu}", "train.steps=2", *FAST, *sparse]) == 0
    assert main(["train", f"out_dir={offloaded}", "train.steps=2", "train.offload=true", *FAST, *sparse]) == 0
    assert _losses(offloaded) == _losses(on_gpu)
    final = "checkpoints/step-00000002/model.safetensors"
    assert (offloaded / final).read_bytes() == (on_gpu / final).read_bytes()
