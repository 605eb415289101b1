"""torch.distributed.checkpoint folders load through allowlists: DCP's own metadata and plain data pass,
pickled code in the metadata or in a bytes value is refused and never runs (one gloo rank, in a subprocess)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import os, pickle, sys, torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from oomb.train.runfolder.checkpoint import CheckpointError
    from oomb.train.runfolder.safe_dcp import load_dcp

    root, marker = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
    dist.init_process_group("gloo", rank=0, world_size=1)

    class MakesAFolder:
        def __reduce__(self):
            return (os.mkdir, (marker,))

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    dcp.save(state, checkpoint_id=f"{root}/good")
    other = torch.nn.Linear(4, 4)
    fresh = {"model": other.state_dict(), "optimizer": torch.optim.AdamW(other.parameters()).state_dict()}
    load_dcp(fresh, f"{root}/good")
    assert torch.equal(fresh["model"]["weight"], model.weight.detach()), "the good checkpoint did not load"
    print("good: loaded")

    dcp.save({"plain": MakesAFolder(), "t": torch.ones(2)}, checkpoint_id=f"{root}/bytes")
    try:
        load_dcp({"plain": None, "t": torch.zeros(2)}, f"{root}/bytes")
    except CheckpointError as e:
        print("bytes:", e)

    import shutil
    shutil.copytree(f"{root}/good", f"{root}/meta")
    with open(f"{root}/meta/.metadata", "wb") as f:
        pickle.dump(MakesAFolder(), f)
    try:
        load_dcp(fresh, f"{root}/meta")
    except CheckpointError as e:
        print("metadata:", e)
    dist.destroy_process_group()
''')


def test_dcp_loads_plain_checkpoints_and_refuses_pickled_code(tmp_path):
    marker = tmp_path / "pwned"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(marker), "29631"], capture_output=True,
                          text=True, timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "good: loaded" in out
    assert "bytes: checkpoint value 'plain' holds objects other than tensors and plain data (refused, nothing from " \
           "it was run)" in out, out
    assert "metadata: " in out and "is not plain checkpoint metadata (refused, nothing from it was run): " \
           "posix.mkdir is not part of a checkpoint's metadata" in out, out
    assert not marker.exists()
