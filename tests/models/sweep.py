"""One family of the sweep: oomb's step against transformers' own full-sequence training, or its refusal.

    check_family(model_type) -> Outcome
        "exact"      loss and every parameter gradient within TOL of the full-sequence step
        "refused"    oomb raised before any work (every .grad still None), with its message
        "not run"    no sweep model: not a decoder-only text LM, or no tiny copy (the reason)
        "wrong"      neither: oomb trained it and got another result (a defect, never expected)

The batch: 2 sequences of SEQ tokens in chunks of CHUNK (a ragged last chunk and page), labels -100 on a prompt
and a tail; every parameter moved off its initial value (biases, norms, sinks and gates start at 0 or 1) so that
every path of the model matters.

Precision: float64 where the family's ops take it (experts run eagerly: grouped matmuls take no float64), else
float32. The reference attends with SDPA where the family has it (float64 throughout), else with its eager
attention, whose softmax is float32 in most families; its cross-entropy is float32 too. In float32, parameters
whose gradient sums many small terms (scalar gates, per-channel activations) would differ by the order of the
sum at about 1e-5, which float64 keeps out of the verdict. A gradient is compared relative to its own norm or,
where that is below 1e-3 of the largest gradient's, to that: a key bias's true gradient is zero (it shifts every
logit of a query equally), and its relative error would compare rounding with rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from families import sweep_config
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

import oomb
from oomb.engine import store_for_model
from oomb.engine.sizes import config_windows
from oomb.engine.twin import TwinUnavailable

TOL = 1e-5
SEQ, CHUNK, PAGE = 150, 32, 16
_FLOOR = 1e-3  # of the largest gradient's norm (module docstring)
# Families whose tiny twin trains on other lengths: Reformer's axial position shape is 8 x 12; Blenderbot's twin
# learns 128 positions.
SEQ_OF = {"reformer": 96, "blenderbot": 120}


@dataclass(frozen=True)
class Outcome:
    verdict: str  # "exact", "refused", "not run", "wrong"
    detail: str = ""  # the refusal or reason; for "wrong", the errors
    worst: float = 0.0  # largest relative error (loss or gradient) of an oomb step


def _rel(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    norm = max(float(ref.norm()), floor)
    return float((x - ref).norm()) / norm if norm else float((x - ref).norm())


def sweep_model(model_type: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The family's sweep model (its own attention: SDPA where the class has it, else eager), training mode,
    parameters moved off their init."""
    config = sweep_config(model_type)
    torch.manual_seed(0)
    # SDPA's math computes in the inputs' precision (eager attention's softmax is float32 in most families); eager
    # experts (a loop over experts) run in float64, where grouped matmuls do not
    attention = "sdpa" if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa else "eager"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, experts_implementation="eager")
    model = model.to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.train()


def sweep_batch(model: torch.nn.Module, seq_len: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    # ids the embedding and the head both have (a head may be narrower than the embedding)
    vocab = min(model.get_input_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, seq_len), generator=generator)
    labels = ids.clone()
    labels[0, :20] = -100  # a prompt without loss
    labels[1, 100:] = -100
    return ids, labels


def _reference(model_type: str):
    """The sweep model, its batch, and transformers' own loss and gradients: in float64 where the family runs it."""
    for dtype in (torch.float64, torch.float32):
        model = sweep_model(model_type, dtype)
        ids, labels = sweep_batch(model, SEQ_OF.get(model_type, SEQ))
        try:
            out = model(input_ids=ids, labels=labels)
        except RuntimeError:  # an op without float64 (grouped expert matmuls): float32
            if dtype == torch.float32:
                raise
            continue
        out.loss.backward()
        return model, ids, labels, out.loss.detach()
    raise AssertionError("unreachable")


def check_family(model_type: str) -> Outcome:
    try:
        model, ids, labels, ref_loss = _reference(model_type)
    except TwinUnavailable as e:
        return Outcome("not run", str(e))
    ref = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    try:
        loss = oomb.chunked_backward(model, ids, labels, chunk_size=CHUNK, page_size=PAGE, backend="torch",
                                     loss_impl="torch")
    except ValueError as e:  # UnsupportedModel and the other refusals before work
        touched = [name for name, p in model.named_parameters() if p.grad is not None]
        if touched:
            return Outcome("wrong", f"refused after work ({len(touched)} gradients written): {e}")
        return Outcome("refused", str(e))
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    if grads.keys() != ref.keys():
        return Outcome("wrong", f"gradients of other parameters: {sorted(grads.keys() ^ ref.keys())[:4]}")
    floor = _FLOOR * max(float(g.double().norm()) for g in ref.values())
    errors = {name: _rel(grads[name], ref[name], floor) for name in ref}
    errors["loss"] = _rel(loss, ref_loss)
    worst = max(errors, key=errors.get)
    if errors[worst] > TOL:
        return Outcome("wrong", f"{worst}: relative error {errors[worst]:.2e}", errors[worst])
    if (why := _planned_windows_too_short(model)) is not None:
        return Outcome("wrong", why)
    return Outcome("exact", "", errors[worst])


def _planned_windows_too_short(model) -> str | None:
    """Where the memory plan, reading windows from the config, counts fewer pages for a layer than the store the
    step allocated keeps (a window the config names that the layer's calls do not use, or a shorter one)."""
    engine = store_for_model(model).spec.windows
    calls = len(store_for_model(model).spec.layers) // model.config.num_hidden_layers
    planned = config_windows(model.config, calls_per_layer=max(calls, 1))
    if planned is None:
        return None  # the plan keeps every page: an upper bound
    if engine is not None and len(planned) != len(engine):
        return f"the plan reads {len(planned)} store layers' windows from the config, the step has {len(engine)}"
    for layer, window in enumerate(planned):
        used = None if engine is None else engine[layer]
        if window is not None and (used is None or window < used):
            return f"the plan reads a window of {window} for store layer {layer} from the config; its calls use {used}"
    return None
