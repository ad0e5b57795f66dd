"""The package's layering, read from the source: no import cycle between the parts of
``mismatch_monitor`` and the store never imports the query layer (the store writes, the query
layer reads).

Every ``import`` / ``from ... import`` statement of every source file counts, also one inside a
function or under ``TYPE_CHECKING``: a lazy import hides a cycle from the interpreter, not from
the design. A part is a subpackage (``store``, ``query``, ``engine``, ``collectors``, ...) or a
top-level module (``metrics``, ``batch``, ...); imports inside one part are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mismatch_monitor"
# where each mapped part's source lives (pyproject.toml's package-dir)
SOURCES = {PACKAGE: ROOT / "mismatch_monitor", f"{PACKAGE}.collectors": ROOT / "collectors",
           f"{PACKAGE}.alerts": ROOT / "alerts", f"{PACKAGE}.app": ROOT / "app"}


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (source file, whether it is a package's ``__init__``)."""
    found: dict[str, tuple[Path, bool]] = {}
    for name, base in SOURCES.items():
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("").parts
            if any(p.startswith(".") or p == "__pycache__" for p in rel):
                continue
            is_init = rel[-1] == "__init__"
            parts = rel[:-1] if is_init else rel
            dotted = ".".join((name, *parts))
            if dotted in found and found[dotted][0] != path:   # a mapped folder inside the core
                continue
            found[dotted] = (path, is_init)
    return found


def imported(tree: ast.AST, module: str, is_init: bool, known: set[str]) -> set[str]:
    """The project modules ``tree`` (the source of ``module``) imports, anywhere in it."""
    package = module if is_init else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            # ``from pkg import sub`` imports the module pkg.sub where there is one
            out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return {m for m in out if m == PACKAGE or m.startswith(PACKAGE + ".")}


def part(module: str) -> str:
    """The part a module belongs to (the package's own ``__init__`` is the part ``""``)."""
    rest = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    return rest.split(".")[0]


def edges() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> "file: module" lines that make the edge."""
    known = modules()
    out: dict[tuple[str, str], list[str]] = {}
    for module, (path, is_init) in sorted(known.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target in sorted(imported(tree, module, is_init, set(known))):
            a, b = part(module), part(target)
            if a != b and b != "":
                out.setdefault((a, b), []).append(f"{path.relative_to(ROOT)}: {target}")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_lazy_relative_and_package_imports() -> None:
    """The walker itself: an import inside a function, ``from .. import sub`` and an absolute
    import all become edges, so the checks below can fail."""
    src = ("from ..engine.fields import TABLES\n"
           "def f():\n    from .. import query\n    import mismatch_monitor.metrics\n")
    known = {"mismatch_monitor.query", "mismatch_monitor.engine.fields", "mismatch_monitor.metrics"}
    got = imported(ast.parse(src), "mismatch_monitor.store.writer", False, known)
    assert {"mismatch_monitor.engine.fields", "mismatch_monitor.query", "mismatch_monitor.metrics"} <= got
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_walker_finds_the_parts() -> None:
    found = {part(m) for m in modules()}
    assert {"store", "query", "engine", "collectors", "alerts", "app", "cli", "sim", "metrics"} <= found
    graph = edges()
    assert ("query", "store") in graph        # the reader reads the store's layout


def test_no_import_cycle_between_parts() -> None:
    graph: dict[str, set[str]] = {}
    for a, b in edges():
        graph.setdefault(a, set()).add(b)
    found = cycles(graph)
    if found:
        where = edges()
        lines = [f"{a} -> {b}: {', '.join(where[(a, b)])}"
                 for c in found for a in c for b in c if (a, b) in where]
        pytest.fail(f"import cycles between parts of {PACKAGE}: {found}\n" + "\n".join(lines))


def test_the_store_never_imports_the_query_layer() -> None:
    assert edges().get(("store", "query"), []) == []
