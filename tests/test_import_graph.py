"""The product packages' imports (training/, data_prep/): no import cycles, counting the imports
inside functions too, and nothing from benchmarks/ or tools/."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("training", "data_prep")


def _modules(root: Path) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported_names(module: str, path: Path) -> set[str]:
    """The names every import statement of `module` imports, wherever the statement is: `import a.b`
    gives a.b, `from a import b` gives a.b (a module b of package a, or a name b that a defines)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the importing module's package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """module -> the product modules it imports: the longest known prefix of each imported name (a
    package's __init__ that every import of its modules runs first is not counted)."""
    modules = _modules(root)

    def known(name: str) -> str | None:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return ".".join(parts[:end])
        return None

    return {m: {k for n in _imported_names(m, p) if (k := known(n)) not in (None, m)} for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    (tmp_path / "training").mkdir()
    (tmp_path / "data_prep").mkdir()
    (tmp_path / "training" / "__init__.py").write_text("")
    (tmp_path / "data_prep" / "__init__.py").write_text("")
    (tmp_path / "training" / "a.py").write_text("from training.b import f\n")
    (tmp_path / "training" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "training" / "c.py").write_text("import training.a\nfrom data_prep import d\n")
    (tmp_path / "data_prep" / "d.py").write_text("")
    graph = import_graph(tmp_path)
    assert graph["training.b"] == {"training.a"} and graph["training.c"] == {"training.a", "data_prep.d"}
    assert cycles(graph) == [["training.a", "training.b"]]


def test_the_product_packages_have_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_product_packages_import_nothing_from_benchmarks_or_tools():
    offenders = []
    for module, path in _modules(REPO).items():
        offenders += [f"{module}: {name}" for name in _imported_names(module, path)
                      if name.split(".")[0] in ("benchmarks", "tools")]  # fmt: skip
    assert offenders == []
