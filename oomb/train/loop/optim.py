"""Optimizers for `oomb train`: torch AdamW, or bitsandbytes' 8-bit AdamW for smaller states;
stepped on fp32 master copies of 16-bit parameters (train.master_weights).

Memory per trainable parameter for the two moments: adamw keeps them in the dtype of the
tensors it steps (2 x 2 bytes for bf16, 2 x 4 for fp32); adamw8bit keeps them as 8-bit blocks
with a float32 scale per 256 values (about 2 bytes in all). paged_adamw8bit keeps the same
8-bit states in CUDA unified memory, which the driver moves to host memory when the GPU runs
short. bitsandbytes quantizes tensors of 4096 values or more; smaller ones (norms, biases)
keep 32-bit states.

Master weights (``MasterWeights``): an update smaller than half a bf16 step of a weight is
rounded away when the optimizer steps bf16 parameters (lr 1e-4 on a norm weight near 1.0,
whose bf16 spacing is 2^-7, never changes it). With master weights the optimizer steps an
fp32 copy of each 16-bit trainable parameter and the parameter gets the copy rounded to
nearest after every step: 4 bytes per parameter for the copy, and adamw's moments are fp32
(8 bytes instead of 4).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from oomb.train.config.settings import ConfigError

OPTIMIZERS = {
    "adamw": "torch.optim.AdamW (states in the dtype of the tensors it steps)",
    "adamw8bit": "bitsandbytes AdamW8bit (8-bit states; CPU or CUDA)",
    "paged_adamw8bit": "bitsandbytes PagedAdamW8bit (8-bit states in CUDA unified memory; CUDA only)",
}
_CUDA_ONLY = {"paged_adamw8bit"}
HALF_DTYPES = (torch.bfloat16, torch.float16)
MASTER_WEIGHTS_KEY = "master_weights"  # in MasterWeights.state_dict(), beside the inner optimizer's keys


def check_optimizer(name: str, device: torch.device) -> None:
    """Refuse an unknown optimizer, a missing library, or a CUDA-only one off CUDA, before work starts."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer={name!r}: choose one of "
                          + "; ".join(f"{k}: {v}" for k, v in OPTIMIZERS.items()))
    if name in _CUDA_ONLY and device.type != "cuda":
        raise ConfigError(f"train.optimizer={name} pages its states through CUDA unified memory and needs a CUDA "
                          f"device (this run uses {device}); on CPU use adamw8bit or adamw")
    if name != "adamw":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"train.optimizer={name} needs the bitsandbytes package: "
                              "pip install bitsandbytes (or pip install 'oomb[lowmem]')") from e


def wants_master_weights(setting: bool | str, *, torchrun: bool) -> bool:
    """train.master_weights -> whether 16-bit trainable parameters get fp32 masters (fp32 ones need none).

    auto: yes in one process, no under torchrun; true: yes, refused under torchrun (DDP, FSDP2 and
    tensor parallel step their parameters directly for now); false: no.
    """
    if not (setting is True or setting is False or setting == "auto"):
        raise ConfigError(f"train.master_weights={setting!r}: use auto (fp32 master copies of 16-bit parameters "
                          "in one process), true or false")
    if torchrun and setting is True:
        raise ConfigError("train.master_weights=true under torchrun: fp32 master weights are single-process only "
                          "for now (data and tensor parallel runs step their parameters directly); use "
                          "train.master_weights=auto (off under torchrun) or false")
    return setting is True or (setting == "auto" and not torchrun)


def build_optimizer(name: str, params, *, lr: float, weight_decay: float,
                    master_weights: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` (tensors or param-group dicts).

    ``master_weights``: wrap it in MasterWeights when a parameter is 16-bit; with fp32
    parameters only (a CPU run, LoRA adapters) there is nothing to keep a copy of and the
    plain optimizer is returned.
    """
    def build(groups) -> torch.optim.Optimizer:
        if name == "adamw":
            return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
        import bitsandbytes as bnb

        cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
        return cls(groups, lr=lr, weight_decay=weight_decay)

    groups = _as_groups(params)
    if master_weights and any(p.dtype in HALF_DTYPES for g in groups for p in g["params"]):
        return MasterWeights(groups, build)
    return build(groups)


def _as_groups(params) -> list[dict]:
    params = list(params)
    return params if params and isinstance(params[0], dict) else [{"params": params}]


class MasterWeights(torch.optim.Optimizer):
    """An optimizer (``build(groups)``) that steps fp32 master copies of the 16-bit parameters.

        step():  master.grad = float32(p.grad), p.grad freed  ->  inner.step() on the masters
                 ->  p = round_to_nearest(master)

    Each 16-bit parameter gets an fp32 master on its device; fp32 parameters are stepped as
    they are (their own master). A parameter without a gradient is skipped, as AdamW does.
    Gradient clipping happens on the parameters' gradients before ``step`` (the fp32 copy of
    a clipped gradient is the clipped gradient); a step that is not taken (a skipped
    non-finite step) leaves the masters as they are.

    The inner optimizer owns the param groups and the state, and this wrapper shows them
    (LambdaLR sets each group's lr on the inner optimizer). Optimizer.__init__ is not called
    on purpose: the inner optimizer holds the groups, state and hooks.

    ``state_dict()`` is the inner optimizer's with ``"master_weights"``: {index: fp32 tensor},
    indexed like its ``"state"`` (the inner parameters in group order): plain tensors, loadable
    with weights_only. ``load_state_dict`` of a state without masters (written by a run without
    them) starts the masters from the parameters, into which the checkpoint's weights were
    loaded first.
    """

    def __init__(self, params, build: Callable[[list[dict]], torch.optim.Optimizer]) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (16-bit parameter, its fp32 master)
        inner_groups = []
        for group in _as_groups(params):
            stepped = []
            for p in group["params"]:
                if p.dtype in HALF_DTYPES:
                    master = p.detach().to(torch.float32)
                    self.pairs.append((p, master))
                    stepped.append(master)
                else:
                    stepped.append(p)
            inner_groups.append({**group, "params": stepped})
        self.inner = build(inner_groups)
        self.defaults = self.inner.defaults

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self):
        return self.inner.state

    @property
    def masters(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeights.step takes no closure")
        stepped = []
        for p, master in self.pairs:
            if p.grad is None:
                continue
            # The 16-bit gradient is freed as its fp32 copy is made: +2 B per bf16 parameter during the step.
            master.grad = p.grad.to(torch.float32)
            p.grad = None
            stepped.append((p, master))
        self.inner.step()
        if stepped:
            torch._foreach_copy_([p for p, _ in stepped], [m for _, m in stepped])  # round to nearest
        for _, master in stepped:
            master.grad = None
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)  # the masters' gradients and those of fp32 parameters
        for p, _ in self.pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _master_index(self) -> dict[int, torch.Tensor]:
        index = {id(t): i for i, t in enumerate(t for g in self.inner.param_groups for t in g["params"])}
        return {index[id(m)]: m for _, m in self.pairs}

    def state_dict(self) -> dict:
        state = self.inner.state_dict()
        state[MASTER_WEIGHTS_KEY] = self._master_index()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTER_WEIGHTS_KEY, None)
        self.inner.load_state_dict(state_dict)  # moments saved from 16-bit parameters are cast to fp32
        with torch.no_grad():
            if saved is None:  # a state without masters: start them from the (loaded) parameters
                for p, master in self.pairs:
                    master.copy_(p)
                return
            masters = self._master_index()
            if saved.keys() != masters.keys():
                raise ValueError(f"the saved master weights are for parameters {sorted(saved)[:8]}, this optimizer "
                                 f"has masters for {sorted(masters)[:8]}: not the same model or settings")
            for i, master in masters.items():
                if saved[i].shape != master.shape:
                    raise ValueError(f"saved master weight {i} has shape {tuple(saved[i].shape)}, "
                                     f"the parameter {tuple(master.shape)}")
                master.copy_(saved[i])

    def __repr__(self) -> str:
        return f"MasterWeights({self.inner!r})"
