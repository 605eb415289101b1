"""Evaluation: `oomb eval` (evaluate, eval_model), the metrics, needle retrieval, the held-out loss during
training (validation) and the retrieval report at its end."""

__all__: list[str] = []
