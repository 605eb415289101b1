"""What a model's forward does around attention, seen by running it once under a recording implementation.

oomb trains a transformers decoder exactly only if every attention call is one it can reproduce over
its pages: causal (or causal within a sliding window that the call names), over the keys of the same
tokens as the queries, and deterministic between stage 1 and stage 2; and only if the loss can be
computed from the decoder's last hidden state by the LM head with a transform the fused loss applies.
Rather than trusting the config, ``probe_model`` runs the model's own forward once (the model's
family's eager attention does the arithmetic, so the forward is the model's) and records:

    every attention call     the module, its layer, the sizes of q / k / v (heads, key and value head
                             sizes), the window and sinks it passes, soft-capping, dropout;
    every attention mask     whether the mask the model built for the call is the causal mask cut by
                             the window the call names (nothing else: no window only in the mask, no
                             chunked or bidirectional attention, no mask that ignores the window);
    the way to the loss      the decoder's last hidden state, what enters the LM head and what leaves
                             it, and the logits the model returns;
    randomness               whether two forwards of the same tokens give the same logits.

``oomb.engine.support`` turns the report into a verdict. The probe name is registered with both
``AttentionInterface`` and ``AttentionMaskInterface`` (the latter with transformers' eager mask), so
models build the same masks for it as for ``attn_implementation="eager"``. The recorded calls attend
with plain softmax attention under the model's mask (with its sinks): none of the checks depends on the
attention's values, only on what the model does around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

PROBE_NAME = "oomb_probe"


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of a forward, as the model made it."""

    module: str  # qualified name of the module that made the call
    layer_idx: int | None  # the module's layer_idx, if it has one
    heads: int
    kv_heads: int
    key_dim: int  # head size of queries and keys
    value_dim: int  # head size of values (and of the output)
    query_len: int
    key_len: int
    sliding_window: int | None
    sinks: bool  # per-head sink logits passed (s_aux)
    softcap: float | None
    dropout: float
    scaling: float | None
    mask: str  # "causal" (matches causal + the named window), or what differs, in words


@dataclass
class ProbeReport:
    """What one probe forward saw (see the module docstring)."""

    calls: list[AttentionCall] = field(default_factory=list)
    random: bool = False  # two forwards of the same tokens differed
    # The way from the decoder to the loss (detached; None where the module did not run): the decoder's last
    # hidden state, the LM head's input and output, and the logits the model returned.
    decoder_output: torch.Tensor | None = None
    head_input: torch.Tensor | None = None
    head_output: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def calls_by_module(self) -> dict[str, list[AttentionCall]]:
        """The calls of each attention module, modules in the order of their first call."""
        grouped: dict[str, list[AttentionCall]] = {}
        for call in self.calls:
            grouped.setdefault(call.module, []).append(call)
        return grouped


# The report being filled while a probe forward runs (probes do not nest or run concurrently).
_RECORDING: tuple[ProbeReport, dict[torch.nn.Module, str]] | None = None


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor parallel rank's part of a DTensor (the heads of this rank), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _attend(query, key, value, attention_mask, scaling: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention [B, C, H, D_v] (transformers' layout) under an additive or boolean mask, with sinks."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scaling
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return (weights.nan_to_num() @ value.float()).to(value.dtype).transpose(1, 2).contiguous()


def _describe_mask(attention_mask, q_len: int, k_len: int, window: int | None, device) -> str:
    """'causal' where the model's mask [B, 1|H, Q, K] equals causal + window (the probe has no padding), else
    what differs."""
    if k_len != q_len:
        return f"attends over {k_len} keys for {q_len} queries (keys that are not the layer's own tokens)"
    if attention_mask is None:
        return "no mask: every query sees every key (not causal)" if q_len > 1 else "causal"
    q = torch.arange(q_len, device=device)[:, None]
    k = torch.arange(k_len, device=device)[None, :]
    expected = k <= q
    if window is not None:
        expected &= (q - k) < window
    mask = attention_mask
    visible = mask if mask.dtype == torch.bool else mask == 0
    visible = visible.expand(visible.shape[0], visible.shape[1], q_len, k_len)
    if bool((visible == expected).all()):
        return "causal"
    hidden_more = bool((expected & ~visible).any())  # keys the window/causality allows but the mask hides
    shown_more = bool((visible & ~expected).any())
    if hidden_more and window is None:
        return "masks keys a causal mask shows (a window or chunks applied only through the attention mask)"
    if hidden_more:
        return f"masks keys a causal mask with a window of {window} shows (a mask narrower than the window)"
    if shown_more and window is not None:
        return f"shows keys outside the window of {window} the call names (the mask ignores the window)"
    return "shows keys a causal mask hides (bidirectional or prefix attention)"


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    report, names = _RECORDING
    window = kwargs.get("sliding_window")
    report.calls.append(AttentionCall(
        module=names.get(module, type(module).__name__),
        layer_idx=getattr(module, "layer_idx", None),
        heads=query.shape[1], kv_heads=key.shape[1], key_dim=key.shape[-1], value_dim=value.shape[-1],
        query_len=query.shape[2], key_len=key.shape[2], sliding_window=window,
        sinks=kwargs.get("s_aux") is not None, softcap=kwargs.get("softcap"),
        dropout=float(kwargs.get("dropout", 0.0) or 0.0), scaling=kwargs.get("scaling"),
        mask=_describe_mask(attention_mask, query.shape[2], key.shape[2], window, query.device),
    ))
    scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    return _attend(query, key, value, attention_mask, scaling, _local(kwargs.get("s_aux"))), None


AttentionInterface.register(PROBE_NAME, _probe_attention)
AttentionMaskInterface.register(PROBE_NAME, eager_mask)


def close(x: torch.Tensor | None, ref: torch.Tensor | None, tol: float) -> bool:
    """``x`` equals ``ref`` within relative L2 error ``tol`` (False where either is missing or shapes differ)."""
    if x is None or ref is None or x.shape != ref.shape:
        return False
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm()) <= tol * float(ref.norm())


def probe_model(model: PreTrainedModel, input_ids: torch.Tensor, *, tol: float = 1e-4) -> ProbeReport:
    """Run ``model``'s forward on ``input_ids`` [B, N] twice under the recording attention; the report.

    The model's attention implementation, training mode and gradients are as before afterwards.
    ``tol``: relative tolerance of the randomness check (the forward is compared with itself: exact, up to
    kernels that add in a varying order; dropout differs by far more).
    """
    global _RECORDING
    if _RECORDING is not None:
        raise RuntimeError("probe_model does not nest")
    report = ProbeReport()
    names = {module: name for name, module in model.named_modules()}
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    seen: dict[str, torch.Tensor] = {}

    def keep_decoder(_module, _args, output):
        hidden = getattr(output, "last_hidden_state", None)
        seen.setdefault("decoder", hidden if hidden is not None else output[0])

    def keep_head(_module, args, output):
        seen.setdefault("head_in", args[0] if args else None)
        seen.setdefault("head_out", output)

    previous = model.config._attn_implementation
    hooks = [decoder.register_forward_hook(keep_decoder)]
    if head is not None:
        hooks.append(head.register_forward_hook(keep_head))
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
    _RECORDING = (report, names)
    try:
        model.set_attn_implementation(PROBE_NAME)
        with torch.no_grad():
            logits = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
            calls = len(report.calls)
            again = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
        del report.calls[calls:]  # the second forward's calls repeat the first's
    finally:
        _RECORDING = None
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
    report.random = not close(again, logits, tol)
    report.logits = logits
    report.decoder_output = seen.get("decoder")
    head_in = seen.get("head_in")
    report.head_input = head_in if isinstance(head_in, torch.Tensor) else None
    report.head_output = seen.get("head_out")
    return report
