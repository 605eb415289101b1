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
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

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


def check_layer_recompute(model: PreTrainedModel) -> None:
    """Raise, saying what to change, where a step cannot recompute one layer at a time (StepOptions refuses
    it with offload)."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("recompute='layer' is not supported with FSDP (data parallel under torchrun): "
                         "use recompute='chunk'")
    layers = decoder_layers(model)
    if not all(layer.training for layer in layers):
        raise ValueError("recompute='layer' runs through transformers' gradient-checkpointing hook, which a "
                         "model in eval mode skips: call model.train() before the step")


class LayerInputs:
    """Every decoder layer's input (and the last layer's output) of every chunk of one step.

    On the device, the tensors stage 1 computed are kept as they are (no copy) and each chunk's are
    freed after its backward. On the host (``on_host``), they are copied into one pinned buffer
    [L + 1, B, N, hidden] on a side stream, and copied back one layer ahead of the backward that reads
    them.
    """

    def __init__(self, num_layers: int, batch: int, seq_len: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, *, on_host: bool) -> None:
        self.num_layers = num_layers
        self.on_host = on_host
        self.device = device
        self._kept: dict[tuple[int, int], torch.Tensor] = {}  # (chunk start, slot) -> tensor, on the device
        self._fetched: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._host = self._stream = None
        if on_host:
            shape = (num_layers + 1, batch, seq_len, hidden)
            cuda = device.type == "cuda"
            if cuda:
                from oomb.offload.copy import pinned_empty

                self._host = pinned_empty(shape, dtype)
                self._stream = torch.cuda.Stream(device)
            else:
                self._host = torch.empty(shape, dtype=dtype)

    def keep(self, slot: int, start: int, x: torch.Tensor) -> None:
        """Stage 1: ``x`` [B, C, hidden] is slot ``slot``'s value (layer ``slot``'s input) of the chunk at ``start``."""
        if not self.on_host:
            self._kept[(start, slot)] = x
            return
        target = self._host[slot, :, start:start + x.shape[1]]
        if self._stream is None:
            target.copy_(x)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # x is computed
        with torch.cuda.stream(self._stream):
            target.copy_(x, non_blocking=True)
        x.record_stream(self._stream)  # its memory is not reused before the copy is done

    def prefetch(self, slot: int, start: int, end: int) -> None:
        """Stage 2, host: start copying slot ``slot`` of the chunk [start, end) back to the device."""
        if not self.on_host or (start, slot) in self._fetched or slot < 0:
            return
        source = self._host[slot, :, start:end]
        x = torch.empty(source.shape, dtype=source.dtype, device=self.device)
        if self._stream is None:
            self._fetched[(start, slot)] = (x.copy_(source), None)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # x's memory is free to write
        with torch.cuda.stream(self._stream):
            x.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._fetched[(start, slot)] = (x, done)

    def take(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Stage 2: slot ``slot`` of the chunk [start, end) on the device (each slot is taken once)."""
        if not self.on_host:
            return self._kept.pop((start, slot))
        self.prefetch(slot, start, end)
        x, done = self._fetched.pop((start, slot))
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return x

    def release(self, start: int) -> None:
        """Drop what is left of the chunk at ``start`` (after its backward, or after an error)."""
        for key in [k for k in self._kept if k[0] == start]:
            del self._kept[key]
        for key in [k for k in self._fetched if k[0] == start]:
            del self._fetched[key]

    def clear(self) -> None:
        self._kept.clear()
        self._fetched.clear()


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
        x = replay.inputs.take(layer, *replay.chunk)
        replay.inputs.prefetch(layer - 1, *replay.chunk)  # the next backward's input, while this one runs
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

    def call(self, layer: int, run: Callable[..., torch.Tensor], hidden: torch.Tensor, *args) -> torch.Tensor:
        if args:
            raise RuntimeError("recompute='layer': a decoder layer was called with more than the hidden states "
                               "as positional arguments; use recompute='chunk'")
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
                self.inputs.prefetch(layer, start, end)  # read first by this layer's backward
            out = _ReplayLayer.apply(hidden, self._anchor, run, self, layer)
        self._previous = out
        return out

    def replayed_output(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """What layer ``layer`` hands on in stage 2: the last layer's kept output (the loss reads it), else a
        placeholder of the right shape that no one reads (the next layer's replay ignores its input)."""
        if layer == len(self.layers) - 1:
            return self.inputs.take(layer + 1, *self.chunk)
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
            lambda run, hidden, *args, index=index: replay.call(index, run, hidden, *args))
    try:
        yield replay
    finally:
        inputs.clear()
        for layer, before in zip(replay.layers, saved, strict=True):
            for name in ("gradient_checkpointing", "_gradient_checkpointing_func"):
                layer.__dict__.pop(name, None)
            layer.__dict__.update(before)
