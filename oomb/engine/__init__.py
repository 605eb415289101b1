"""The two-stage chunked step and its fused loss."""

from oomb.engine.loss import linear_cross_entropy_sum
from oomb.engine.step import chunked_backward, release_memory, store_for_model

__all__ = ["chunked_backward", "linear_cross_entropy_sum", "release_memory", "store_for_model"]
