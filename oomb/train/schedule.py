"""train.lr=auto and train.warmup_steps=auto: the peak learning rate and warmup chosen for what a run trains.

    model.path, lora.r=0        full fine-tune of a pretrained model    lr 1e-5, warmup 3% of train.steps
    model.path, lora.r>0        LoRA on a pretrained model              lr 2e-4, warmup 3% of train.steps
    model.preset=tiny           the built-in toy model                  lr 3e-3, warmup 5 (the README's main job)
    any other model.preset      random init                             lr 3e-4 (LoRA: 2e-4), warmup 3% of train.steps

``resolve_schedule`` writes the numbers into the config before the run folder's config.json is
written, so that file (and a resume, which starts from it) holds the values the run started with.
An explicit value always wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from oomb.train.config import Config, ConfigError

AUTO = "auto"

# Peak learning rates of common recipes, by what is trained.
# - Full fine-tuning of a pretrained model: 1e-5 to 2e-5. Stanford Alpaca (LLaMA-7B) and TRL's SFTConfig
#   default use 2e-5; the context-extension papers fine-tune 7B/13B models at 2e-5 and 33B-70B ones at
#   1e-5 (Position Interpolation, Chen et al. 2023; YaRN, Peng et al. 2023; LongLoRA, Chen et al. 2023).
#   We take the lower end: a step here is often one long sequence, a small batch for full fine-tuning.
FULL_FINE_TUNE_LR = 1e-5
# - LoRA adapters: 2e-4, the QLoRA paper's rate for 7B/13B models (1e-4 above) and Unsloth's default;
#   adapters start at zero and need a larger rate than the weights they adapt.
LORA_LR = 2e-4
# - Random init: 3e-4, the peak rate Llama 2 and Llama 3 were pretrained with at 7B/8B. The tiny preset's
#   3e-3 made the random-init Qwen2.5-7B preset diverge on the H200 (loss 12.66 -> 7.05 -> 19.63 in three
#   steps), so the toy rate stays with the toy model.
RANDOM_INIT_LR = 3e-4
# Warmup: 3% of the steps, the warmup_ratio of Alpaca's and QLoRA's recipes (the context-extension papers warm
# up 20 of 400-1000 steps, 2-5%); at least one step.
WARMUP_RATIO = 0.03
# The built-in toy model (model.preset=tiny, the README's main job: passkey on CPU in a few minutes) keeps the
# values it was tuned with.
TOY_PRESET, TOY_LR, TOY_WARMUP = "tiny", 3e-3, 5


@dataclass(frozen=True)
class AutoSchedule:
    """What train.lr=auto and train.warmup_steps=auto mean for a run, and why."""

    lr: float
    warmup_steps: int
    why: str  # what is trained, as the startup line says it


def auto_schedule(cfg: Config) -> AutoSchedule:
    """The auto values for this run's model and training kind (independent of the values set)."""
    if cfg.model.path is not None:
        lora = cfg.lora.r > 0
        return AutoSchedule(LORA_LR if lora else FULL_FINE_TUNE_LR, _warmup(cfg),
                            "LoRA on a pretrained model" if lora else "full fine-tune of a pretrained model")
    if cfg.model.preset == TOY_PRESET:
        return AutoSchedule(TOY_LR, TOY_WARMUP, f"the built-in {TOY_PRESET} model")
    return AutoSchedule(LORA_LR if cfg.lora.r > 0 else RANDOM_INIT_LR, _warmup(cfg),
                        f"{'LoRA on ' if cfg.lora.r > 0 else ''}a random-init {cfg.model.preset} model")


def _warmup(cfg: Config) -> int:
    return max(1, math.ceil(WARMUP_RATIO * cfg.train.steps))


def check_schedule_values(cfg: Config) -> tuple[float, int]:
    """train.lr and train.warmup_steps as numbers (auto ones resolved, cfg unchanged); refuses other words."""
    t = cfg.train
    for key, value in (("lr", t.lr), ("warmup_steps", t.warmup_steps)):
        if isinstance(value, str) and value != AUTO:
            kind = "a number in (0, 1], e.g. 1e-5" if key == "lr" else "a number of steps, e.g. 20"
            raise ConfigError(f"train.{key}={value!r}: use auto (chosen for what is trained: docs/config.md) or {kind}")
    auto = auto_schedule(cfg) if AUTO in (t.lr, t.warmup_steps) else None
    return (auto.lr if t.lr == AUTO else t.lr), (auto.warmup_steps if t.warmup_steps == AUTO else t.warmup_steps)


def resolve_schedule(cfg: Config) -> str:
    """Settle train.lr and train.warmup_steps=auto in cfg; returns what the startup line says of them,
    e.g. "lr 1e-05 (auto: full fine-tune of a pretrained model), warmup 2 (auto: 3% of 60 steps)"."""
    t = cfg.train
    lr, warmup = check_schedule_values(cfg)
    why = auto_schedule(cfg).why
    lr_text = f"lr {lr:g}" + (f" (auto: {why})" if t.lr == AUTO else "")
    warmup_why = (f"{why}'s" if why.startswith("the built-in") else f"{WARMUP_RATIO:.0%} of {t.steps} steps")
    warmup_text = f"warmup {warmup}" + (f" (auto: {warmup_why})" if t.warmup_steps == AUTO else "")
    t.lr, t.warmup_steps = lr, warmup
    return f"{lr_text}, {warmup_text}"
