"""The config keys described: (key, default, meaning) for `oomb train --list-keys`, docs/config.md and its test;
and the names other tools give them (oomb.train.config.other_names), for the hint an unknown key gets.

The meaning of a key is the docstring under its dataclass field in oomb/train/config/settings.py (attribute
docstrings, read from the source), so a key is documented where it is declared.
"""

from __future__ import annotations

import dataclasses

from oomb.train.config.other_names import OTHER_NAMES, other_tools_hint
from oomb.train.config.settings import Config

__all__ = ["OTHER_NAMES", "describe_keys", "other_tools_hint"]


def describe_keys() -> list[tuple[str, str, str]]:
    """(key, default, meaning) for every config key, for docs and --help."""
    rows = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                rows.append((f"{prefix}{f.name}", repr(value), _field_doc(type(obj), f.name)))

    walk(Config(), "")
    return rows


def _field_doc(cls, name: str) -> str:
    """The docstring under a dataclass field (attribute docstrings, read from the source)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                return str(nxt.value.value)
    return ""

