"""The package's layering, checked: lower parts never import higher ones, no module imports another's
private names, no import circles, no package file over 500 lines, every package declares __all__."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# DESIGN.md: train -> planning -> engine -> attention -> kernels/cache/offload/sparse/surgery. A part may import its
# own and lower ones. integrations (oomb's step inside transformers' Trainer and TRL) is user-facing like train, and
# nothing imports it. surgery (changes made to a model before it trains) imports no other part.
LAYER = {"integrations": 6, "train": 5, "planning": 4, "engine": 3, "attention": 2,
         "kernels": 1, "cache": 1, "offload": 1, "sparse": 1, "surgery": 1}


def _modules():
    for path in sorted((ROOT / "oomb").rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _imports(tree):
    """(module, [names]) of every `import` and `from ... import` in the file, lazy ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "oomb" and parts[1] in LAYER else None


def test_lower_parts_never_import_higher_ones():
    wrong = []
    for path, tree in _modules():
        here = _part(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for module, _ in _imports(tree):
            there = _part(module)
            if here and there and LAYER[there] > LAYER[here]:
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, wrong


def test_no_module_imports_another_modules_private_names():
    wrong = []
    for path, tree in _modules():
        for module, names in _imports(tree):
            if module.split(".")[0] in ("oomb", "benchmarks"):
                wrong += [f"{path.relative_to(ROOT)}: {module}.{n}" for n in names
                          if n.startswith("_") and not n.startswith("__")]
    assert not wrong, wrong


def test_no_import_circles_between_modules():
    graph = {}
    for path, tree in _modules():
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m, _ in _imports(tree) if m.startswith("oomb")} - {name}
    # A module's imports of its package's face (__init__) count as imports of what the face re-exports.
    state: dict[str, int] = {}
    circle: list[str] = []

    def visit(node, trail):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph or node.startswith(nxt + "."):  # a submodule reaching its own package's face
                continue
            if state.get(nxt) == 1:
                circle.extend(trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt])
                return
            if nxt not in state:
                visit(nxt, [*trail, nxt])
                if circle:
                    return
        state[node] = 2

    for node in sorted(graph):
        if node not in state and not circle:
            visit(node, [node])
    assert not circle, " -> ".join(circle)


def test_package_files_stay_readable_in_one_sitting():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "oomb").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_every_package_declares_what_it_exports():
    missing = [str(p.relative_to(ROOT)) for p in (ROOT / "oomb").rglob("__init__.py") if "__all__" not in p.read_text()]
    assert not missing, missing


def test_test_file_names_are_unique():
    # pytest imports test files by basename (rootdir mode, no packages): two files of one name in different
    # folders stop the whole collection ("import file mismatch").
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
