"""Figures in the docs, checked against the records they cite.

The convention: a measured figure in README.md or docs/*.md is followed at once by an HTML comment
that names its record under benchmarks/results/ and where in it the value is, invisible when rendered:

    a dense 64K step in 13.98 s<!-- core-7b-vs-transformers-64k.json: results[3].step_s -->

The part after the colon is a Python expression over the record: `a.b` and `a["b"]` read a key,
`a[0]` an item, `a[:].b` the key `b` of every item and `a[-10:]` the last ten (lists that arithmetic,
comparisons and `sum`, `len`, `min`, `max`, `mean`, `median` work on), with + - * / for unit changes
and ratios:

    33.03 ms<!-- sparse-kernels.json: results[0].fwd_bwd_s * 1000 -->
    4.6x<!-- sparse-kernels.json: results[0].fwd_bwd_s / results[1].fwd_bwd_s -->

`record("other.json")` reads another record, for a ratio across two runs.

The figure is the last number before the comment (thousands commas, a sign, `−` allowed; a unit or
`**` may follow it). It matches when the value, rounded to as many decimals as the doc prints,
reads the same. A target or limit is not a measurement: write it with `≤`/`≥` and it needs no record.

    python -m benchmarks.figures check                     # every citation in README.md and docs/
    python -m benchmarks.figures find RECORD.json 13.98    # the paths in a record that print as 13.98
"""

from __future__ import annotations

import ast
import json
import re
import statistics
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

CITATION = re.compile(r"<!--\s*([\w.+-]+\.json):\s*(.*?)\s*-->")
_NUMBER = r"[+\-−]?\d[\d,]*(?:\.\d+)?"
# The figure a citation belongs to: the last number before it, then at most a unit and emphasis.
_FIGURE_BEFORE = re.compile(rf"({_NUMBER})[^\d<>]{{0,16}}$")
# Units that mark a number in prose as measured (and so in need of a citation).
_MEASURED = re.compile(rf"(?<![\w.])({_NUMBER})(?:x\b|%| ?(?:ms|s|GiB|MiB|GB/s|TFLOP/s|tokens/s|points)\b)")
_TARGET = re.compile(r"[≤≥]\s?$")
_CODE = re.compile(r"`[^`]*`")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_FUNCTIONS = {"sum": sum, "len": len, "min": min, "max": max, "mean": statistics.fmean, "median": statistics.median}


class CitationError(ValueError):
    """A citation that cannot be resolved; the message names the record and the part that failed."""


@dataclass(frozen=True)
class Citation:
    """One figure of a doc and the record value it cites."""

    doc: str
    line: int
    printed: str  # the figure as the doc prints it, e.g. "13.67" or "+4.1" or "1,048,576"
    record: str
    expression: str
    start: int  # where the figure starts in its line (for the coverage check)


class _Items(list):
    """The result of `a[:]`: attribute access and arithmetic apply to every item."""


def _binary(op, a, b):
    if isinstance(a, _Items) or isinstance(b, _Items):
        xs = a if isinstance(a, _Items) else [a] * len(b)
        ys = b if isinstance(b, _Items) else [b] * len(a)
        return _Items(_binary(op, x, y) for x, y in zip(xs, ys, strict=True))
    return op(a, b)


_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: a / b, ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
              ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b}


def _key(value, key, expression):
    if isinstance(value, _Items):
        return _Items(_key(v, key, expression) for v in value)
    try:
        return value[key]
    except (KeyError, IndexError, TypeError):
        keys = f"; its keys: {sorted(value)[:12]}" if isinstance(value, dict) else ""
        raise CitationError(f"{expression!r}: no {key!r} in a {type(value).__name__}{keys}") from None


def evaluate(expression: str, record: dict):
    """The value `expression` (the citation syntax above) names in `record`."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise CitationError(f"{expression!r} is not an expression: {e.msg}") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float | str):
            return node.value
        if isinstance(node, ast.Name):
            return _key(record, node.id, expression)
        if isinstance(node, ast.Attribute):
            return _key(ev(node.value), node.attr, expression)
        if isinstance(node, ast.Subscript):
            value = ev(node.value)
            if isinstance(node.slice, ast.Slice):
                if not isinstance(value, list):
                    raise CitationError(f"{expression!r}: a slice needs a list, got a {type(value).__name__}")
                bounds = [None if b is None else ev(b) for b in (node.slice.lower, node.slice.upper, node.slice.step)]
                return _Items(value[slice(*bounds)])
            return _key(value, ev(node.slice), expression)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _binary(_OPERATORS[type(node.op)], ev(node.left), ev(node.right))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _OPERATORS:
            return _binary(_OPERATORS[type(node.ops[0])], ev(node.left), ev(node.comparators[0]))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return _binary(lambda a, b: a * b, ev(node.operand), -1)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1
                and not node.keywords):
            if node.func.id == "record" and isinstance(node.args[0], ast.Constant):
                return load_record(node.args[0].value)  # another record, for a ratio across two runs
            if node.func.id in _FUNCTIONS:
                return _FUNCTIONS[node.func.id](ev(node.args[0]))
        raise CitationError(f"{expression!r}: {ast.unparse(node)!r} is outside the citation syntax "
                            f"(keys, [index], [:], + - * /, comparisons, {', '.join(_FUNCTIONS)}, record(NAME))")

    return ev(tree)


@cache
def load_record(name: str) -> dict:
    path = RESULTS / name
    if not path.is_file():
        raise CitationError(f"{name}: no such record in {RESULTS.relative_to(ROOT)}")
    return json.loads(path.read_text())


def formatted(value, printed: str) -> str:
    """`value` written with as many decimals as `printed` has, the way the doc would print it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CitationError(f"the expression gives a {type(value).__name__}, not a number: {value!r:.80}")
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    text = f"{value:.{decimals}f}"
    return text[1:] if re.fullmatch(r"-0\.?0*", text) else text  # -0.0 prints as 0.0


def normalized(printed: str) -> str:
    """The doc's figure as Python would format it: no thousands commas, no plus sign, an ASCII minus."""
    return printed.replace(",", "").replace("−", "-").lstrip("+")


def citations(text: str, doc: str) -> list[Citation]:
    """Every citation in `text` with the figure before it; CitationError for one that follows no number."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        previous_end = 0
        for m in CITATION.finditer(line):
            before = line[previous_end:m.start()]
            figure = _FIGURE_BEFORE.search(before)
            if not figure:
                raise CitationError(f"{doc}:{number}: the citation {m.group(0)!r} follows no number")
            found.append(Citation(doc, number, figure.group(1), m.group(1), m.group(2),
                                  previous_end + figure.start(1)))
            previous_end = m.end()
    return found


def mismatches(cites: list[Citation]) -> list[str]:
    """One line per citation whose record value does not print as the doc's figure (or cannot be read)."""
    problems = []
    for c in cites:
        where = f"{c.doc}:{c.line}: {c.printed} <- {c.record}: {c.expression}"
        try:
            got = formatted(evaluate(c.expression, load_record(c.record)), c.printed)
        except CitationError as e:
            problems.append(f"{where}: {e}")
            continue
        if got != normalized(c.printed):
            problems.append(f"{where}: the record gives {got}")
    return problems


def _blank(text: str, pattern: re.Pattern) -> str:
    """`text` with the matches of `pattern` replaced by spaces (positions kept)."""
    return pattern.sub(lambda m: " " * len(m.group(0)), text)


def uncited(text: str, doc: str) -> list[str]:
    """Measured figures without a citation: in prose, numbers with a unit of measurement; in a table's
    body, every number of every cell but the first (the row's label)."""
    cited = {(c.line, c.start) for c in citations(text, doc)}
    lines = text.splitlines()
    problems = []
    in_fence = False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence:
            continue
        plain = _blank(_blank(_blank(line, CITATION), _CODE), _LINK_TARGET)
        if plain.lstrip().startswith("|"):
            following = lines[number] if number < len(lines) else ""
            if set(plain.strip()) <= set("|-: ") or re.fullmatch(r"\s*\|[\s|:-]+\|\s*", following):
                continue  # the separator row, or the header row above it
            first_cell_end = plain.index("|", plain.index("|") + 1)
            starts = [m.start(1) for m in re.finditer(rf"(?<![\w.])({_NUMBER})", plain) if m.start(1) > first_cell_end]
        else:
            starts = [m.start(1) for m in _MEASURED.finditer(plain)]
        for start in starts:
            if (number, start) not in cited and not _TARGET.search(plain[:start]):
                figure = re.match(_NUMBER + r"\S*", plain[start:]).group(0)
                problems.append(f"{doc}:{number}: {figure!r} has no citation")
    return problems


def doc_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _find(record_name: str, printed: str) -> list[str]:
    """Paths of `record_name` whose value prints as `printed` (a helper for writing citations)."""
    hits = []

    def walk(value, path):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if k.isidentifier() else f"{path}[{json.dumps(k)}]")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            for scale in (1, 1000, 100, 1 / 1000, 1 / 2**30):
                if formatted(value * scale, printed) == normalized(printed):
                    hits.append(path.lstrip(".") + ("" if scale == 1 else f" * {scale:g}"))

    walk(load_record(record_name), "")
    return hits


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["find"] and len(args) == 3:
        print("\n".join(_find(args[1], args[2])) or "no value in that record prints so")
        return 0
    if args != ["check"]:
        print(__doc__, file=sys.stderr)
        return 2
    problems = []
    for path in doc_paths():
        text, doc = path.read_text(), str(path.relative_to(ROOT))
        try:
            problems += mismatches(citations(text, doc))
        except CitationError as e:
            problems.append(str(e))
    print("\n".join(problems) or "every cited figure matches its record")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
