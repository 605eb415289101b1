"""What one chunk's forward needs to know, found by every attention call.

The engine registers a ``StepContext`` for each attention module of the model for the duration of a
step (``oomb_attention``); the attention function looks it up by the module it is called for. No
keyword argument has to travel through the model's forward (some decoders do not pass extra keyword
arguments on to their attention), and the lookup works in autograd's backward threads too, where
checkpointed layers run their forward again.

Attention sites: every attention call of a chunk's forward has a layer of the store of its own. A
module that calls the attention function twice per forward (differential attention) has two sites;
the n-th call of a module's forward goes to its n-th site (``site_of``).
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

Stage = Literal["fill", "recompute"]


@dataclass
class StepContext:
    store: KVStore
    backend: AttentionBackend
    stage: Stage = "fill"
    # recompute="layer"/"layer-host": stage 2 rebuilds one decoder layer at a time, so each layer's forward is
    # followed at once by its backward (oomb.engine.layer_recompute).
    by_layer: bool = False
    # Attention module -> its sites (store layers), in the order of its calls within one forward.
    sites: dict[torch.nn.Module, tuple[int, ...]] = field(default_factory=dict)
    # Site -> the decoder layer it belongs to.
    site_layers: tuple[int, ...] = ()
    # Decoder layers whose attention ran during the current chunk's forward; the engine checks it against
    # the model's attention layers to catch attention that bypasses oomb.
    layers_seen: set[int] = field(default_factory=set)
    # Packed documents: [B, N] int32 position of the first token of each token's document
    # (tokens of different documents never attend to each other); None = one document per row.
    doc_start: torch.Tensor | None = None
    # [B, N] bool: False on padding, whose queries attend nothing (their attention output is zero); None = no padding.
    attended: torch.Tensor | None = None
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
        self._calls: dict[torch.nn.Module, int] = {}

    def site_of(self, module: torch.nn.Module) -> int:
        """The store layer of this call of ``module``: its sites in turn (a module's forward makes its calls in
        one order, whether it runs in stage 1, stage 2 or again inside a checkpointed backward)."""
        sites = self.sites.get(module)
        if sites is None:
            raise RuntimeError(
                f"an attention call of {type(module).__name__} that oomb's check of the model did not see: this "
                "model calls attention in a way that depends on its input, which oomb cannot train")
        n = self._calls.get(module, 0)
        self._calls[module] = n + 1
        site = sites[n % len(sites)]
        self.layers_seen.add(self.site_layers[site])
        return site

    def drop_page_lists(self, chunk_start: int) -> None:
        """Forget what was kept for the chunk that starts at ``chunk_start`` (after its backward): its page
        lists and any attention outputs cached for it."""
        self.page_lists.drop(chunk_start)
        for key in [key for key in self.attention_outputs if key[1] == chunk_start]:
            del self.attention_outputs[key]
