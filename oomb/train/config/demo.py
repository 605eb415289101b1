"""The built-in demo, `oomb train` with no arguments: the auto values that make it learn retrieval on a CPU.

The demo is the tiny preset (random init, no model.path) on the passkey task with data.seq_len left at auto.
Its auto values differ from any other run's::

    key                     the demo    any other run
    data.seq_len            256         4096
    train.batch_size        16          1
    data.passkey_digits     1           5
    data.loss_on            answer      auto (all; assistant for chat)

Giving data.seq_len (or another model or task) makes a plain run with the right-hand values; the
other keys of the demo can be changed one by one (``oomb train train.steps=300``).

Why (on a CPU): 60 steps of one 4096-token sequence with loss on every token lowered the loss on the
filler text only and retrieved 0 of 20 passkeys at 4096 tokens. On a CPU a 4096-token sequence costs
about 100 times a 256-token one, so the demo trains on many short sequences, with loss on the answer
only: the loss it prints is the retrieval it learns. The tiny model learns to copy
one digit in 70-120 such steps; which digits it tells apart first depends on the seed, and a run can stay on
a plateau where a few digits all come out as one (held-out: 100/100 for seeds 0, 2 and 4, 49 and 75 for
seeds 1 and 3; 200 steps, or 32 sequences a step, moved seeds 0, 1 and 3 both ways). A 5-digit passkey
needs a second mechanism (repeated digits make plain copying ambiguous) and had not formed after 400 steps
of 32 x 128 tokens; 2 and 3 digits were below 30% after 250 steps.
"""

from __future__ import annotations

AUTO = "auto"
DEMO_PRESET, DEMO_TASK = "tiny", "passkey"
# (section, key) -> (the demo's value, any other run's; None: left to the key's own auto rule)
SHAPE = {
    ("data", "seq_len"): (256, 4096),
    ("train", "batch_size"): (16, 1),
    ("data", "passkey_digits"): (1, 5),
    ("data", "loss_on"): ("answer", None),
}


def is_demo(cfg) -> bool:
    """The run is the built-in demo: the tiny preset on the passkey task, data.seq_len not given."""
    return (cfg.model.path is None and cfg.model.preset == DEMO_PRESET and cfg.data.task == DEMO_TASK
            and cfg.data.seq_len == AUTO)


def settle_shape(cfg) -> None:
    """Replace the auto values of data.seq_len, train.batch_size, data.passkey_digits (and data.loss_on for the
    demo) by numbers, in place. Called once the config file and overrides are read (load_config: these autos
    are defaults that depend on what is trained), and by check_config for a Config built in Python; other
    values are left for check_config to judge."""
    column = 0 if is_demo(cfg) else 1
    for (section, key), values in SHAPE.items():
        node = getattr(cfg, section)
        if getattr(node, key) == AUTO and values[column] is not None:
            setattr(node, key, values[column])


def demo_note(cfg) -> str | None:
    """The startup note of a run shaped as the demo (after settle_shape; also where its values were typed)."""
    if cfg.model.path is not None or cfg.model.preset != DEMO_PRESET or cfg.data.task != DEMO_TASK:
        return None
    if any(getattr(getattr(cfg, section), key) != values[0] for (section, key), values in SHAPE.items()):
        return None
    return (f"note: the built-in demo (oomb/train/config/demo.py): the tiny model learns to retrieve a "
            f"{cfg.data.passkey_digits}-digit passkey from {cfg.train.batch_size} sequences of {cfg.data.seq_len} "
            "tokens a step, loss on the answer only; the last line says how many held-out passkeys it retrieves")
