"""YAML as config files and overrides are read and written: YAML 1.2's numbers, no duplicate keys, and
escapes for what YAML cannot hold raw (oomb/train/config.py reads and writes through these)."""

from __future__ import annotations

import re

import yaml

__all__ = ["ConfigLoader", "yaml_escaped"]

# Outside YAML's printable set, or a line break inside a quoted scalar (NEL, LS, PS).
_YAML_RAW_UNSAFE = re.compile("[^\x09\x0a\x0d\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]"
                              "|[\x85\u2028\u2029]")


def _yaml_escape(char: str) -> str:
    return f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}"


def yaml_escaped(text: str) -> str:
    """``text`` (JSON) with every character YAML cannot hold raw written as an escape."""
    return _YAML_RAW_UNSAFE.sub(lambda m: _yaml_escape(m.group()), text)


class ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader with YAML 1.2's numbers and without duplicate keys.

    PyYAML follows YAML 1.1, where ``2e-05`` and ``3e-4`` (no dot) are strings, not floats:
    a learning rate written as Python or JSON writes it would be refused as "not a float".
    A key given twice in one mapping is an error, not a silent "the last one wins".
    """

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found the key {key!r} twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_YAML12_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
ConfigLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _first, _resolvers in ConfigLoader.yaml_implicit_resolvers.items():
    _resolvers[:] = [(tag, regexp) for tag, regexp in _resolvers if tag != "tag:yaml.org,2002:float"]
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
