"""The package structure: no import cycle among the project's modules (function-local imports
included), and the domain never imports the cleanup machinery."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("config", "common", "reservations", "cleanup")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_no_import_cycle_among_the_projects_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _imports(source: str, target: str) -> set[tuple[str, str]]:
    """(importer, imported) pairs from modules under ``source`` to modules under ``target``."""
    graph = import_graph()
    return {
        (name, imported)
        for name, imported_names in graph.items()
        if name.startswith(source)
        for imported in imported_names
        if imported.startswith(target)
    }


def test_the_domain_never_imports_the_cleanup_machinery() -> None:
    assert _imports("reservations", "cleanup") == set()


def test_the_plumbing_imports_neither_app() -> None:
    """common/ sits under both apps: the domain and the cleanup import it, never the reverse."""
    assert (_imports("common", "reservations"), _imports("common", "cleanup")) == (set(), set())


def test_no_cleanup_module_imports_config() -> None:
    """The project (config) wires cleanup in; cleanup reaches the Celery app as
    ``celery.current_app`` and never imports the project's wiring."""
    assert _imports("cleanup", "config") == set()


def test_no_runtime_module_imports_the_drill_tooling() -> None:
    graph = import_graph()
    runtime = [
        name for name in graph if not name.startswith(("cleanup.drills", "cleanup.management"))
    ]
    leaks = {
        (name, target)
        for name in runtime
        for target in graph[name]
        if target.startswith("cleanup.drills")
    }
    assert leaks == set()
