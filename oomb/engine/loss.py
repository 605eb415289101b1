"""Summed cross-entropy of a linear head, without the [tokens, vocab] logits.

On CUDA this is liger-kernel's fused linear cross-entropy. Elsewhere (CPU, or CUDA
without liger) it is ``ChunkedLinearCrossEntropy``: the same idea in PyTorch. The
forward walks the rows in blocks, computes each block's fp32 logits, its loss and
its gradients at once, and keeps only the gradients ([tokens, hidden] and
[vocab, hidden]); backward scales them. Largest temporary: one block of logits,
``_LOGITS_BLOCK_BYTES`` (rows = that / (4 * vocab)).

Models that do more than ``hidden @ W.T + b`` on the way to their logits say so with a
``LogitTransform`` (found by ``oomb.engine.support``): a factor on the head's input, a factor
on its output (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) and a final
soft-cap (Gemma 2's ``final_logit_softcapping``), applied here exactly as the model does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
LOSS_IMPLS = ("auto", "liger", "torch")  # linear_cross_entropy_sum(impl=...)
_LOGITS_BLOCK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class LogitTransform:
    """What a model does around its LM head (a Linear ``W``, ``b``)::

        logits = softcap * tanh(z / softcap)   (without soft-capping: logits = z)
        z      = logit_scale * ((hidden_scale * hidden) @ W.T + b)
    """

    hidden_scale: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    @property
    def is_identity(self) -> bool:
        return self.hidden_scale == 1.0 and self.logit_scale == 1.0 and self.softcap is None

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The model's logits of ``hidden`` [T, Dm] in fp32 (evaluation; training uses the fused loss)."""
        z = (hidden.float() * self.hidden_scale) @ weight.float().T
        if bias is not None:
            z = z + bias.float()
        z = z * self.logit_scale
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)


IDENTITY = LogitTransform()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, logit_scale=1.0, softcap=None):
        # hidden [T, Dm], weight [V, Dm], bias [V] or None, targets [T] int64 (-100 ignored);
        # logits = softcap * tanh(logit_scale * (hidden @ W.T + b) / softcap) (LogitTransform; the hidden scale
        # is applied by the caller)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        rows = max(1, _LOGITS_BLOCK_BYTES // (4 * weight.shape[0]))
        acc = torch.promote_types(weight.dtype, torch.float32)  # fp32 math (fp64 for fp64 tests)
        w32 = weight.to(acc)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(w32) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for r0 in range(0, hidden.shape[0], rows):
            h = hidden[r0 : r0 + rows].to(acc)
            t = targets[r0 : r0 + rows]
            logits = h @ w32.T
            if bias is not None:
                logits += bias.to(acc)
            if logit_scale != 1.0:
                logits *= logit_scale
            capped = None
            if softcap is not None:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            valid = t != IGNORE_INDEX
            safe_t = torch.where(valid, t, torch.zeros_like(t))
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe_t[:, None]).squeeze(1)
            total += ((lse - picked) * valid).sum()
            if need_h or need_w or need_b:
                # d(sum loss)/d logits = softmax - onehot on valid rows, 0 elsewhere (in place on logits).
                g = logits.sub_(lse[:, None]).exp_()
                g[torch.arange(g.shape[0], device=g.device), safe_t] -= 1.0
                g *= valid[:, None]
                if capped is not None:  # d(c tanh(z / c)) / dz = 1 - tanh^2
                    g *= 1.0 - capped * capped
                if logit_scale != 1.0:
                    g *= logit_scale
                if need_h:
                    grad_h[r0 : r0 + rows] = (g @ w32).to(hidden.dtype)
                if need_w:
                    grad_w += g.T @ h
                if need_b:
                    grad_b += g.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = grad_out.to(grad_w.dtype if grad_w is not None else torch.float32)
        dh = grad_h * scale.to(grad_h.dtype) if grad_h is not None else None
        dw = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        db = (grad_b * scale).to(ctx.weight_dtype) if grad_b is not None else None
        return dh, dw, db, None, None, None


def _liger_available() -> bool:
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError:
        return False
    return True


def linear_cross_entropy_sum(
    hidden: torch.Tensor,  # [T, Dm]
    weight: torch.Tensor,  # [V, Dm]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [T] int64, -100 = no target
    *,
    impl: str = "auto",
    transform: LogitTransform = IDENTITY,
) -> torch.Tensor:
    """Sum over valid targets of -log softmax(logits)[target], logits = ``transform`` of hidden @ weight.T + bias.

    ``impl``: "auto" (liger on CUDA when installed, else torch), "liger" or "torch".
    """
    if impl == "auto":
        impl = "liger" if hidden.is_cuda and _liger_available() else "torch"
    if impl not in ("liger", "torch"):
        raise ValueError(f"unknown cross-entropy implementation {impl!r}: use 'auto', 'liger' or 'torch'")
    if transform.hidden_scale != 1.0:
        hidden = hidden * transform.hidden_scale
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        # Liger soft-caps but does not scale: s * (h W^T + b) = (s h) W^T + s b.
        s = transform.logit_scale
        if s != 1.0:
            hidden, bias = hidden * s, None if bias is None else bias * s
        return liger_fused_linear_cross_entropy(
            hidden, weight, targets, bias, ignore_index=IGNORE_INDEX, reduction="sum", softcap=transform.softcap,
        ).float()
    return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, transform.logit_scale, transform.softcap)
