"""The two-stage chunked step, its options and setup, its fused loss, forward-only chunked evaluation,
the memory planner, and tensor parallelism over heads."""

from oomb.engine.evaluate import EvalResult, chunked_eval
from oomb.engine.loss import linear_cross_entropy_sum
from oomb.engine.options import MemoryLimits, RunShape, StepOptions
from oomb.engine.plan import MemoryPlan, largest_context, plan_first_fitting, plan_memory
from oomb.engine.prepare import release_memory, store_for_model
from oomb.engine.step import chunked_backward
from oomb.engine.tensor_parallel import TensorParallelError, apply_tensor_parallel

__all__ = [
    "EvalResult",
    "MemoryLimits",
    "MemoryPlan",
    "RunShape",
    "StepOptions",
    "TensorParallelError",
    "chunked_backward",
    "chunked_eval",
    "largest_context",
    "linear_cross_entropy_sum",
    "plan_first_fitting",
    "plan_memory",
    "release_memory",
    "store_for_model",
    "apply_tensor_parallel",
]
