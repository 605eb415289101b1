"""The fault-injection suite's reference: one uninterrupted run, built once per session."""

from pathlib import Path

import pytest
from faultrun import RUN

from oomb.cli import main


@pytest.fixture(scope="session")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run: checkpoints after steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert main(["train", f"out_dir={run}", "train.save_every=2", *RUN]) == 0
    return run
