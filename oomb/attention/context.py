"""What one chunk's forward needs to know, handed to every attention layer.

The engine passes a ``StepContext`` to the model as the keyword argument
``oomb_step`` (transformers forwards extra keyword arguments to every attention
call; the names ``cache`` and ``past_key_values`` belong to its own cache).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed

from oomb.cache import KVStore, PageLists
from oomb.kernels import AttentionBackend
from oomb.sparse import PageSelection

STEP_KWARG = "oomb_step"

Stage = Literal["fill", "recompute"]


@dataclass
class StepContext:
    store: KVStore
    backend: AttentionBackend
    stage: Stage = "fill"
    # Layer indices whose attention ran during the current chunk's forward; the engine
    # checks it against the model's layers to catch attention that bypasses oomb.
    layers_seen: set[int] = field(default_factory=set)
    # Packed documents: [B, N] int32 position of the first token of each token's document
    # (tokens of different documents never attend to each other); None = one document per row.
    doc_start: torch.Tensor | None = None
    # Page-sparse attention policy (None = dense).
    selection: PageSelection | None = None
    # The step's page lists per (layer, chunk start): chosen in stage 1, reused in stage 2, the past
    # pages each layer reads (what an offloaded store brings to the device), dropped after the chunk.
    page_lists: PageLists = field(init=False)
    # Attention outputs kept from stage 1 for stage 2 (same keys -> (out, lse)), when on: stage 2's
    # forward then reuses them instead of attending again (the pages and queries are the same). A dict on
    # the device, or the engine's mapping over host memory (item assignment, pop, iteration, deletion).
    cache_attention: bool = False
    attention_outputs: MutableMapping[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Tensor parallel: the process group the heads are split over (None = one process). Page
    # selection combines the scores of every rank's heads so all ranks attend the same pages.
    tp_group: torch.distributed.ProcessGroup | None = None

    def __post_init__(self) -> None:
        listed = None
        if (policy := self.selection) is not None:
            lists = self.store.spec.num_kv_heads if policy.per_head else 1

            def listed(queries: int) -> int:
                return policy.pages_per_list(queries) * lists

        self.page_lists = PageLists(sparse=self.selection is not None, listed=listed)

    def drop_page_lists(self, chunk_start: int) -> None:
        """Forget what was kept for the chunk that starts at ``chunk_start`` (after its backward): its page
        lists and any attention outputs cached for it."""
        self.page_lists.drop(chunk_start)
        for key in [key for key in self.attention_outputs if key[1] == chunk_start]:
            del self.attention_outputs[key]
