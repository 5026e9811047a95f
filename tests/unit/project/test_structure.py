"""The package structure: no import cycle among the project's modules (function-local imports
included), and the domain never imports the cleanup machinery."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

PACKAGES = ("config", "reservations", "cleanup", "tools", "bench")


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


def test_the_product_never_imports_the_example_project() -> None:
    """The example project (config) wires the apps in; they reach the Celery app as
    ``celery.current_app`` and never import the project's wiring, which a host project
    installing them does not have."""
    assert (_imports("cleanup", "config"), _imports("reservations", "config")) == (set(), set())


def test_the_product_never_imports_the_tooling() -> None:
    """tools/ (drills, seeding) and bench/ sit outside the apps a team installs."""
    product = ("reservations", "cleanup")
    assert {
        (name, target)
        for name, targets in import_graph().items()
        if name.startswith(product)
        for target in targets
        if target.startswith(("tools", "bench"))
    } == set()


def test_the_benchmarks_never_import_the_tests() -> None:
    offenders: set[tuple[str, str]] = set()
    for path in (ROOT / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders.update(
                (str(path.relative_to(ROOT)), n) for n in names if n.split(".")[0] == "tests"
            )
    assert offenders == set()


# The floors of cleanup/, lowest first. A module imports only from its own floor or below:
# the release core never reaches the worker's edge or operations, and nothing reaches the
# Django entry points (tasks, admin, commands).
CLEANUP_FLOORS: tuple[tuple[str, ...], ...] = (
    (
        "cleanup",
        "cleanup.conf",
        "cleanup.wire",
        "cleanup.models",
        "cleanup.sql",
        "cleanup.metrics",
        "cleanup.metrics_boot",
        "cleanup.processes",
        "cleanup.tracing",
        "cleanup.error_reports",
    ),
    ("cleanup.broker",),
    ("cleanup.release",),
    ("cleanup.worker",),
    ("cleanup.operations",),
    (
        "cleanup.tasks",
        "cleanup.admin",
        "cleanup.apps",
        "cleanup.management",
        "cleanup.celery",
        "cleanup.urls",
    ),
)


def floor_of(module: str) -> int | None:
    for floor, prefixes in enumerate(CLEANUP_FLOORS):
        for prefix in prefixes:
            if module == prefix or (prefix != "cleanup" and module.startswith(prefix + ".")):
                return floor
    return None


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {
        (name, target)
        for name, targets in graph.items()
        if name.startswith("cleanup")
        for target in targets
        if target.startswith("cleanup") and (floor_of(target) or 0) > (floor_of(name) or 0)
    }


def test_every_cleanup_module_has_a_floor() -> None:
    assert [m for m in import_graph() if m.startswith("cleanup") and floor_of(m) is None] == []


def test_no_cleanup_module_imports_from_a_floor_above_its_own() -> None:
    assert upward_imports(import_graph()) == set()


def test_the_floor_check_finds_an_upward_import() -> None:
    graph = {"cleanup.release.sweep": {"cleanup.operations.console.health"}, "cleanup.sql": set()}
    assert upward_imports(graph) == {("cleanup.release.sweep", "cleanup.operations.console.health")}
