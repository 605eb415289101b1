"""The fault-injection suite's reference: one uninterrupted run, built once per session."""

import subprocess
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


@pytest.fixture
def disk(tmp_path) -> Path:
    """A 64 MiB tmpfs of its own (a run of the tiny preset writes about 15 MiB)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)
