"""The memory planner and the step-time model: what a step of a given model, length and StepOptions
holds on the GPU and in host memory (plan: the items each allocating component reports, activations:
the bytes a layer saves per token), the longest context that fits, and a step's time from measured
rates (timing). Above the engine: it asks the engine's components for their sizes."""

from oomb.planning.plan import MemoryPlan, largest_context, plan_first_fitting, plan_memory

__all__ = ["MemoryPlan", "largest_context", "plan_first_fitting", "plan_memory"]
