"""train.memory_snapshot (oomb/train/loop/memory_record.py): the peak of a recorded allocator history and what was
alive at it, on hand-made records as torch.cuda.memory._snapshot gives them; the files and the refusals on a CPU."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from oomb.train.config.demo import settle_shape
from oomb.train.config.settings import Config, ConfigError
from oomb.train.loop import memory_record
from oomb.train.loop.distributed import DistributedContext
from oomb.train.loop.faults import RunStopped, measure_memory
from oomb.train.loop.memory_record import MemoryRecord, check_memory_snapshot, peak_allocations, site_of
from oomb.train.loop.run import Run

MIB = 2**20
OOMB = "/home/u/.venv/lib/python3.11/site-packages/oomb/engine/layer_recompute.py"
TORCH = "/home/u/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py"
LIGER = "/home/u/.venv/lib/python3.11/site-packages/liger_kernel/ops/swiglu.py"


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def alloc(addr: int, mib: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": list(frames)}


def free(addr: int, mib: int) -> dict:
    return {"action": "free_requested", "addr": addr, "size": mib * MIB, "frames": []}


def snapshot(trace: list[dict], alive_at_end_mib: list[int]) -> dict:
    blocks = [{"size": m * MIB, "requested_size": m * MIB, "state": "active_allocated"} for m in alive_at_end_mib]
    blocks.append({"size": 512 * MIB, "requested_size": 0, "state": "inactive"})  # a cached free block: not counted
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}


REBUILD = frame(OOMB, 88, "_rebuild")
SWIGLU = frame(LIGER, 40, "forward")
MODULE = frame(TORCH, 1700, "_call_impl")


def test_the_peak_is_replayed_from_allocations_and_frees_with_what_was_alive_at_it():
    trace = [
        alloc(1, 100, REBUILD),             # 100
        alloc(2, 300, SWIGLU, REBUILD),     # 400
        alloc(3, 50, MODULE, REBUILD),      # 450
        free(2, 300),                       # 150
        alloc(4, 200, SWIGLU, MODULE, REBUILD),  # 350
        alloc(5, 400, MODULE),              # 750: the peak (no oomb frame: its own site)
        free(5, 400), free(4, 200),         # 150
        {"action": "free_completed", "addr": 2, "size": 300 * MIB},  # the block back in the pool: no change
        {"action": "segment_alloc", "addr": 9, "size": 2048 * MIB},  # reserved memory: no change
        free(9, 1000),                      # a tensor made before the record began
    ]
    # At the end: 1 and 3 alive (150 MiB made in the record) and 2000 MiB made before it, 1000 of them freed since.
    summary = peak_allocations(snapshot(trace, [100, 50, 1000]), 0, {"paged store": 3 * 2**30})
    # Before the record: 1150 MiB alive at the end - (150 - 1000) replayed = 2000 MiB; the peak 2000 + 750.
    assert summary["peak_gib"] == pytest.approx(2750 / 1024, abs=1e-4)
    assert summary["peak_event"] == 5 and summary["events"] == len(trace) and summary["record_full"] is False
    sites = {(row["site"], row["via"]): row for row in summary["sites"]}
    assert sites[("oomb/engine/layer_recompute.py:88 _rebuild", "liger_kernel/ops/swiglu.py:40 forward")]["gib"] \
        == pytest.approx(200 / 1024, abs=1e-4)
    assert sites[("oomb/engine/layer_recompute.py:88 _rebuild", "")]["tensors"] == 2  # 100 and 50 (torch's frame)
    assert sites[("torch/nn/modules/module.py:1700 _call_impl", "")]["largest_mib"] == [400.0]
    assert summary["sites"][0]["site"].startswith("allocated before") is False
    before = [row for row in summary["sites"] if row["site"].startswith("allocated before")]
    assert before and before[0]["gib"] == pytest.approx(2000 / 1024, abs=1e-4)
    assert summary["plan_gpu_gib"] == {"paged store": 3.0}
    assert summary["out_of_memory_asked_gib"] is None


def test_a_record_ending_in_an_out_of_memory_error_says_what_was_asked():
    trace = [alloc(1, 100, REBUILD), {"action": "oom", "addr": 0, "size": 20 * 2**30, "frames": [REBUILD]}]
    summary = peak_allocations(snapshot(trace, [100]), 0)
    assert summary["out_of_memory_asked_gib"] == 20.0
    assert summary["peak_gib"] == pytest.approx(100 / 1024, abs=1e-4)
    assert [row["site"] for row in summary["sites"]] == ["oomb/engine/layer_recompute.py:88 _rebuild"]


def test_sites_past_the_table_are_summed_in_one_row():
    trace = [alloc(i, 1, frame(f"/x/site-packages/pkg/m{i}.py", i, "f")) for i in range(memory_record.SITES_SHOWN + 5)]
    rows = peak_allocations(snapshot(trace, [1] * len(trace)), 0)["sites"]
    assert len(rows) == memory_record.SITES_SHOWN + 1 and rows[-1]["site"] == "5 other sites"
    assert rows[-1]["tensors"] == 5


def test_the_site_is_the_innermost_oomb_frame_and_via_the_innermost_outside_torch():
    assert site_of([SWIGLU, MODULE, REBUILD]) == ("oomb/engine/layer_recompute.py:88 _rebuild",
                                                  "liger_kernel/ops/swiglu.py:40 forward")
    assert site_of([MODULE, REBUILD]) == ("oomb/engine/layer_recompute.py:88 _rebuild", "")
    assert site_of([MODULE, frame("/repo/oomb/cli.py", 3, "main")]) == ("oomb/cli.py:3 main", "")
    assert site_of([MODULE]) == ("torch/nn/modules/module.py:1700 _call_impl", "")
    assert site_of([]) == ("no stack", "")


def test_memory_snapshot_is_refused_on_a_cpu_and_for_a_bad_count():
    cfg = Config()
    check_memory_snapshot(cfg, torch.device("cpu"))  # 0: nothing recorded, nothing to refuse
    cfg.train.memory_snapshot = 2
    with pytest.raises(ConfigError, match="records the CUDA allocator, and this run is on cpu"):
        check_memory_snapshot(cfg, torch.device("cpu"))
    check_memory_snapshot(cfg, torch.device("cuda", 0))
    for bad in (-1, True, "2"):
        cfg.train.memory_snapshot = bad
        with pytest.raises(ConfigError, match="the number of steps to record"):
            check_memory_snapshot(cfg, torch.device("cuda", 0))


class FakeAllocator:
    """torch.cuda.memory's recording calls, on a machine without CUDA."""

    def __init__(self, monkeypatch, record: dict) -> None:
        self.calls: list = []
        self.record = record
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                            lambda enabled="all", **kw: self.calls.append((enabled, kw.get("max_entries"))))
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda device=None: self.record)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)


def test_the_record_is_written_after_step_n_and_ends_there(tmp_path, monkeypatch):
    record = snapshot([alloc(1, 512, REBUILD)], [512])
    fake = FakeAllocator(monkeypatch, record)
    rec = MemoryRecord(2, tmp_path, torch.device("cuda", 0), {"saved activations": 2**30})
    rec.start()
    assert fake.calls == [("all", memory_record.MAX_ENTRIES)]
    assert rec.after_step(1, last=False) is None and rec.recording
    line = rec.after_step(2, last=False)
    assert fake.calls[-1][0] is None and not rec.recording  # recording off
    assert f"{tmp_path / 'memory_snapshot.pickle'} (open it on https://pytorch.org/memory_viz)" in line
    assert "0.50 GiB allocated at its peak; largest: oomb/engine/layer_recompute.py:88 _rebuild 0.50 GiB" in line
    assert pickle.loads((tmp_path / "memory_snapshot.pickle").read_bytes()) == record
    peak = json.loads((tmp_path / "memory_peak.json").read_text())
    assert peak["recorded"] == "after step 2" and peak["max_memory_allocated_gib"] == 3.0
    assert peak["plan_gpu_gib"] == {"saved activations": 1.0}
    assert not list(tmp_path.glob("*.tmp"))
    assert rec.after_step(3, last=True) is None  # written once


def test_a_run_shorter_than_n_steps_writes_its_record_after_its_last(tmp_path, monkeypatch):
    FakeAllocator(monkeypatch, snapshot([], []))
    rec = MemoryRecord(10, tmp_path, torch.device("cuda", 0))
    rec.start()
    assert "after step 3" in rec.after_step(3, last=True)
    assert (tmp_path / "memory_peak.json").exists()


def test_a_run_that_stops_otherwise_ends_its_record_unwritten(tmp_path, monkeypatch):
    fake = FakeAllocator(monkeypatch, snapshot([], []))
    rec = MemoryRecord(10, tmp_path, torch.device("cuda", 0))
    rec.start()
    rec.discard()
    assert fake.calls[-1][0] is None and not rec.recording and not list(tmp_path.iterdir())
    rec.discard()  # once only
    assert len(fake.calls) == 2
    MemoryRecord(0, tmp_path, torch.device("cuda", 0)).start()  # 0 steps: never starts
    assert len(fake.calls) == 2


def test_an_out_of_memory_stop_writes_the_record_and_names_it(tmp_path, monkeypatch):
    FakeAllocator(monkeypatch, snapshot([alloc(1, 100, REBUILD), {"action": "oom", "size": 2**30, "addr": 0}],
                                        [100]))
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = Config()
    settle_shape(cfg)  # data.seq_len and train.batch_size as a run has them
    cfg.out_dir, cfg.train.chunk_size = str(tmp_path), 128  # as the memory plan settled it
    run = Run(cfg=cfg, out=tmp_path, model=model, optimizer=optimizer, scheduler=None, inputs=None,
              device=torch.device("cpu"), saved_step=3, ctx=DistributedContext.single(torch.device("cpu")))
    run.memory_record = MemoryRecord(5, tmp_path, torch.device("cuda", 0))
    run.memory_record.start()
    with pytest.raises(RunStopped) as stopped:
        run.stop_out_of_memory(3, "the forward/backward pass", "CUDA out of memory", measure_memory(model, optimizer))
    text = str(stopped.value)
    assert "memory record (at the out-of-memory error of step 4): " in text
    assert json.loads((tmp_path / "memory_peak.json").read_text())["out_of_memory_asked_gib"] == 1.0
    assert text.index("memory record") < text.index("The model and optimizer are as after step 3")
