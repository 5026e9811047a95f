"""The project's raw SQL lives in three modules, by name: reservations/sql.py (the domain's and
the connection's own session settings), cleanup/sql.py (the cleanup's) and tools/drills/sql.py
(the drills' checks of the pipeline).
Every named statement is accepted by PostgreSQL as it stands (prepared against the migrated
schema, not run), and no other product module writes a statement of its own.

Break: misspell a column in any named statement (``expires_at`` as ``expire_at``): the prepare
test names it. Write ``cur.execute("SELECT 1")`` in a cleanup module: the placement test names
the module and line.
"""

from __future__ import annotations

import ast
import re

import pytest
from django.db import connection

from cleanup import sql as cleanup_sql
from reservations import sql as reservations_sql
from tests.support import ROOT
from tools.drills import sql as drills_sql

SQL_MODULES = {ROOT / package / "sql.py" for package in ("reservations", "cleanup", "tools/drills")}
# A string that starts like a statement (after white space): what a module must not write.
STATEMENT = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|WITH|ANALYZE|SET)\s")
# What PREPARE takes; the utility statements (ANALYZE, SET) run in every test run anyway
# (seeding, every new connection).
PREPARABLE = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|WITH)\s")
# Fragments of the release statement, prepared as parts of it (below).
FRAGMENTS = {"reservations.sql.RELEASE_CTES", "cleanup.sql.RELEASED_RECEIPTS"}
PLACEHOLDER = re.compile(r"%\((\w+)\)s|%s")


def _named_statements() -> list[tuple[str, str]]:
    found = []
    for module in (reservations_sql, cleanup_sql, drills_sql):
        for name, value in vars(module).items():
            if name.isupper() and not name.startswith("_"):
                texts = value if isinstance(value, tuple) else (value,)
                found += [
                    (f"{module.__name__}.{name}", text)
                    for text in texts
                    if isinstance(text, str) and PREPARABLE.match(text)
                ]
    found = [(name, text) for name, text in found if name not in FRAGMENTS]
    # Statements assembled by a builder, and the receipts (which read a CTE of the release).
    found.append(("reservations.sql.release_statement()", reservations_sql.release_statement()))
    found.append(
        (
            "reservations.sql.release_statement(cleanup.sql.RELEASED_RECEIPTS)",
            reservations_sql.release_statement(cleanup_sql.RELEASED_RECEIPTS),
        )
    )
    return found


def _numbered(statement: str) -> str:
    """``%(name)s`` and ``%s`` as PostgreSQL's ``$n`` (a name keeps its number), ``%%`` as ``%``."""
    numbers: dict[str, int] = {}
    counter = iter(range(1, 1000))

    def number(match: re.Match[str]) -> str:
        key = match.group(1) or f"#{len(numbers)}"
        if key not in numbers:
            numbers[key] = next(counter)
        return f"${numbers[key]}"

    return PLACEHOLDER.sub(number, statement).replace("%%", "%")


@pytest.mark.django_db
@pytest.mark.parametrize(("name", "statement"), _named_statements(), ids=lambda v: v[:60])
def test_every_named_statement_is_accepted_by_postgresql(name: str, statement: str) -> None:
    with connection.cursor() as cur:
        cur.execute(f"PREPARE named_statement AS {_numbered(statement)}")
        cur.execute("DEALLOCATE named_statement")


def test_no_other_product_module_writes_a_statement() -> None:
    written = []
    for package in ("reservations", "cleanup", "config"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in SQL_MODULES or "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if STATEMENT.match(node.value):
                        written.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                elif isinstance(node, ast.JoinedStr) and node.values:
                    first = node.values[0]
                    if isinstance(first, ast.Constant) and STATEMENT.match(str(first.value)):
                        written.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert written == [], f"SQL written outside the four sql.py modules: {written}"
