"""The package structure: no import cycle among the project's modules (function-local imports
included), the domain never imports the cleanup machinery, and docs/TESTING.md's "Where each
module is tested" table names every product module and only test files that exist."""

from __future__ import annotations

import ast
import re
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


# --- the testing map in docs/TESTING.md ----------------------------------------------------

TESTING_MAP = "## Where each module is tested"
BACKTICKED = re.compile(r"`([^`]+)`")


def _mapped_modules() -> set[str]:
    """Product modules the map must list: no package ``__init__``, ``apps`` or migrations
    (``_modules()`` already skips migrations and names an ``__init__`` by its package)."""
    return {
        name for name, path in _modules().items() if path.name not in ("__init__.py", "apps.py")
    }


def read_testing_map() -> list[tuple[str, list[str]]]:
    """(module, test files) of each row of the table, in order; files as written, or
    ``["none"]``."""
    text = (ROOT / "docs" / "TESTING.md").read_text()
    assert TESTING_MAP in text, f"docs/TESTING.md has no {TESTING_MAP!r} section"
    section = text.split(TESTING_MAP, 1)[1].split("\n## ", 1)[0]
    rows: list[tuple[str, list[str]]] = []
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        module = BACKTICKED.fullmatch(cells[0])
        if module is None:  # the header and the separator row
            continue
        rows.append((module.group(1), BACKTICKED.findall(cells[1])))
    return rows


def test_the_testing_map_names_every_module() -> None:
    rows = read_testing_map()
    listed = [module for module, _ in rows]
    expected = _mapped_modules()
    missing = sorted(expected - set(listed))
    unknown = sorted(set(listed) - expected)
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert (missing, unknown, twice) == ([], [], []), (
        f"docs/TESTING.md's testing map: missing modules {missing}, unknown modules {unknown}, "
        f"listed twice {twice}"
    )


def test_the_testing_map_names_only_existing_test_files() -> None:
    rows = read_testing_map()
    assert rows, "the testing map has no rows"
    absent = sorted(
        f"{module}: {path}"
        for module, paths in rows
        for path in paths
        if path != "none" and not (ROOT / "tests" / path).is_file()
    )
    empty = sorted(module for module, paths in rows if not paths)
    assert (absent, empty) == ([], []), (
        f"docs/TESTING.md's testing map: no such test file {absent}; no test file or `none` "
        f"for {empty}"
    )
