"""The attention function that joins a transformers model to the paged store."""

from oomb.attention.context import STEP_KWARG, StepContext
from oomb.attention.function import PagedAttention, paged_attention
from oomb.attention.interface import (
    ATTENTION_NAME,
    MODEL_SIZE_FIELDS,
    check_attention_support,
    check_model_config,
    oomb_attention,
)

__all__ = [
    "ATTENTION_NAME",
    "MODEL_SIZE_FIELDS",
    "STEP_KWARG",
    "PagedAttention",
    "StepContext",
    "check_attention_support",
    "check_model_config",
    "oomb_attention",
    "paged_attention",
]
