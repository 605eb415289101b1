"""Stage 2 one decoder layer at a time (``StepOptions.recompute`` = "layer" or "layer-host").

With ``recompute="chunk"`` (the default) stage 2 runs a chunk's forward with autograd through every
layer, so the chunk's saved activations of all L layers are alive at once before its backward:
L x about 225 KiB per token for Qwen2.5-7B, 50 GiB for a chunk of 8192 tokens. With "layer":

    stage 1   runs every chunk (the last one too) and keeps each decoder layer's input, and the last
              layer's output: (L + 1) x hidden values per token of the sequence (Qwen2.5-7B in bf16:
              29 x 7 KiB = 203 KiB per token), on the GPU ("layer") or in pinned host memory ("layer-host")
    stage 2   a chunk's decoder call returns each layer's kept output at once (``_ReplayLayer``); the
              backward rebuilds one layer from its kept input and runs its backward before the next:
              one layer's activations alive at a time

It computes what "chunk" computes, with the same kernels, plus one forward of the last chunk (stage 1
fills its pages too; with the attention cache that forward's attention is reused, not repeated). The
kept inputs replace the activations of L - 1 layers of one chunk: with chunks long enough to feed the
GPU well, a step then needs little more than the weights, the paged store and the kept inputs — and
with "layer-host" not even those (they cross PCIe once each way, hidden behind the layers' compute).

The hook is transformers' own for gradient checkpointing: a decoder layer (a
``GradientCheckpointingLayer``) in training mode whose ``gradient_checkpointing`` is set calls
``_gradient_checkpointing_func(layer_call, hidden_states)``. For the duration of a step each layer gets
oomb's function instead (and its own settings back afterwards); no forward method is replaced. Each
layer's output must go to the next layer unchanged (true of the Llama, Qwen, Mistral and GPT-OSS
decoders): the replayed outputs are placeholders but for the last layer's, which is checked.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Mapping

import torch
from transformers import PreTrainedModel

from oomb.engine.host_stash import HostStash, chunk_lengths, region_bytes

RECOMPUTE_MODES = ("chunk", "layer", "layer-host")

def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The decoder's layers, in order; raises where they cannot be recomputed one at a time."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = list(getattr(model.get_decoder(), "layers", None) or [])
    if not layers or not all(isinstance(layer, GradientCheckpointingLayer) for layer in layers):
        raise ValueError(
            f"recompute='layer' needs a decoder whose layers are transformers GradientCheckpointingLayers "
            f"({type(model).__name__}'s are not): use recompute='chunk'"
        )
    return layers


@functools.lru_cache(maxsize=16)
def _rebuildable(config_json: str, trust_remote_code: bool) -> bool:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(**json.loads(config_json))
        with torch.device("meta"):  # the modules' types only: nothing is allocated
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        decoder_layers(model)
    except Exception:  # noqa: BLE001 (any model that cannot be built or checked here recomputes whole chunks)
        return False
    return True


def layers_rebuildable(model_config, trust_remote_code: bool = False) -> bool:
    """Whether a model of ``model_config`` (a transformers config) has decoder layers recompute="layer" can
    rebuild one at a time, asked before the model exists (a memory plan choosing the setting): its modules
    built on the meta device, checked as ``decoder_layers`` checks them."""
    return _rebuildable(model_config.to_json_string(use_diff=False), trust_remote_code)


def check_layer_recompute(model: PreTrainedModel) -> None:
    """Raise, saying what to change, where a step cannot recompute one layer at a time."""
    from torch.distributed.fsdp import FSDPModule

    from oomb.surgery.tensor_parallel import tensor_parallel_group

    # Layers rebuilt inside the backward: FSDP2's backward hooks do not follow them (two ranks trained differently
    # from one process in a trial), and tensor parallel's collectives inside them are not tested.
    if any(isinstance(m, FSDPModule) for m in model.modules()) or tensor_parallel_group(model) is not None:
        raise ValueError("recompute='layer' runs in one process: not with FSDP (data parallel under torchrun) or "
                         "a tensor parallel split; use recompute='chunk'")
    layers = decoder_layers(model)
    if not all(layer.training for layer in layers):
        raise ValueError("recompute='layer' runs through transformers' gradient-checkpointing hook, which a "
                         "model in eval mode skips: call model.train() before the step")


class LayerInputs:
    """Every decoder layer's input (and the last layer's output) of every chunk of one step, by (chunk start,
    slot); slot l is layer l's input, slot L the last layer's output.

    On the device, the tensors stage 1 computed are kept as they are (no copy) and each is freed when its
    backward has read it. On the host (``stash``), they go to a ``HostStash`` and come back one layer ahead
    of the backward that reads them.
    """

    def __init__(self, stash: HostStash | None = None) -> None:
        self._kept: dict[tuple[int, int], torch.Tensor] = {}
        self._stash = stash

    @staticmethod
    def nbytes(num_layers: int, lengths: Mapping[int, int], batch: int, hidden: int, dtype: torch.dtype) -> int:
        """Bytes of every layer's input and the last layer's output of every chunk (each region aligned);
        ``lengths``: the chunks' chunk_lengths (oomb.engine.host_stash)."""
        return sum(count * (num_layers + 1) * region_bytes((batch, length, hidden), dtype)
                   for length, count in lengths.items())

    @classmethod
    def on_host(cls, model: torch.nn.Module, num_layers: int, chunks: list[tuple[int, int]], batch: int,
                hidden: int, dtype: torch.dtype, device: torch.device) -> LayerInputs:
        nbytes = cls.nbytes(num_layers, chunk_lengths(chunks), batch, hidden, dtype)
        return cls(HostStash.for_model(model, "layer inputs", nbytes, device,
                                       on_gpu='recompute="chunk" (train.recompute=chunk)'))

    def keep(self, slot: int, start: int, x: torch.Tensor) -> None:
        """Stage 1: ``x`` [B, C, hidden] is slot ``slot``'s value of the chunk at ``start``."""
        if self._stash is None:
            self._kept[(start, slot)] = x
        else:
            self._stash.keep((start, slot), x)

    def prefetch(self, slot: int, start: int) -> None:
        """Stage 2, host: start bringing slot ``slot`` of the chunk at ``start`` back (slot -1: nothing)."""
        if self._stash is not None and slot >= 0:
            self._stash.prefetch((start, slot))

    def take(self, slot: int, start: int) -> torch.Tensor:
        """Stage 2: slot ``slot`` of the chunk at ``start`` on the device (each slot is taken once)."""
        if self._stash is None:
            return self._kept.pop((start, slot))
        return self._stash.take((start, slot))

    def release(self, start: int) -> None:
        """Drop what is left of the chunk at ``start`` (after its backward)."""
        for key in [k for k in self._kept if k[0] == start]:
            del self._kept[key]
        if self._stash is not None:
            self._stash.forget(lambda key: key[0] != start)

    def clear(self) -> None:
        self._kept.clear()
        if self._stash is not None:
            self._stash.reset()


class _ReplayLayer(torch.autograd.Function):
    """A decoder layer in stage 2: the forward hands on a placeholder (the last layer: its kept output);
    the backward rebuilds the layer from its kept input and runs its backward."""

    @staticmethod
    def forward(ctx, hidden, anchor, run, replay: LayerRecompute, layer: int):
        ctx.run, ctx.replay, ctx.layer = run, replay, layer
        return replay.replayed_output(layer, hidden)

    @staticmethod
    def backward(ctx, grad):
        replay, layer = ctx.replay, ctx.layer
        start = replay.chunk[0]
        x = replay.inputs.take(layer, start)
        replay.inputs.prefetch(layer - 1, start)  # the next backward's input, while this one runs
        x = x.detach().requires_grad_(ctx.needs_input_grad[0])
        with torch.enable_grad():
            y = ctx.run(x)
        if y.requires_grad:  # else nothing in or before this layer is trained
            torch.autograd.backward(y, grad)
        return (x.grad if ctx.needs_input_grad[0] else None), None, None, None, None


class LayerRecompute:
    """The hook on each decoder layer for one step: stage 1 keeps inputs, stage 2 replays (module docstring)."""

    def __init__(self, model: PreTrainedModel, inputs: LayerInputs, layers_seen: set[int]) -> None:
        self.layers = decoder_layers(model)
        self.inputs = inputs
        self.layers_seen = layers_seen  # the step's record of layers that went through oomb
        self.stage = "fill"
        self.chunk = (0, 0)
        self._previous: torch.Tensor | None = None  # the last output handed on, to check the next input is it
        self._anchor: torch.Tensor | None = None

    def _check_chain(self, layer: int, hidden: torch.Tensor) -> None:
        if layer > 0 and hidden is not self._previous:
            raise RuntimeError(
                f"recompute='layer': decoder layer {layer} got an input other than layer {layer - 1}'s output "
                "(this decoder computes between its layers), so its layers cannot be replayed one at a time: "
                "use recompute='chunk'"
            )

    def call(self, layer: int, run: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise RuntimeError("recompute='layer' needs each decoder layer called with its hidden states as the one "
                               f"positional argument (got {len(args)}); use recompute='chunk'")
        hidden = args[0]
        self._check_chain(layer, hidden)
        start, end = self.chunk
        last = layer == len(self.layers) - 1
        if self.stage == "fill":
            self.inputs.keep(layer, start, hidden)
            out = run(hidden)
            if not isinstance(out, torch.Tensor):
                raise RuntimeError("recompute='layer' needs decoder layers that return their hidden states as "
                                   f"one tensor (transformers 5), got {type(out).__name__}: use recompute='chunk'")
            if last:
                self.inputs.keep(layer + 1, start, out)
        else:
            if self._anchor is None or self._anchor.device != hidden.device:
                # Makes every replayed output require grad, also where nothing before it does (LoRA's
                # frozen embedding): the backward, which rebuilds the trained layers, must run.
                self._anchor = torch.zeros((), device=hidden.device, requires_grad=True)
            self.layers_seen.add(layer)
            if last:
                self.inputs.prefetch(layer, start)  # read first by this layer's backward
            out = _ReplayLayer.apply(hidden, self._anchor, run, self, layer)
        self._previous = out
        return out

    def replayed_output(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """What layer ``layer`` hands on in stage 2: the last layer's kept output (the loss reads it), else a
        placeholder of the right shape that no one reads (the next layer's replay ignores its input)."""
        if layer == len(self.layers) - 1:
            return self.inputs.take(layer + 1, self.chunk[0])
        return hidden.new_zeros(1).expand(hidden.shape)

    def begin_chunk(self, stage: str, start: int, end: int) -> None:
        self.stage, self.chunk, self._previous = stage, (start, end), None


@contextlib.contextmanager
def layer_recompute(model: PreTrainedModel, inputs: LayerInputs, layers_seen: set[int]):
    """Route every decoder layer's call through a ``LayerRecompute`` for the block; restore them after."""
    replay = LayerRecompute(model, inputs, layers_seen)
    saved = []
    for index, layer in enumerate(replay.layers):
        saved.append({name: layer.__dict__[name] for name in ("gradient_checkpointing", "_gradient_checkpointing_func")
                      if name in layer.__dict__})
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = (
            lambda run, *args, index=index: replay.call(index, run, *args))
    try:
        yield replay
    finally:
        inputs.clear()
        for layer, before in zip(replay.layers, saved, strict=True):
            for name in ("gradient_checkpointing", "_gradient_checkpointing_func"):
                layer.__dict__.pop(name, None)
            layer.__dict__.update(before)
