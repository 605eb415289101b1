"""What a run does when something goes wrong: signals, running out of memory, non-finite numbers.

Every failure that stops a run raises ``RunStopped``: its message says what happened,
what is on disk and the exact command that continues the run; its ``exit_code`` tells
scripts which failure it was. docs/failures.md shows each message and what to do.

    exit code   meaning
    0           done
    2           refused before any work (config, paths, a damaged checkpoint to resume from, a resumed run
                whose data files or base model changed)
    3           stopped: non-finite loss or gradient (train.on_nonfinite=stop)
    4           stopped: out of memory inside a step
    5           stopped: a checkpoint or another file of the run could not be written (a full disk)
    6           stopped: the data of a step could not be read, or a data file changed during the run
    75          stopped by SIGINT/SIGTERM after writing a checkpoint
    130         Ctrl-C before the first step (nothing trained, nothing left behind)
    130, 143    killed by a second SIGINT/SIGTERM (the default action of the signal)
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from oomb.engine import store_for_model
from oomb.engine.layer_recompute import check_layer_recompute
from oomb.engine.prepare import unwrap_peft
from oomb.train.config.step import gpu_memory_cap
from oomb.train.loop.optim import MasterWeights

EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_OUT_OF_MEMORY = 4
EXIT_WRITE = 5  # a checkpoint, the export or another file of the run
EXIT_DATA = 6  # the data of a step could not be read (a file changed or gone, a stream unreachable)
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped on request, resumable
EXIT_SIGINT = 130  # Ctrl-C before the first step: nothing to resume


class RunStopped(Exception):
    """The run stopped on a failure it handled; ``str(e)`` is the message for the user."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StepAbandoned(Exception):
    """Raised at a chunk boundary once a stop was requested: the step in progress is dropped."""


def resume_command(path: Path | str, *overrides: str) -> str:
    return " ".join(["oomb", "train", shlex.quote(f"resume={path}"), *map(shlex.quote, overrides)])


# ---------------------------------------------------------------------------------- signals


class StopRequest:
    """SIGINT/SIGTERM -> stop at the next chunk boundary; a second one kills the process at once.

    Why abandon rather than finish the step: at a million tokens one step takes an hour
    or more, and a job scheduler's SIGTERM gives a grace period of seconds to minutes. A
    step's work is only usable once its last chunk's backward is done, so a half-done step
    is worth nothing either way; dropping it at the next chunk boundary (one chunk's
    compute, seconds) leaves the time to write the checkpoint of the last completed step.

    The second signal restores the signal's default action and re-raises it, so the kernel
    ends the process even while it is inside a long native call. Nothing is corrupted:
    checkpoints are published by rename (a kill mid-write leaves only ``*.tmp`` debris,
    removed by the next save) and each metrics line is one write.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._hook = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        step = ("dropping the step in progress at its next chunk" if self._hook is not None else
                "finishing the step in progress (every rank stops after the same step)")
        # os.write, not print: a signal handler may run in the middle of the console's own output.
        os.write(2, (f"\noomb: {signal.Signals(signum).name} received: {step}, writing a checkpoint, then "
                     "stopping. Send it again to stop at once (the last complete checkpoint stays intact).\n").encode())

    def check(self) -> None:
        if self.signum is not None:
            raise StepAbandoned(self.name)

    def install(self, model: torch.nn.Module, at_chunks: bool = True) -> StopRequest:
        """Catch the signals (main thread only: Python allows handlers nowhere else) and check at chunks.

        ``at_chunks=False``: no check inside steps; the caller reads ``requested`` between steps
        (data parallel ranks must agree where to stop, or one would wait in a collective forever).
        """
        if at_chunks:  # before the handlers, which say whether the step is dropped at a chunk or finished
            # Every chunk's forward starts with the token embedding: a boundary between chunks.
            self._hook = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: self.check())
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


# ---------------------------------------------------------------------------------- memory


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA out of memory, or a failed host allocation (Python's MemoryError or torch's CPU allocator)."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


@dataclass
class MemoryUse:
    """Bytes by what holds them, measured in this process (None = not measurable here)."""

    parameters: int
    gradients: int
    optimizer_state: int
    kv_store: int
    kv_store_bytes_per_token: int | None
    process_rss: int | None
    process_peak_rss: int | None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak_allocated: int | None = None
    cuda_total: int | None = None
    master_weights: int = 0  # fp32 master copies of 16-bit parameters (train.master_weights)


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _rss() -> tuple[int | None, int | None]:
    """Current and peak resident memory of this process (Linux /proc; the peak alone elsewhere)."""
    current = peak = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return current, peak


def measure_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> MemoryUse:
    params = list(model.parameters())
    store = store_for_model(model)
    state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()]
    masters = optimizer.masters if isinstance(optimizer, MasterWeights) else []
    rss, peak = _rss()
    use = MemoryUse(
        parameters=_tensor_bytes(params),
        gradients=_tensor_bytes(p.grad for p in params if p.grad is not None),
        optimizer_state=_tensor_bytes(state),
        kv_store=store.nbytes() if store is not None else 0,
        kv_store_bytes_per_token=store.spec.bytes_per_token() if store is not None else None,
        process_rss=rss,
        process_peak_rss=peak,
        master_weights=_tensor_bytes(masters),
    )
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        use.cuda_allocated = torch.cuda.memory_allocated(device)
        use.cuda_reserved = torch.cuda.memory_reserved(device)
        use.cuda_peak_allocated = torch.cuda.max_memory_allocated(device)
        use.cuda_total = torch.cuda.get_device_properties(device).total_memory
    return use


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_report(use: MemoryUse, cfg, *, estimate: dict[str, int] | None = None, model=None) -> str:
    """What held the memory, and which setting to change.

    ``estimate`` (a planner's prediction, keyed like MemoryUse's fields) adds a column
    beside the measurement; rows without an estimate show "-".
    """
    rows = [
        ("parameters", "parameters", use.parameters),
        ("gradients", "gradients", use.gradients),
        ("optimizer state (AdamW)", "optimizer_state", use.optimizer_state),
        *([("fp32 master weights", "master_weights", use.master_weights)] if use.master_weights else []),
        ("K/V store (pages + gradient pages)", "kv_store", use.kv_store),
        ("process resident (host RSS)", "process_rss", use.process_rss),
        ("process peak resident", "process_peak_rss", use.process_peak_rss),
    ]
    if use.cuda_allocated is not None:
        rows += [
            ("CUDA allocated", "cuda_allocated", use.cuda_allocated),
            ("CUDA reserved by the caching allocator", "cuda_reserved", use.cuda_reserved),
            ("CUDA peak allocated", "cuda_peak_allocated", use.cuda_peak_allocated),
            ("CUDA device total", "cuda_total", use.cuda_total),
        ]
    width = max(len(label) for label, _, _ in rows)
    head = f"  {'what':<{width}}  {'measured':>13}" + (f"  {'planned':>13}" if estimate is not None else "")
    lines = [head]
    for label, key, value in rows:
        line = f"  {label:<{width}}  {_size(value):>13}"
        if estimate is not None:
            line += f"  {_size(estimate.get(key)):>13}"
        lines.append(line)
    return "\n".join(lines) + "\nTo need less memory:\n" + "\n".join(f"  - {a}" for a in memory_advice(use, cfg, model))


def memory_advice(use: MemoryUse, cfg, model=None) -> list[str]:
    """Settings that shrink what was measured, the largest holder first (``model``: the run's, asked whether its
    layers can be rebuilt one at a time)."""
    t = cfg.train
    tokens = t.batch_size * cfg.data.seq_len
    advice: list[tuple[int, str]] = []
    per_token = use.kv_store_bytes_per_token
    store_note = f" ({per_token * 2**20 / 2**30:.2f} GiB per million tokens here)" if per_token else ""
    advice.append((use.kv_store, f"data.seq_len={cfg.data.seq_len} or train.batch_size={t.batch_size}: the K/V "
                                 f"store grows with the tokens of one chunked_backward call, {tokens:,} now"
                                 f"{store_note}"))
    if t.batch_size > 1:  # the same tokens per optimizer step, one sequence's store at a time
        advice.append((use.kv_store, f"train.batch_size=1 train.grad_accum={t.batch_size * t.grad_accum}: the same "
                                     "tokens per optimizer step, one sequence in the K/V store at a time"))
    # Activations are what the step allocates beyond the lasting holders; one chunk's worth.
    lasting = use.parameters + use.gradients + use.optimizer_state + use.master_weights + use.kv_store
    peak = use.cuda_peak_allocated if use.cuda_peak_allocated is not None else use.process_peak_rss
    activations = max(0, (peak or 0) - lasting)
    advice.append((activations, f"train.chunk_size={t.chunk_size}: one chunk's activations are alive at a time; "
                                f"halve it (a multiple of train.page_size={t.page_size}), the gradient stays exact"))
    if not t.layer_checkpointing:
        advice.append((activations, "train.layer_checkpointing=true: inside a chunk keep one layer's activations "
                                    "instead of every layer's (one more forward per chunk)"))
    if use.cuda_allocated is not None:  # the GPU ran out: what moves to host memory, what held the run back
        advice += _gpu_advice(use, cfg, activations, model)
    if use.master_weights:
        advice.append((use.master_weights, "train.master_weights=false: no fp32 copies of the 16-bit parameters "
                                           "(4 B each, and AdamW's moments in 16 bits again); updates below half "
                                           "a bf16 step of a weight are then rounded away"))
    if cfg.lora.r == 0:
        advice.append((use.optimizer_state + use.gradients,
                       "lora.r=16 (a new run): train adapters only; gradients and AdamW state shrink to the "
                       "adapters' size"))
    if use.cuda_reserved is not None and use.cuda_allocated is not None \
            and use.cuda_reserved - use.cuda_allocated > 2**30:
        advice.append((use.cuda_reserved - use.cuda_allocated,
                       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the caching allocator holds "
                       f"{_size(use.cuda_reserved - use.cuda_allocated)} it cannot reuse (fragmentation)"))
    advice.sort(key=lambda item: -item[0])
    return [text for _, text in advice]


def _gpu_advice(use: MemoryUse, cfg, activations: int, model) -> list[tuple[int, str]]:
    """(bytes it frees or gives, advice) for a GPU that ran out: offload, layer-host, and a train.gpu_memory cap."""
    t, advice = cfg.train, []
    if not t.offload:  # (the attention cache cannot stay on the GPU beside offload)
        keys = "train.offload=true" + (" train.cache_attention=host" if t.cache_attention is True else "")
        advice.append((use.kv_store, f"{keys}: the K/V pages and their gradients in pinned host memory, whole "
                                     "layers' pages kept on the GPU where they fit (the same gradients)"))
    if t.recompute == "chunk" and not t.layer_checkpointing and model is not None and _rebuilds_layers(model):
        advice.append((activations, "train.recompute=layer-host: every layer's input in host memory and one "
                                    "layer's activations on the GPU, not every layer's (the same gradients)"))
    cap = gpu_memory_cap(cfg)
    if cap is not None and use.cuda_total is not None and use.cuda_total > cap:
        advice.append((use.cuda_total - cap, f"train.gpu_memory={t.gpu_memory}: the run is held to it on a card of "
                                             f"{_size(use.cuda_total)}; raise it (or auto) where the card has room"))
    return advice


def _rebuilds_layers(model) -> bool:
    """Whether a step of ``model`` can recompute one layer at a time (one process, decoder layers it rebuilds)."""
    try:
        check_layer_recompute(unwrap_peft(model))
    except Exception:  # noqa: BLE001 - a stop's advice never fails the stop: not offered
        return False
    return True


# ---------------------------------------------------------------------------------- numerics


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def nonfinite_grads(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """(the first parameter, in the model's order, whose gradient holds a NaN or inf; where among the decoder layers
    the non-finite gradients start), None where none is. Backward runs from the last layer down and carries a NaN
    into every layer below, so the highest layer with one is where the backward pass went non-finite (in that
    layer, or in the input gradient the layer above passed down)."""
    first, bad, seen = None, set(), set()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        layer = _LAYER_INDEX.search(name)
        if layer is not None:
            seen.add(int(layer.group(1)))
        if not bool(torch.isfinite(p.grad).all()):  # host sync per parameter: the failure path only
            first = first or name
            if layer is not None:
                bad.add(int(layer.group(1)))
    if not bad:
        return first, None
    top = max(bad)
    above = (f"the input gradient layer {top + 1} passed down" if top < max(seen)
             else "what runs after the last layer (final norm, LM head, loss)")
    return first, (f"non-finite gradients in {len(bad)} of the {len(seen)} decoder layers with gradients, the highest "
                   f"layer {top} (backward runs from the last layer down: it went non-finite in layer {top}'s "
                   f"backward or in {above})")


def zero_embedding_starts(model: torch.nn.Module, batches) -> str | None:
    """The ids that begin a sequence or a document in ``batches`` whose input embedding row is all zeros (a padding
    id: transformers zeroes that row and never trains it), as the likely cause of a NaN in the backward pass; None
    where there are none. Such a token sees only itself, so its hidden state stays zero through every layer, and an
    RMSNorm's backward multiplies the gradient of a zero row by 1 / sqrt(eps): a deep model overflows."""
    weight = _local(model.get_input_embeddings().weight)
    starts = set()
    for batch in batches:
        ids = batch.input_ids
        docs = batch.doc_ids if batch.doc_ids is not None else torch.zeros_like(ids)
        first = torch.zeros_like(ids, dtype=torch.bool)
        first[:, 0] = True
        first[:, 1:] = docs[:, 1:] != docs[:, :-1]
        # only documents with a target: no gradient reaches one without (a packed batch's trailing padding)
        for row in range(ids.shape[0]):
            learned = docs[row][batch.labels[row] != -100].unique()
            starts.update(int(i) for i in ids[row][first[row] & torch.isin(docs[row], learned)].unique().tolist())
    rows = torch.tensor(sorted(i for i in starts if 0 <= i < weight.shape[0]), dtype=torch.long)
    if rows.numel() == 0:
        return None
    zero = rows[(weight[rows.to(weight.device)] == 0).all(dim=1).cpu()].tolist()
    if not zero:
        return None
    ids = ", ".join(str(i) for i in zero[:5])
    return (f"token id{'s' if len(zero) > 1 else ''} {ids} begin{'' if len(zero) > 1 else 's'} a sequence or a "
            f"document in this step and {'their' if len(zero) > 1 else 'its'} input embedding row is all zeros (a "
            "padding id?): such a token sees only itself, so its hidden state stays zero through every layer, and "
            "an RMSNorm's backward multiplies a zero row's gradient by 1 / sqrt(eps)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard (FSDP2, tensor parallel)


def nonfinite_after_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """The first parameter (or optimizer state) of this process that holds a NaN or inf after an update.

    One host sync per device when everything is finite: the max-abs of every tensor in one
    foreach call (a NaN or inf survives a max, and nothing finite overflows it), then one check.
    """
    names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if isinstance(optimizer, MasterWeights):
        for p, master in optimizer.pairs:
            names[id(master)] = f"{names.get(id(p), 'a parameter')} (its fp32 master)"
            named.append((names[id(master)], master))
    for p, state in optimizer.state.items():
        named += [(f"the optimizer's {key} of {names.get(id(p), 'a parameter')}", v) for key, v in state.items()
                  if isinstance(v, torch.Tensor) and v.is_floating_point()]
    by_device: dict[torch.device, list] = {}
    for name, t in named:
        t = _local(t).detach()
        if t.numel():
            by_device.setdefault(t.device, []).append((name, t))
    for group in by_device.values():
        peaks = torch._foreach_norm([t for _, t in group], float("inf"))
        if bool(torch.stack([p.float() for p in peaks]).isfinite().all()):  # host sync, once per device
            continue
        return next(name for (name, _), peak in zip(group, peaks, strict=True) if not bool(peak.isfinite()))
    return None
