"""The training loop behind `oomb train`: the run's build order and its steps (trainer, run), the model as
trained (model, quantize), the optimizer and its schedule, the memory check, several GPUs (distributed),
what stops a run (faults), and what it reports (monitor, reporting)."""

__all__: list[str] = []
