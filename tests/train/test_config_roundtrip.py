"""Every config value round-trips exactly: through config.json (what a run writes and resume/eval read)
and through `key=value` overrides (what users type and what oomb's printed commands hold)."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomb.train.config.settings import (
    Config,
    ConfigError,
    config_json,
    config_to_dict,
    load_config,
    override_text,
)


def _leaves(obj=None, prefix=""):
    """(dotted key, type hint) of every config value."""
    obj = obj or Config()
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", hints[f.name]


# Floats a user writes: tiny learning rates (1e-5 reads as a string in YAML 1.1), huge and exact values.
finite_floats = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [2e-5, 3e-4, 1e-4, 5e-324, 1.7976931348623157e308, 0.1, 1.0, -0.0])
# Text that looks like other YAML types must stay text.
texts = st.text(max_size=30) | st.sampled_from(["1e5", "true", "null", "no", "on", "0x10", "1:20", "~", "[a]",
                                                "a: b", "#x", "'q'", '"q"', "  pad  ", "2024", ".inf"])


def _strategy(hint):
    allowed = typing.get_args(hint) if isinstance(hint, typing.types.UnionType) else (hint,)
    options = []
    for t in allowed:
        if t is type(None):
            options.append(st.none())
        elif t is bool:
            options.append(st.booleans())
        elif t is int:
            options.append(st.integers(min_value=-(2**70), max_value=2**70))
        elif t is float:
            options.append(finite_floats)
        elif t is str:
            options.append(texts)
        elif typing.get_origin(t) is list:
            options.append(st.lists(texts, max_size=3))
        else:
            raise AssertionError(f"no strategy for {t}")
    return st.one_of(options)


configs = st.fixed_dictionaries({key: _strategy(hint) for key, hint in _leaves()})


def _as_config(values: dict) -> Config:
    cfg = Config()
    for key, value in values.items():
        *path, name = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, name, value)
    return cfg


def _same(a, b) -> bool:
    """Equal, with floats compared bit for bit (-0.0 is not 0.0)."""
    if isinstance(a, float) and isinstance(b, float):
        return a.hex() == b.hex()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_every_value_round_trips_through_config_json(tmp_path_factory, values):
    cfg = _as_config(values)
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(config_json(cfg))
    assert _same(config_to_dict(load_config(path)), config_to_dict(cfg))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_every_value_round_trips_through_key_value_overrides(values):
    if values["train.epochs"] is not None:  # a command line that sets both is refused: epochs stand for the steps
        values = {**values, "train.steps": Config().train.steps}
    cfg = _as_config(values)
    overrides = [override_text(key, value) for key, value in values.items()
                 if not (key == "train.steps" and values["train.epochs"] is not None)]
    assert _same(config_to_dict(load_config(None, overrides)), config_to_dict(cfg))


@pytest.mark.parametrize("typed,expected", [
    ("train.lr=3e-4", 3e-4), ("train.lr=2e-05", 2e-5), ("train.lr=1E-5", 1e-5), ("train.lr=.5", 0.5),
    ("train.lr=1", 1.0), ("train.lr=+1e-3", 1e-3),
])
def test_learning_rates_as_users_and_json_write_them_are_floats(typed, expected):
    assert load_config(None, [typed]).train.lr == expected


@pytest.mark.parametrize("typed,expected", [
    ("out_dir=2024", "2024"), ("model.preset=no", "no"), ("lora.targets=on", "on"), ("out_dir=1e5", "1e5"),
])
def test_a_name_typed_on_the_command_line_stays_as_typed(typed, expected):
    key = typed.partition("=")[0]
    section, _, name = key.rpartition(".")
    cfg = load_config(None, [typed])
    assert getattr(getattr(cfg, section) if section else cfg, name) == expected


@pytest.mark.parametrize("typed", ["train.lr=.inf", "train.lr=-.inf", "train.lr=.nan", "train.lr=1e400",
                                   "train.grad_clip=.nan", "data.depth=.inf", "lora.alpha=-.inf"])
def test_non_finite_numbers_are_refused_when_read(typed):
    with pytest.raises(ConfigError, match="must be a finite number"):
        load_config(None, [typed])


def test_a_config_json_with_infinity_is_refused_not_crashed(tmp_path):
    data = config_to_dict(Config())
    data["train"]["lr"] = float("inf")
    (tmp_path / "config.json").write_text(json.dumps(data))  # Python writes Infinity; oomb never does
    with pytest.raises(ConfigError, match="train.lr .* must be a finite number"):
        load_config(tmp_path / "config.json")


def test_oomb_never_writes_a_non_finite_number(tmp_path):
    cfg = Config()
    cfg.train.lr = float("nan")
    with pytest.raises(ValueError):
        config_json(cfg)


def test_a_printed_resume_command_reads_back(tmp_path):
    """The commands oomb prints (resume_command with train.lr=...) parse with the value they show."""
    from oomb.train.loop.faults import resume_command

    command = resume_command(tmp_path, f"train.lr={2e-05 / 2:g}")
    override = command.split()[-1].strip("'")
    assert load_config(None, [override]).train.lr == 1e-05
