"""Whether oomb trains a model exactly: decided before any work, from what the model's own forward does.

    model_support(model)     the model as it is (its weights, its dtype, its device): probes its forward on
                             a few tokens (oomb.attention.probe) and returns a ``ModelSupport``: one store
                             layer per attention call (``AttentionSite``: its K/V shape, window, sinks) and
                             the ``LogitTransform`` between the decoder and the loss; or raises
                             ``UnsupportedModel`` naming every feature oomb cannot reproduce
    config_support(config,   the architecture alone (no weights needed: ``oomb plan``): the same probe of a tiny
                   self_test)  random copy of the config (oomb.engine.twin), long enough to see its windows, then
                             one chunked step of the copy against its own full-sequence step (the step's
                             self-test, passed in: ``oomb.engine.step.check_architecture``), which sees what no
                             attention call shows (positions counted from a chunk's start)

The entry points run both before any work: ``chunked_backward``, ``chunked_eval`` and the NaN locator,
``oomb plan`` and ``oomb train``, ``OombTrainer``. Results are kept per model and per config.

What is refused, and why (each in words a user can act on):
- an attention mask other than causal within the window the call names: a window applied only through
  the mask, a mask that ignores the window the call passes, chunked, bidirectional or prefix attention;
- attention over keys that are not the layer's own tokens, logit soft-capping inside attention,
  attention dropout, a forward that is random in training mode (dropout, router jitter): stage 2 must
  recompute exactly what stage 1 computed;
- a decoder layer without an attention call (recurrent and linear-attention layers carry state across
  chunks), an LM head that is not one Linear on the decoder's output (up to a factor), logits that are
  not the head's output up to a factor from the config and a soft-cap.
A module that calls attention more than once per forward (differential attention) gets a store layer per
call; key and value head sizes may differ (latent attention), and layers may differ in shape.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from oomb.attention import check_attention_support
from oomb.attention.probe import ProbeReport, close, probe_model
from oomb.cache import PageShape
from oomb.engine.loss import LogitTransform

PROBE_TOKENS = 32  # tokens of the probe on the model itself (windows shorter than this are checked there too)
TWIN_TOKENS = 96  # tokens of the probe on the tiny copy, whose windows are shrunk below this
_EXACT_TOL = 1e-5  # fp32 forwards: relative L2 error of an exactly reproduced transform
_LOW_PRECISION_TOL = 2e-2  # bf16 / fp16 forwards: the transform holds up to the dtype's rounding


# One chunked step of a tiny model against its own full-sequence step: None where they agree, else what differs.
SelfTest = Callable[[PreTrainedModel], "str | None"]


class UnsupportedModel(ValueError):
    """oomb cannot train this model exactly; the message names what and, where it can, what to change."""


@dataclass(frozen=True)
class AttentionSite:
    """One attention call of a chunk's forward: a layer of the paged store."""

    module: str  # qualified name of the attention module
    layer: int  # the decoder layer it belongs to
    call: int  # the how-many-th call of the module's forward (0 but for differential attention)
    heads: int  # query heads (this rank's under tensor parallelism)
    page: PageShape  # its K/V shape (this rank's KV heads under tensor parallelism)
    sliding_window: int | None
    sinks: bool


@dataclass(frozen=True)
class ModelSupport:
    """What oomb needs to know of a model it can train: its attention sites and its logit transform."""

    sites: tuple[AttentionSite, ...]
    transform: LogitTransform
    # False where the probe's forward was not finite (a model with non-finite weights): the head and randomness
    # could not be judged, the transform is taken as none, and the check runs again next time.
    complete: bool = True

    @property
    def page_shapes(self) -> tuple[PageShape, ...]:
        return tuple(site.page for site in self.sites)

    @property
    def windows(self) -> tuple[int | None, ...] | None:
        """Each site's sliding window (None: full attention), as StoreSpec.windows takes them."""
        return tuple(site.sliding_window for site in self.sites)

    @property
    def site_layers(self) -> tuple[int, ...]:
        return tuple(site.layer for site in self.sites)

    @property
    def attention_layers(self) -> set[int]:
        """Decoder layers with at least one attention call."""
        return set(self.site_layers)

    def site_map(self, model: torch.nn.Module) -> dict[torch.nn.Module, tuple[int, ...]]:
        """Attention module of ``model`` -> its sites, in call order (StepContext.sites)."""
        by_module: dict[str, list[int]] = {}
        for index, site in enumerate(self.sites):
            by_module.setdefault(site.module, []).append(index)
        return {model.get_submodule(name): tuple(sites) for name, sites in by_module.items()}


def _decoder_layer_of(model: PreTrainedModel, module_name: str, layer_idx: int | None) -> int | None:
    """The index of the decoder layer holding ``module_name`` (by name), else the module's own layer_idx."""
    names = {id(module): name for name, module in model.named_modules()}
    for index, layer in enumerate(getattr(model.get_decoder(), "layers", None) or []):
        prefix = names.get(id(layer))
        if prefix is not None and module_name.startswith(prefix + "."):
            return index
    return layer_idx


def _scale_candidates(config) -> list[float]:
    """Numbers a model may scale its head's input or output by: config values named like a scale, multiplier or
    logit factor, and their inverses (Granite divides by ``logits_scaling``, HyperCLOVA X multiplies by it)."""
    values = {1.0}
    for name, value in config.to_dict().items():
        lowered = name.lower()
        if (isinstance(value, int | float) and not isinstance(value, bool) and value
                and any(word in lowered for word in ("scal", "multiplier", "logit"))):
            values.update((float(value), 1.0 / float(value)))
    return sorted(values)


def _softcap_candidates(config) -> list[float | None]:
    caps = [float(v) for k, v in config.to_dict().items()
            if "softcap" in k.lower() and "attn" not in k.lower() and isinstance(v, int | float) and v]
    return [None, *caps]


def _transform_of(report: ProbeReport, config, tol: float) -> tuple[LogitTransform | None, list[str]]:
    """The LogitTransform that reproduces the model's logits from its decoder's output, or the problems."""
    if report.head_output is None or report.head_input is None or report.decoder_output is None:
        return None, ["its logits do not come from its output embedding applied to its decoder's output "
                      "(get_output_embeddings() or get_decoder() did not run)"]
    hidden_scale = next((s for s in _scale_candidates(config)
                         if close(report.head_input, report.decoder_output * s, tol)), None)
    if hidden_scale is None:
        return None, ["it changes the hidden state between its decoder and its LM head (more than one Linear "
                      "in the head, or a transform oomb's fused loss does not apply)"]
    for softcap in _softcap_candidates(config):
        for scale in _scale_candidates(config):
            t = LogitTransform(hidden_scale=1.0, logit_scale=scale, softcap=softcap)
            z = report.head_output.double() * scale
            expected = z if softcap is None else softcap * torch.tanh(z / softcap)
            if close(report.logits, expected, tol):
                return LogitTransform(hidden_scale, t.logit_scale, softcap), []
    return None, ["its logits are not its LM head's output times a number of its config (with a soft-cap): a "
                  "transform oomb's fused loss does not apply"]


def _field_of(config, value: float) -> str:
    """The name of the config's dropout field holding ``value`` (what the user sets), else a description."""
    return next((k for k, v in config.to_dict().items() if "drop" in k.lower() and v == value),
                "the attention dropout")


def _random_fields(config) -> list[str]:
    return [f"{k}={v}" for k, v in sorted(config.to_dict().items())
            if any(w in k.lower() for w in ("dropout", "pdrop", "jitter", "noise"))
            and isinstance(v, int | float) and not isinstance(v, bool) and v]


def judge(report: ProbeReport, model: PreTrainedModel, *, tol: float) -> ModelSupport:
    """A probe report -> ModelSupport, or UnsupportedModel listing every problem."""
    problems: list[str] = []
    if not report.calls:
        problems.append("no attention call went through transformers' AttentionInterface")
    per_call: dict[str, list[str]] = {}  # problem -> the calls that have it (most repeat in every layer)
    sites = []
    for name, calls in report.calls_by_module().items():
        for n, call in enumerate(calls):
            where = f"{name}" + (f" (call {n + 1})" if len(calls) > 1 else "")
            found = []
            if call.mask != "causal":
                found.append(f"its attention mask {call.mask}")
            if call.softcap:
                found.append(f"attention logit soft-capping ({call.softcap})")
            if call.dropout:
                found.append(f"attention dropout {call.dropout} (set {_field_of(model.config, call.dropout)}=0 in "
                             "the config)")
            if call.heads % call.kv_heads:
                found.append(f"{call.heads} query heads are not a multiple of {call.kv_heads} KV heads")
            layer = _decoder_layer_of(model, name, call.layer_idx)
            if layer is None:
                found.append("an attention module outside the decoder's layers")
            for problem in found:
                per_call.setdefault(problem, []).append(where)
            if layer is not None:
                sites.append(AttentionSite(module=name, layer=layer, call=n, heads=call.heads,
                                           page=PageShape(call.kv_heads, call.key_dim, call.value_dim),
                                           sliding_window=call.sliding_window, sinks=call.sinks))
    for problem, where in per_call.items():
        more = f" and {len(where) - 3} more" if len(where) > 3 else ""
        problems.append(f"{problem} in {', '.join(where[:3])}{more}")
    num_layers = len(getattr(model.get_decoder(), "layers", None) or [])
    silent = sorted(set(range(num_layers)) - {site.layer for site in sites})
    if sites and silent:
        problems.append(f"decoder layers {silent[:8]} make no attention call through AttentionInterface "
                        "(recurrent or linear-attention layers carry state across chunks)")
    # A forward that is not finite (non-finite weights) says nothing of randomness or the head: the step will
    # find the non-finite values and name them (oomb.engine.diagnose), which is the more useful error.
    finite = report.logits is not None and bool(torch.isfinite(report.logits).all())
    if report.random and finite:
        fields = _random_fields(model.config)
        problems.append("its forward is random in training mode, so stage 2 could not recompute stage 1"
                        + (f" (set {', '.join(fields)} to 0)" if fields else " (dropout or noise)"))
    transform, head_problems = _transform_of(report, model.config, tol) if finite else (LogitTransform(), [])
    problems += head_problems
    head = model.get_output_embeddings()
    if head is not None and getattr(getattr(head, "weight", None), "dim", lambda: 0)() != 2:
        problems.append(f"its LM head ({type(head).__name__}) is not a Linear layer with a weight")
    if problems:
        raise UnsupportedModel(
            f"oomb cannot train {type(model).__name__} ({model.config.model_type}) exactly: "
            + "; ".join(dict.fromkeys(problems)))
    return ModelSupport(sites=tuple(sites), transform=transform, complete=finite)


def _probe_ids(config, batch: int, tokens: int, device) -> torch.Tensor:
    vocab = getattr(config, "vocab_size", None) or 32
    generator = torch.Generator().manual_seed(0)
    return torch.randint(min(3, vocab - 1), vocab, (batch, tokens), generator=generator).to(device)


@dataclass(frozen=True)
class ArchitectureCheck:
    """What the check of an architecture on its tiny copy found (``config_support``)."""

    checked: bool  # False where no tiny copy could be made (the model's own check decides)
    calls_per_layer: int = 1  # attention calls of a decoder layer's forward (2: differential attention)
    refusal: str | None = None  # UnsupportedModel's message, where oomb cannot train it


# Model -> (its config and mode when checked, the verdict), so a model is probed once.
_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ModelSupport]] = weakref.WeakKeyDictionary()


# Architecture checks, by the config's JSON and the training mode.
_VERDICTS: dict[str, ArchitectureCheck] = {}


def _twin_verdict(config, training: bool, trust_remote_code: bool, self_test: SelfTest) -> ArchitectureCheck:
    from transformers import AutoModelForCausalLM

    from oomb.engine.twin import TwinUnavailable, tiny_twin_config

    try:
        twin = tiny_twin_config(config)
    except TwinUnavailable as e:
        warnings.warn(f"oomb could not build a small copy of this {config.model_type!r} architecture to check its "
                      f"attention masks over {TWIN_TOKENS} tokens ({e}); it checks the model itself over "
                      f"{PROBE_TOKENS} tokens only", stacklevel=4)
        return ArchitectureCheck(checked=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(twin, attn_implementation="eager",
                                                 trust_remote_code=trust_remote_code).float()
    model.train(training)
    try:
        check_attention_support(model)
        support = judge(probe_model(model, _probe_ids(twin, 2, TWIN_TOKENS, "cpu")), model, tol=_EXACT_TOL)
    except ValueError as e:  # UnsupportedModel, and check_attention_support's refusals
        return ArchitectureCheck(checked=True, refusal=str(e))
    # The self-test's step checks the copy no further (its own copy is the same architecture, being checked now).
    _CHECKED[model] = (_model_key(model), support)
    _VERDICTS[_config_key(twin, training)] = ArchitectureCheck(checked=True)
    mismatch = self_test(model)
    if mismatch is not None:
        return ArchitectureCheck(checked=True, refusal=(
            f"oomb cannot train {type(model).__name__} ({config.model_type}) exactly: its chunked step does not "
            f"reproduce the model's own training on a small copy of it ({mismatch}). The model depends on where a "
            "chunk starts in a way its attention calls do not show: positions counted from the chunk rather than "
            "taken from position_ids, or state carried from token to token outside attention"))
    return ArchitectureCheck(checked=True, calls_per_layer=max(s.call for s in support.sites) + 1)


def config_support(config, self_test: SelfTest, *, training: bool = True,
                   trust_remote_code: bool = False) -> ArchitectureCheck:
    """Raise UnsupportedModel where oomb cannot train the architecture ``config`` describes, checked once per config
    on a tiny random copy of it: probed as ``model_support`` probes a model, then ``self_test`` (the step's: one
    chunked step against the copy's own full-sequence step; None where they agree, else what differs). Else what
    the check found (``checked`` False where no copy can be made: the model's own check then decides).
    ``oomb.engine.step.check_architecture`` is this with the step's self-test."""
    key = _config_key(config, training)
    if key not in _VERDICTS:
        _VERDICTS[key] = _twin_verdict(config, training, trust_remote_code, self_test)
    found = _VERDICTS[key]
    if found.refusal is not None:
        raise UnsupportedModel(found.refusal)
    return found


def _config_key(config, training: bool) -> str:
    return f"{training}:{config.to_json_string(use_diff=False)}"


def _model_key(model: PreTrainedModel) -> str:
    return _config_key(model.config, model.training)


def model_support(model: PreTrainedModel) -> ModelSupport:
    """The model's attention sites and logit transform; UnsupportedModel (a ValueError) where oomb cannot train it
    exactly. Checked once per model, its config and its training mode (the module docstring)."""
    check_attention_support(model)
    key = _model_key(model)
    kept = _CHECKED.get(model)
    if kept is not None and kept[0] == key:
        return kept[1]
    weight = model.get_input_embeddings().weight
    ids = _probe_ids(model.config, 1, PROBE_TOKENS, weight.device)
    tol = _EXACT_TOL if weight.dtype in (torch.float32, torch.float64) else _LOW_PRECISION_TOL
    support = judge(probe_model(model, ids), model, tol=tol)
    if support.complete:
        _CHECKED[model] = (key, support)
    return support
