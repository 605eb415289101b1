"""The attention function that joins a transformers model to the paged store."""

from oomb.attention.context import StepContext
from oomb.attention.function import PagedAttention, paged_attention
from oomb.attention.interface import (
    ATTENTION_NAME,
    check_attention_support,
    oomb_attention,
)

__all__ = [
    "ATTENTION_NAME",
    "PagedAttention",
    "StepContext",
    "check_attention_support",
    "oomb_attention",
    "paged_attention",
]
