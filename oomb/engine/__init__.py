"""The two-stage chunked step, its options and setup, its fused loss, and forward-only chunked evaluation
(the memory planner is oomb.planning; changes made to the model before it trains, oomb.surgery)."""

from oomb.engine.evaluate import EvalResult, chunked_eval
from oomb.engine.loss import linear_cross_entropy_sum
from oomb.engine.options import MemoryLimits, RunShape, StepOptions
from oomb.engine.prepare import release_memory, store_for_model
from oomb.engine.step import chunked_backward
from oomb.surgery.tensor_parallel import TensorParallelError, apply_tensor_parallel

__all__ = [
    "EvalResult",
    "MemoryLimits",
    "RunShape",
    "StepOptions",
    "TensorParallelError",
    "chunked_backward",
    "chunked_eval",
    "linear_cross_entropy_sum",
    "release_memory",
    "store_for_model",
    "apply_tensor_parallel",
]
