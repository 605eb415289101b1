"""The two-stage chunked step, its fused loss, and forward-only chunked evaluation."""

from oomb.engine.evaluate import EvalResult, chunked_eval
from oomb.engine.loss import linear_cross_entropy_sum
from oomb.engine.step import chunked_backward, release_memory, store_for_model

__all__ = [
    "EvalResult",
    "chunked_backward",
    "chunked_eval",
    "linear_cross_entropy_sum",
    "release_memory",
    "store_for_model",
]
