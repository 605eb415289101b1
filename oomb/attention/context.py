"""What one chunk's forward needs to know, handed to every attention layer.

The engine passes a ``StepContext`` to the model as the keyword argument
``oomb_step`` (transformers forwards extra keyword arguments to every attention
call; the names ``cache`` and ``past_key_values`` belong to its own cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed

from oomb.cache import PagedKVStore
from oomb.kernels import AttentionBackend
from oomb.offload import OffloadedKVStore
from oomb.sparse import PageSelection

STEP_KWARG = "oomb_step"

Stage = Literal["fill", "recompute"]


@dataclass
class StepContext:
    store: PagedKVStore | OffloadedKVStore
    backend: AttentionBackend
    stage: Stage = "fill"
    # Layer indices whose attention ran during the current chunk's forward; the engine
    # checks it against the model's layers to catch attention that bypasses oomb.
    layers_seen: set[int] = field(default_factory=set)
    # Packed documents: [B, N] int32 position of the first token of each token's document
    # (tokens of different documents never attend to each other); None = one document per row.
    doc_start: torch.Tensor | None = None
    # Page-sparse attention policy (None = dense), and the page lists chosen so far, keyed by
    # (layer index, first token of the chunk): chosen in stage 1, reused in stage 2.
    selection: PageSelection | None = None
    page_lists: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    # The past pages a layer's kernels read for a chunk (same keys; None = all of them): what an
    # offloaded store must bring to the device. Known once the layer ran on the chunk.
    past_pages: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    # Each layer's sliding window (None = full attention), learned as the layers run.
    layer_windows: dict[int, int | None] = field(default_factory=dict)
    # Attention outputs kept from stage 1 for stage 2 (same keys -> (out, lse)), when on: stage 2's
    # forward then reuses them instead of attending again (the pages and queries are the same).
    cache_attention: bool = False
    attention_outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Tensor parallel: the process group the heads are split over (None = one process). Page
    # selection combines the scores of every rank's heads so all ranks attend the same pages.
    tp_group: torch.distributed.ProcessGroup | None = None

    def drop_page_lists(self, chunk_start: int) -> None:
        """Forget the page lists of the chunk that starts at ``chunk_start`` (after its backward)."""
        for table in (self.page_lists, self.past_pages, self.attention_outputs):
            for key in [key for key in table if key[1] == chunk_start]:
                del table[key]
