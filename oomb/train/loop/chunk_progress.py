"""A step's progress chunk by chunk, for steps of minutes (a million tokens: several minutes a step).

The progress line shows where the step is (``fill 3/8``: stage 1 has started its third chunk of eight;
``backward 2/8``: stage 2 its second, newest first), from ``chunked_backward``'s on_chunk. With
``train.log_chunks`` every chunk's start is also a line of <out_dir>/chunks.jsonl::

    {"step": 3, "batch": 1, "stage": "backward", "chunk": 2, "of": 8, "seconds": 41.2, "peak_gpu_gib": 61.9}

``seconds`` since the step's forward/backward began and the process's GPU memory peak so far, both read after
the GPU has finished everything queued before the chunk (a sync per chunk: a pause of the host's run-ahead, one
launch latency a chunk). The differences of ``seconds`` are the chunks' times; a step stopped before its end
(killed, out of time) shows how far it got and the memory it had held by then: how a step too long to wait for
is shown to fit, its time predicted from its measured chunks (benchmarks/train_steps.py). Lines are appended
(a resumed run adds its own, with their step numbers).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from oomb.train.loop.monitor import GIB
from oomb.train.runfolder.rundir import CHUNKS, MetricsLog


class ChunkProgress:
    """``start(step, batches)`` before a step's forward/backward, then call it as ``on_chunk(batch, stage, i, n)``.

    ``show(text)`` puts the step's place on the progress line (set it once the line exists); ``path``: chunks.jsonl
    (None: no log)."""

    def __init__(self, path: Path | None, device: torch.device) -> None:
        self.show: Callable[[str], None] = lambda text: None
        self._device = device
        self._log = MetricsLog(path) if path is not None else None
        self._step, self._batches, self._t0 = 0, 1, 0.0
        self.failed: str | None = None  # why the log stopped, once a write failed

    def start(self, step: int, batches: int) -> None:
        self._step, self._batches = step, batches
        if self._log is not None:
            self._sync()
        self._t0 = time.perf_counter()

    def __call__(self, batch: int, stage: str, i: int, n: int) -> None:
        self.show(f"{stage} {i}/{n}" + (f" of batch {batch + 1}/{self._batches}" if self._batches > 1 else ""))
        if self._log is None:
            return
        self._sync()
        line = {"step": self._step, "batch": batch + 1, "stage": stage, "chunk": i, "of": n,
                "seconds": round(time.perf_counter() - self._t0, 4)}
        if self._device.type == "cuda":
            line["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(self._device) / GIB, 4)
        try:
            self._log.append_line(json.dumps(line))
        except OSError as e:  # a full disk: the log stops (the trainer warns), the step goes on
            self._log.close()
            self._log, self.failed = None, f"{CHUNKS}: {e}"

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
