"""The past pages one layer reads for a chunk, as a store receives them (made by oomb.cache.page_lists).

Each ``PastPages`` gets a serial when it is made: a store keys what its device slots hold by
it, never by the tensor's address (freed memory is reused, so a new list could alias an old
one). ``PastPages.hand_to_stream`` is how a store's copy stream receives a list made on the
compute stream.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

_SERIALS = itertools.count()


@dataclass(eq=False)
class PastPages:
    """The past pages one layer's kernels read for the newest chunk: what a store must have on the device."""

    pages: torch.Tensor  # [m] sequence page indices before the chunk, ascending, distinct, on the store's device
    serial: int = field(default_factory=lambda: next(_SERIALS), init=False)  # unique in the process
    _ordered_after: set = field(default_factory=set, init=False, repr=False)  # streams that waited for its making

    def hand_to_stream(self, stream: torch.cuda.Stream) -> None:
        """Make the list (made on the current stream) safe for the work queued next on ``stream``, which reads it.

        Order: ``stream`` otherwise waits only for what its owner orders it after, so a list made since (a
        sparse layer's selection in stage 1, a window's range) could be read before it is written, and the
        wrong pages copied (or an address outside the pools). Waiting for the current stream's current point
        is exact for a list made just now. Each list is waited for once per stream: stage 2 reuses stage 1's
        lists, which the stream is ordered after since.

        Lifetime: when the last reference goes (``PageLists.drop`` after the chunk's backward, a store's slot
        taking the next list), the list's memory must not go to new tensors of the current stream before the
        work queued on ``stream`` ran, or it would read someone else's numbers as page indices.
        """
        self.pages.record_stream(stream)
        if stream in self._ordered_after:
            return
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(self.pages.device))
        stream.wait_event(made)
        self._ordered_after.add(stream)
