"""A transformers collator's batch as ``chunked_backward`` takes it: ids, unshifted labels, document ids.

    collator batch                              oomb
    input_ids [B, N]                        ->  input_ids
    labels [B, N] (or shift_labels [B, N])  ->  labels (shift_labels moved right by one)
    position_ids [B, N] (packed, padding-free)  -> doc_ids [B, N]: a new document wherever the positions
                                                   do not count on by one
    attention_mask [B, N] (padding)             -> attention_mask (padding: its own document, attending nothing)

Packed rows (TRL's ``padding_free``/``packing``, transformers' ``DataCollatorWithFlattening``) restart
``position_ids`` at 0 for every sample: each restart starts a document, and attention never crosses it.
oomb keeps the positions of the packed row; RoPE depends only on the distance between two tokens, and
no token attends across a document start, so each sample is trained as it would be alone.

Padding (``attention_mask`` 0) is a document of its own that attends nothing: left padding is then never
attended by the tokens after it, and a padding position's attention output is zero, as transformers' SDPA
attention gives a query whose every key is masked (so a target on the last left pad, the first token after
it, is predicted from the same hidden state). The mask's ones must be one run per row, as left or right
padding makes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from oomb.engine.loss import IGNORE_INDEX

# Keys a collator may add that say again what position_ids say (flash-attention's varlen arguments, TRL's
# sequence index), or that steer transformers' own forward only: read past.
_REDUNDANT_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
                             "use_cache", "logits_to_keep", "return_dict"})
_USED_KEYS = frozenset({"input_ids", "labels", "shift_labels", "attention_mask", "position_ids"})


@dataclass
class OombBatch:
    """One collator batch as ``chunked_backward`` and ``chunked_eval`` take it."""

    input_ids: torch.Tensor  # [B, N] int64
    labels: torch.Tensor  # [B, N] unshifted, as transformers' labels: position t predicts labels[t + 1]; -100 = none
    doc_ids: torch.Tensor | None  # [B, N] int64, non-decreasing along N; None = one document per row
    attention_mask: torch.Tensor | None = None  # [B, N] 1 = token, 0 = padding; None = no padding

    @property
    def target_count(self) -> int:
        """Positions that predict a token (host sync)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def oomb_batch(inputs: Mapping) -> OombBatch:
    """The batch ``inputs`` (a collator's dict of tensors) as oomb runs it; raises ValueError for what it cannot."""
    unknown = sorted(set(inputs) - _USED_KEYS - _REDUNDANT_KEYS)
    if unknown:
        raise ValueError(
            f"the batch holds {unknown}, which oomb's step does not pass to the model: it trains causal language "
            "models on input_ids, labels, position_ids and attention_mask only. Use a collator that gives those "
            "(DataCollatorForLanguageModeling(tokenizer, mlm=False), DataCollatorWithFlattening, TRL's), or "
            "remove the columns (TrainingArguments(remove_unused_columns=True))")
    input_ids = inputs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"the batch needs input_ids as a [batch, seq_len] tensor (inputs_embeds is not supported), "
                         f"got {_describe(input_ids)}")
    labels = unshifted_labels(inputs, input_ids)
    mask = inputs.get("attention_mask")
    return OombBatch(input_ids=input_ids, labels=labels, doc_ids=document_ids(inputs, input_ids),
                     attention_mask=None if mask is None or bool(mask.all()) else mask)


def unshifted_labels(inputs: Mapping, input_ids: torch.Tensor) -> torch.Tensor:
    """``labels``, or ``shift_labels`` (position t's own target) moved right by one to transformers' alignment."""
    shifted = inputs.get("shift_labels")
    if shifted is None:
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError("the batch has no labels: oomb computes the loss from them. Use a collator that sets "
                             "them, e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False) (labels = input_ids, "
                             "-100 on padding)")
        return labels
    _check_shape("shift_labels", shifted, input_ids)
    if bool((shifted[:, -1] != IGNORE_INDEX).any()):
        raise ValueError("shift_labels gives the last position of a row a target, a token after the row: it must "
                         "be -100 there (shift_labels[t] = labels[t + 1])")
    pad = torch.full_like(shifted[:, :1], IGNORE_INDEX)
    return torch.cat([pad, shifted[:, :-1]], dim=1)


def document_ids(inputs: Mapping, input_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, N] document of each token from ``position_ids`` and ``attention_mask`` (a run of padding is one); None
    where every row is one."""
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    positions = inputs.get("position_ids")
    if positions is not None:
        if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == 1:
            positions = positions.expand(input_ids.shape[0], -1)  # one row of positions for every row
        _check_shape("position_ids", positions, input_ids)
        starts[:, 1:] |= positions[:, 1:] != positions[:, :-1] + 1
    mask = inputs.get("attention_mask")
    if mask is not None:
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            raise ValueError("the batch has a 4-D attention_mask: oomb masks attention itself and takes documents "
                             "from position_ids (restarting at 0 for each packed sample); give those instead")
        _check_shape("attention_mask", mask, input_ids)
        mask = mask.bool()
        switches = mask[:, 1:] != mask[:, :-1]
        runs_of_ones = (switches & mask[:, 1:]).sum(dim=1) + mask[:, 0].long()  # 0 -> 1 switches, and a first 1
        if bool((runs_of_ones > 1).any()):
            raise ValueError("attention_mask has a row whose ones are not one run (a gap of padding inside the "
                             "sequence): oomb takes left or right padding only. Pack samples with position_ids "
                             "restarting at 0 instead (TRL's padding_free=True, DataCollatorWithFlattening)")
        starts[:, 1:] |= switches
    if not bool(starts.any()):  # host sync, once per batch
        return None
    return starts.long().cumsum(dim=1)


def _check_shape(name: str, value, input_ids: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(input_ids.shape):
        raise ValueError(f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {_describe(value)}")


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
