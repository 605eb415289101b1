"""YAML as config files and overrides are read and written: YAML 1.2's numbers, no duplicate keys, no aliases,
nesting at most MAX_DEPTH deep, errors in one line, and escapes for what YAML cannot hold raw
(oomb/train/config/settings.py reads and writes through these)."""

from __future__ import annotations

import re

import yaml

from oomb.train.config.bounded import MAX_DEPTH, QUOTE_CHARS, one_line, quoted

__all__ = ["ConfigLoader", "Refused", "yaml_escaped", "yaml_problem"]

# Outside YAML's printable set, or a line break inside a quoted scalar (NEL, LS, PS).
_YAML_RAW_UNSAFE = re.compile("[^\x09\x0a\x0d\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]"
                              "|[\x85\u2028\u2029]")


def _yaml_escape(char: str) -> str:
    return f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}"


def yaml_escaped(text: str) -> str:
    """``text`` (JSON) with every character YAML cannot hold raw written as an escape."""
    return _YAML_RAW_UNSAFE.sub(lambda m: _yaml_escape(m.group()), text)


class Refused(yaml.composer.ComposerError):
    """YAML that config files may not hold: an alias, or values nested deeper than MAX_DEPTH."""


class ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader with YAML 1.2's numbers, without duplicate keys or aliases, nested at most MAX_DEPTH deep.

    PyYAML follows YAML 1.1, where ``2e-05`` and ``3e-4`` (no dot) are strings, not floats:
    a learning rate written as Python or JSON writes it would be refused as "not a float".
    A key given twice in one mapping is an error, not a silent "the last one wins". An alias
    (``*name``, and so ``<<: *name``) is refused where it is read, before anything is built: a
    few nested ones stand for gigabytes ("billion laughs"), and a run's config has no value worth
    repeating. PyYAML composes nested values by recursion: deeper than MAX_DEPTH is refused first.
    """

    _depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise Refused(None, None, f"found the alias *{one_line(event.anchor, QUOTE_CHARS)}: config files take "
                          "no YAML aliases (*name, <<: *name); write the value out", event.start_mark)
        if self._depth >= MAX_DEPTH:
            raise Refused(None, None, f"values nested more than {MAX_DEPTH} levels deep", event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found the key {quoted(key)} twice",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong, where, and the part of that line of input around it."""
    mark = getattr(error, "problem_mark", None)
    problem = one_line(str(getattr(error, "problem", None) or error), 2 * QUOTE_CHARS)
    if mark is None:
        return problem
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    if mark.buffer is None:
        return f"{problem} ({where})"
    start = mark.buffer.rfind("\n", 0, mark.pointer) + 1
    end = mark.buffer.find("\n", mark.pointer)
    line = mark.buffer[start:end if end >= 0 else len(mark.buffer)].rstrip("\0")
    first = max(0, min(mark.column - QUOTE_CHARS // 2, len(line) - QUOTE_CHARS))  # the problem's column in view
    shown = ("…" if first else "") + line[first:first + QUOTE_CHARS] + ("…" if first + QUOTE_CHARS < len(line) else "")
    return f"{problem} ({where}: {shown.strip()})"


_YAML12_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
ConfigLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _first, _resolvers in ConfigLoader.yaml_implicit_resolvers.items():
    _resolvers[:] = [(tag, regexp) for tag, regexp in _resolvers if tag != "tag:yaml.org,2002:float"]
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
