"""The memory readings every step's record gets (oomb.train.loop.monitor.memory_fields)."""

import torch

from oomb.train.loop.monitor import GIB, memory_fields


def test_cpu_runs_read_the_host_only_and_pinned_bytes_are_reported():
    fields = memory_fields(torch.device("cpu"), pinned_bytes=3 * GIB)
    assert set(fields) == {"host_rss_gib", "pinned_host_gib"}
    assert fields["pinned_host_gib"] == 3.0 and fields["host_rss_gib"] > 0


def test_cuda_runs_read_the_allocated_and_reserved_peaks_and_what_lies_outside_the_allocator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 40 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 44 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 42 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (36 * GIB, 80 * GIB))  # 44 GiB in use
    fields = memory_fields(torch.device("cuda", 0))
    assert fields["peak_gpu_gib"] == 40 and fields["peak_gpu_reserved_gib"] == 44
    assert fields["gpu_outside_allocator_gib"] == 2  # 44 in use on the card, 42 of it the allocator's
