"""What one chunk's forward needs to know, handed to every attention layer.

The engine passes a ``StepContext`` to the model as the keyword argument
``oomb_step`` (transformers forwards extra keyword arguments to every attention
call; the names ``cache`` and ``past_key_values`` belong to its own cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from oomb.cache import PagedKVStore
from oomb.kernels import AttentionBackend

STEP_KWARG = "oomb_step"

Stage = Literal["fill", "recompute"]


@dataclass
class StepContext:
    store: PagedKVStore
    backend: AttentionBackend
    stage: Stage = "fill"
    # Layer indices whose attention ran during the current chunk's forward; the engine
    # checks it against the model's layers to catch attention that bypasses oomb.
    layers_seen: set[int] = field(default_factory=set)
