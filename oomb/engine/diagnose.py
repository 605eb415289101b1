"""Where did a NaN or inf first appear? A diagnostic forward over the chunks, in order.

After a step produced a non-finite loss or gradient, the trainer calls
``locate_nonfinite`` with the same sequence and the step's own StepOptions: its chunks,
its store (offloaded or not, the same spec: the diagnosis allocates nothing the step did
not) and its page selection. It runs stage 1 of the step (fill the paged store, no
autograd) over EVERY chunk, c_0 -> c_{m-1}, with forward hooks on the token embedding,
each decoder layer and the final norm, then each chunk's loss. The first module whose
output is not finite, in chunk order and then layer order, is where the value first
appeared: it is what the recompute of stage 2 computed too (the same forward on the same
store, attending the same pages). If the whole forward is finite, the NaN arose in the
backward pass; the caller names the first parameter whose gradient is non-finite.

Cost: one forward over the sequence without autograd, only on the failure path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oomb.engine.loss import linear_cross_entropy_sum
from oomb.engine.options import StepOptions
from oomb.engine.prepare import prepare_step
from oomb.engine.step import check_model_architecture, run_chunk


@dataclass(frozen=True)
class NonFiniteSite:
    chunk: int  # index of the chunk, 0-based
    num_chunks: int
    start: int  # its first token position
    end: int  # one past its last
    module: str  # qualified module name, e.g. "model.layers.1", or "loss"
    layer: int | None  # decoder layer index, when the module is a decoder layer

    def __str__(self) -> str:
        where = f"decoder layer {self.layer} ({self.module})" if self.layer is not None else self.module
        return (f"the output of {where} in chunk {self.chunk} of {self.num_chunks} "
                f"(tokens {self.start}..{self.end - 1})")


def _first_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "last_hidden_state", None)


@torch.no_grad()
def locate_nonfinite(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    options: StepOptions,
    doc_ids: torch.Tensor | None = None,
) -> NonFiniteSite | None:
    """The first module output (chunk by chunk, layer by layer) or chunk loss that is not finite.

    ``options``: the failing step's StepOptions, so the diagnosis runs its chunks, its store (an
    offloaded one stays offloaded, in the same spec: nothing new is allocated) and its page
    selection; ``labels`` and ``doc_ids`` as given to that step. Returns None when the forward
    pass and every chunk's loss are finite (the non-finite value then arose in the backward pass).
    """
    check_model_architecture(model)
    prepared = prepare_step(model, input_ids, labels, doc_ids, options, forward_only=True)
    model, targets, store, step = prepared.model, prepared.targets, prepared.store, prepared.context
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    layers = list(getattr(decoder, "layers", []))
    watched = [model.get_input_embeddings(), *layers]
    if isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        watched.append(decoder.norm)
    layer_index = {id(m): i for i, m in enumerate(layers)}
    bounds = prepared.bounds
    found: list[torch.nn.Module] = []

    def check(module, args, output):
        tensor = _first_tensor(output)
        if not found and tensor is not None and not bool(torch.isfinite(tensor).all()):  # host sync per module
            found.append(module)

    hooks = [m.register_forward_hook(check) for m in watched]
    try:
        with prepared.running():
            for k, (start, end) in enumerate(bounds):
                store.append_chunk(end - start)
                hidden = run_chunk(model, step, input_ids, start, end)
                step.drop_page_lists(start)  # each chunk runs once: its page lists are not needed again
                site = dict(chunk=k, num_chunks=len(bounds), start=start, end=end)
                if found:
                    module = found[0]
                    return NonFiniteSite(**site, module=names.get(id(module), type(module).__name__),
                                         layer=layer_index.get(id(module)))
                loss = linear_cross_entropy_sum(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias,
                                                targets[:, start:end].reshape(-1), impl=options.loss_impl,
                                                transform=prepared.support.transform)
                if not bool(torch.isfinite(loss)):
                    return NonFiniteSite(**site, module="loss (LM head and cross-entropy)", layer=None)
    finally:
        for h in hooks:
            h.remove()
        store.clear()
    return None
