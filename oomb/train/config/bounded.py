"""Untrusted text read within bounds, and messages that quote at most one line of it.

Config files, data rows, a run folder's config.json, a checkpoint's manifest.json and state.json and a
model folder's config.json may come from anyone. Read as they are, a few bytes can cost without bound:
Python's json module recurses once per level of nesting (``[[[[...`` 100K deep is a RecursionError), a
YAML alias repeats a value without writing it again (a "billion laughs" file of a few hundred bytes stands
for gigabytes), and a message that quotes such a value prints all of it. So::

    MAX_DEPTH          arrays/objects (JSON) or sequences/mappings (YAML) nested deeper are refused before
                       they are parsed: real configs nest 3 deep, chat rows 5-10 (tool calls' arguments)
    MAX_CONFIG_BYTES   a config file larger than this is refused before it is read (YAML parses at about
                       1 MiB a second in Python; a config is a few KiB)
    MAX_JSON_BYTES     the same for the JSON files oomb reads whole (config.json, manifest.json, state.json,
                       a model's config.json and weight index), far above what oomb writes
    quoted / one_line  a value or a line of input as a message shows it: one line, at most QUOTE_CHARS
                       characters, an ellipsis where it was cut

YAML aliases are refused outright in config files (oomb.train.config.yaml_text): a run's config has no value
worth repeating, and without aliases a document is no larger than its text.
"""

from __future__ import annotations

import json
import re
import reprlib
from pathlib import Path

__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_JSON_BYTES", "QUOTE_CHARS", "TooDeep", "TooLarge", "loads_json",
           "one_line", "quoted", "read_capped", "read_json"]

MAX_DEPTH = 100
MAX_CONFIG_BYTES = 1 << 20
MAX_JSON_BYTES = 16 << 20
QUOTE_CHARS = 80

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string, escapes and all
_BRACKET = re.compile(r"[\[\]{}]")


class TooDeep(ValueError):
    """JSON or YAML nested deeper than MAX_DEPTH."""

    def __init__(self, what: str = "JSON") -> None:
        super().__init__(f"{what} nested more than {MAX_DEPTH} levels deep (arrays and objects inside one another) "
                         "is refused before it is parsed")


class TooLarge(ValueError):
    """A file larger than the bound its reader sets."""


def _too_deep(text: str) -> bool:
    """Whether the brackets of JSON ``text`` outside its strings nest deeper than MAX_DEPTH."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:  # C-speed counts: almost every row stops here
        return False
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > MAX_DEPTH:
            return True
    return False


def loads_json(data: str | bytes, **kwargs):
    """``json.loads`` that refuses (TooDeep, a ValueError) input nested deeper than MAX_DEPTH before parsing it.

    Every other failure is json's own ValueError (JSONDecodeError, UnicodeDecodeError for bytes).
    """
    text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    if _too_deep(text):
        raise TooDeep()
    return json.loads(text, **kwargs)


def read_capped(file, max_bytes: int) -> bytes:
    """All of the open binary ``file`` where it holds at most ``max_bytes``, else TooLarge; never more than
    ``max_bytes`` + 1 bytes are read."""
    data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLarge(f"it is larger than {_size(max_bytes)}, the most oomb reads of such a file")
    return data


def read_json(path: str | Path, max_bytes: int = MAX_JSON_BYTES, **kwargs):
    """The JSON value in the file ``path``, at most ``max_bytes`` long and nested at most MAX_DEPTH deep.

    Raises OSError where it cannot be read and ValueError (TooLarge, TooDeep, UnicodeDecodeError,
    JSONDecodeError) where it is not such JSON.
    """
    with open(path, "rb") as f:
        return loads_json(read_capped(f, max_bytes), **kwargs)


def one_line(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` as a message quotes it: its first line, cut to ``limit`` characters; "…" marks what was left out."""
    line, _, rest = text.partition("\n")
    cut = len(line) > limit
    return line[:limit] + ("…" if cut or rest.strip() else "")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 8, 8, 6, 8
_REPR.maxstring = _REPR.maxother = QUOTE_CHARS


def quoted(value, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` for a message: built without walking all of a large value, one line, at most ``limit``
    characters with "…" where it was cut."""
    return one_line(_REPR.repr(value), limit)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes:,} bytes"
