"""The learning-rate schedule of `oomb train`: transformers' schedules, their warmup and length, and the auto values.

    train.lr_scheduler       a name of transformers.get_scheduler (cosine_with_min_lr by default)
    train.warmup_steps       steps of linear warmup from 0, or auto; train.warmup_ratio: a fraction of the steps
    train.steps              optimizer steps, or train.epochs: passes over the data, counted at startup

``build_scheduler`` makes the schedule with ``transformers.get_scheduler``, the one TrainingArguments'
lr_scheduler_type picks, so a step's rate is transformers' rate at that step (warmup starts at 0). Its state
(a LambdaLR's step count and peak rates) is what a checkpoint keeps; after a resume ``continue_schedule`` sets the
rates of this run's schedule at that step, with this run's train.lr as the peak. A checkpoint written before these
schedules (a hand-written cosine warmed up from 1/(warmup+1) of the peak) resumes on them: its state is the same
kind, and after the warmup the rates are the same.

train.lr=auto and train.warmup_steps=auto: the peak learning rate and warmup chosen for what a run trains.

    model.path, lora.r=0        full fine-tune of a pretrained model    lr 1e-5, warmup 3% of train.steps
    model.path, lora.r>0        LoRA on a pretrained model              lr 2e-4, warmup 3% of train.steps
    model.preset=tiny           the built-in toy model                  lr 3e-3, warmup 5 (the README's main job)
    any other model.preset      random init                             lr 3e-4 (LoRA: 2e-4), warmup 3% of train.steps

``resolve_schedule`` writes the numbers into the config before the run folder's config.json is
written, so that file (and a resume, which starts from it) holds the values the run started with.
An explicit value always wins. With train.warmup_ratio, train.warmup_steps stays auto (the ratio is recorded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from oomb.train.config.settings import Config, ConfigError, TrainConfig

AUTO = "auto"
# train.lr_scheduler: transformers.get_scheduler's names that need nothing but the warmup and the steps.
SCHEDULES = {
    "cosine_with_min_lr": "warmup, then a half cosine down to train.min_lr_ratio of the peak",
    "linear": "warmup, then a straight line down to 0 at the last step",
    "cosine": "warmup, then a half cosine down to 0",
    "cosine_warmup_with_min_lr": "cosine_with_min_lr whose warmup starts at 1/warmup of the peak and whose decay "
                                 "is a step ahead",
    "cosine_with_restarts": "cosine (one cycle: transformers' default)",
    "polynomial": "warmup, then a straight line down to 1e-7 (power 1: transformers' default)",
    "constant": "the peak from the first step (no warmup)",
    "constant_with_warmup": "warmup, then the peak",
    "inverse_sqrt": "warmup, then the peak x sqrt(warmup / step)",
}
DEFAULT_SCHEDULE = "cosine_with_min_lr"
MIN_LR_SCHEDULES = ("cosine_with_min_lr", "cosine_warmup_with_min_lr")  # those that take train.min_lr_ratio
NO_WARMUP = ("constant",)
_REFUSED = {  # get_scheduler's other names, and why
    "reduce_lr_on_plateau": "it follows a validation metric from step to step, which oomb does not feed it",
    "warmup_stable_decay": "it needs its decay length (transformers' lr_scheduler_kwargs), which oomb does not take",
    "greedy": "it follows the training loss from step to step, which oomb does not feed it",
}
DEFAULT_MIN_LR_RATIO = next(f.default for f in fields(TrainConfig) if f.name == "min_lr_ratio")

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
    """train.lr and the warmup as numbers (auto ones resolved, cfg unchanged); refuses other words, an unknown
    schedule, warmup given twice or to a schedule without one, train.min_lr_ratio for a schedule that does not use
    it, and train.epochs where the data has no pass to count."""
    t = cfg.train
    for key, value in (("lr", t.lr), ("warmup_steps", t.warmup_steps)):
        if isinstance(value, str) and value != AUTO:
            kind = "a number in (0, 1], e.g. 1e-5" if key == "lr" else "a number of steps, e.g. 20"
            raise ConfigError(f"train.{key}={value!r}: use auto (chosen for what is trained: docs/config.md) or {kind}")
    name = t.lr_scheduler
    if name not in SCHEDULES:
        why = f"{_REFUSED[name]}; " if name in _REFUSED else ""
        raise ConfigError(f"train.lr_scheduler={name!r}: {why}choose one of {', '.join(SCHEDULES)} (transformers' "
                          "get_scheduler names)")
    if t.warmup_ratio is not None:
        if not 0 <= t.warmup_ratio <= 1:
            raise ConfigError(f"train.warmup_ratio={t.warmup_ratio:g} must be in [0, 1]: a fraction of train.steps")
        if t.warmup_steps != AUTO:
            raise ConfigError(f"train.warmup_steps={t.warmup_steps} and train.warmup_ratio={t.warmup_ratio:g} both "
                              "set the warmup: give one of them")
    if name in NO_WARMUP and (t.warmup_steps not in (AUTO, 0) or t.warmup_ratio):
        raise ConfigError(f"train.lr_scheduler={name} has no warmup (transformers' {name} schedule): use "
                          f"{name}_with_warmup, or leave train.warmup_steps and train.warmup_ratio unset")
    if t.min_lr_ratio != DEFAULT_MIN_LR_RATIO and name not in MIN_LR_SCHEDULES:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio:g} is used by {' and '.join(MIN_LR_SCHEDULES)} only, "
                          f"not train.lr_scheduler={name}: leave it at {DEFAULT_MIN_LR_RATIO:g} or choose one of them")
    if t.epochs is not None:
        if not t.epochs > 0:
            raise ConfigError(f"train.epochs={t.epochs:g} must be > 0 (passes over the training data)")
        if cfg.data.task not in ("text", "chat"):
            raise ConfigError(f"train.epochs: data.task={cfg.data.task} draws new sequences every step, with no pass "
                              "over the data to count; set train.steps instead")
    lr = auto_schedule(cfg).lr if t.lr == AUTO else t.lr
    warmup = warmup_steps(cfg)
    if 0 < lr <= 1 and warmup >= 0:  # other values: check_config says what the range is
        _check_transformers_takes(cfg, lr)
    return lr, warmup


def warmup_steps(cfg: Config) -> int:
    """The warmup of this run's schedule in steps: train.warmup_steps, train.warmup_ratio of the steps (rounded up,
    as transformers' TrainingArguments.get_warmup_steps), or the auto rule; none for a schedule without warmup."""
    t = cfg.train
    if t.warmup_steps != AUTO:
        return t.warmup_steps
    if t.lr_scheduler in NO_WARMUP:
        return 0
    if t.warmup_ratio is not None:
        return math.ceil(t.warmup_ratio * t.steps)
    return auto_schedule(cfg).warmup_steps


def resolve_schedule(cfg: Config, inputs, ctx) -> str:
    """Settle train.epochs (into train.steps, counting the data: ``inputs``, the run's), train.lr and
    train.warmup_steps=auto in cfg; returns what the startup line says of them, e.g. "lr 1e-05 (auto: full
    fine-tune of a pretrained model), warmup 2 (auto: 3% of 60 steps), schedule cosine_with_min_lr to 0.1x"."""
    t = cfg.train
    length = f"{_settle_epochs(cfg, inputs, ctx)}, " if t.epochs is not None else ""
    lr, warmup = check_schedule_values(cfg)
    why = auto_schedule(cfg).why
    lr_text = f"lr {lr:g}" + (f" (auto: {why})" if t.lr == AUTO else "")
    if t.warmup_steps != AUTO:
        warmup_why = ""
    elif t.warmup_ratio is not None:
        warmup_why = f" (train.warmup_ratio={t.warmup_ratio:g} of {t.steps} steps)"
    elif t.lr_scheduler in NO_WARMUP:
        warmup_why = f" ({t.lr_scheduler} has none)"
    else:
        rule = f"{why}'s" if why.startswith("the built-in") else f"{WARMUP_RATIO:.0%} of {t.steps} steps"
        warmup_why = f" (auto: {rule})"
    schedule = f"schedule {t.lr_scheduler}" + (f" to {t.min_lr_ratio:g}x" if t.lr_scheduler in MIN_LR_SCHEDULES else "")
    t.lr = lr
    if t.warmup_ratio is None:
        t.warmup_steps = warmup
    return f"{length}{lr_text}, warmup {warmup}{warmup_why}, {schedule}"


def build_scheduler(cfg: Config, optimizer):
    """transformers.get_scheduler's schedule for this run (a torch LambdaLR), over ``optimizer`` built at train.lr."""
    from transformers import get_scheduler

    t = cfg.train
    extra = {"min_lr_rate": t.min_lr_ratio} if t.lr_scheduler in MIN_LR_SCHEDULES else None
    return get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=warmup_steps(cfg), num_training_steps=t.steps,
                         scheduler_specific_kwargs=extra)


def _check_transformers_takes(cfg: Config, lr: float) -> None:
    """Build the schedule over a throwaway optimizer: what transformers refuses (polynomial below its end rate) is
    said before any work."""
    import torch

    try:
        build_scheduler(cfg, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"train.lr_scheduler={cfg.train.lr_scheduler} with train.lr={lr:g}: transformers refuses "
                          f"it: {e}") from None


def continue_schedule(scheduler, lr: float) -> float | None:
    """After a resume loaded the scheduler's state (the step it is at and the peak rates it was saved with): this
    run's schedule at that step, with train.lr as its peak, sets the optimizer's rates (those the optimizer state
    held were the saved run's). Public LambdaLR state only: the step is taken again. Returns the peak rate it
    replaced, or None where it is the same."""
    saved = list(scheduler.base_lrs)
    scheduler.base_lrs = [lr] * len(saved)
    for group in scheduler.optimizer.param_groups:
        group["initial_lr"] = lr
    scheduler.last_epoch -= 1
    steps_taken = scheduler._step_count  # what the checkpoint holds: taking the step again must not count it
    scheduler.step()  # last_epoch back to the checkpoint's; every group's lr from this run's lambdas
    scheduler._step_count = steps_taken
    return None if all(b == lr for b in saved) else saved[0]


# --- train.epochs ---------------------------------------------------------------------------------------------


def keep_started_steps(cfg: Config) -> None:
    """A resume with train.epochs as the run started with: train.steps as that run worked them out (its
    config.json), so the checks before any work (a checkpoint after the last step) count the run's steps."""
    if cfg.train.epochs is None:
        return
    started, _ = _started(cfg)
    if started is not None and started.epochs == cfg.train.epochs:
        cfg.train.steps = started.steps


def _started(cfg: Config):
    """The train settings a resumed run started with and the checkpoint it resumes from; (None, None) for a new run
    or a run folder that cannot be read (check_paths says why)."""
    if cfg.resume is None:
        return None, None
    from oomb.train.config.settings import load_config
    from oomb.train.runfolder.rundir import CONFIG, resume_target

    try:
        run, ckpt = resume_target(cfg)
        return load_config(run / CONFIG).train, ckpt
    except ConfigError:
        return None, None


def _settle_epochs(cfg: Config, inputs, ctx) -> str:
    """train.steps from train.epochs: epochs x the packed sequences of one pass / the sequences of a step, rounded
    up (a resume with the epochs the run started with keeps its steps); what the startup line says of it."""
    t = cfg.train
    started, ckpt = _started(cfg)
    if started is not None and started.epochs == t.epochs:
        t.steps = started.steps
        return f"{t.epochs:g} epochs = {t.steps} steps (as the run started)"
    sequences = sequences_per_pass(inputs, ctx)
    per_step = t.batch_size * t.grad_accum
    t.steps = max(1, math.ceil(t.epochs * sequences / per_step))
    if ckpt is not None:
        from oomb.train.runfolder.checkpoint import checkpoint_state

        done = checkpoint_state(ckpt)["step"]
        if done > t.steps:
            raise ConfigError(f"resume={cfg.resume!r}: {ckpt} is after step {done}, past the {t.steps} steps of "
                              f"train.epochs={t.epochs:g}; give more epochs to train on")
    ranks = " on each rank" if ctx.torchrun else ""
    return f"{t.epochs:g} epochs = {t.steps} steps ({sequences:,} packed sequences a pass{ranks}, {per_step} a step)"


def sequences_per_pass(inputs, ctx) -> int:
    """The packed sequences one pass over the run's training data fills (the last one partly), counted by packing
    it once from the start (text is tokenized, a chat sample rendered); the most of any rank under torchrun.
    Refused for the built-in tasks (no data to pass over) and for streamed datasets (unknown until read whole)."""
    from oomb.train.data.corpus import DataError

    corpus = getattr(inputs, "corpus", None)
    if corpus is None:
        raise ConfigError("train.epochs needs data that a run passes over (data.task=text or chat); set train.steps")
    streamed = [source.name for source in corpus.sources if source.kind == "stream"]
    if streamed:
        raise ConfigError(f"train.epochs: data.paths streams {streamed[0]}, and how many sequences one pass over a "
                          "stream packs is known only once all of it is read; set train.steps instead (or give the "
                          "data as files or a save_to_disk folder)")
    kept, start = dict(vars(corpus)), corpus.state_dict()
    count = 0
    try:
        while True:
            corpus.next_sequence()
            count += 1
            corpus.rows.current()  # moves past the pass's last row: its epoch says whether a pass is done
            if corpus.rows.epoch > 0:
                break
    except DataError as e:
        raise ConfigError(f"data.paths: {e}") from e
    finally:
        vars(corpus).update(kept)
        corpus.load_state_dict(start)  # the run starts reading where it would have without the count
    from oomb.train.loop import distributed

    return distributed.most_over_ranks(ctx, count)
