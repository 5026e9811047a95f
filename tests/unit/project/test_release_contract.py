"""The contract between the domain's release statement (reservations/sql.py) and the receipts
the cleanup attaches to it (cleanup/sql.py's ``RELEASED_RECEIPTS``): the CTE the receipts read
(``RELEASED_ROWS``), its columns (``RELEASED_COLUMNS``) and the placeholders each side owns
(``RELEASE_PARAMS`` are the release's). Both statements are written with those names, and a
change that breaks the contract fails here, not in the first real release.

Break: the receipts read ``released.bucket`` (a column the CTE does not return), or use
``%(reason)s`` instead of ``%(attempt)s``; or the release statement gains a placeholder that
``RELEASE_PARAMS`` does not list (``%(lease)s``), or its CTE returns ``hold.bucket`` besides
``RELEASED_COLUMNS``: one of these fails.
"""

from __future__ import annotations

import re

import pytest

from cleanup import sql as cleanup_sql
from reservations import sql as reservations_sql
from reservations.services import AttachedWrite
from reservations.sql import RELEASE_PARAMS, RELEASED_COLUMNS, RELEASED_ROWS

PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def test_the_release_statement_keeps_its_side() -> None:
    statement = reservations_sql.release_statement()
    assert set(PLACEHOLDER.findall(statement)) == RELEASE_PARAMS
    released = re.search(rf"\b{RELEASED_ROWS} AS \((.*?)\)\s*,\s*seats AS", statement, re.S)
    assert released is not None, f"no {RELEASED_ROWS} CTE in the release statement"
    returning = re.search(r"RETURNING (.*)$", released.group(1).strip())
    assert returning is not None
    columns = [c.strip().removeprefix("hold.") for c in returning.group(1).split(",")]
    assert tuple(columns) == RELEASED_COLUMNS
    assert statement.rstrip().endswith(f"SELECT id, request_traceparent FROM {RELEASED_ROWS}")


def test_the_receipts_keep_theirs() -> None:
    receipts = cleanup_sql.RELEASED_RECEIPTS
    assert re.search(rf"\bFROM {RELEASED_ROWS} released\b", receipts)
    read = set(re.findall(r"\breleased\.(\w+)", receipts))
    assert read and read <= set(RELEASED_COLUMNS), read
    used = set(PLACEHOLDER.findall(receipts))
    assert not used & RELEASE_PARAMS
    # the write the cleanup makes is accepted (every placeholder has a value) and becomes one
    # CTE of the statement the domain runs
    AttachedWrite(receipts, dict.fromkeys(used))
    statement = reservations_sql.release_statement(receipts)
    assert f"attached AS ({receipts})" in statement


@pytest.mark.parametrize(
    ("sql", "params", "problem"),
    [
        ("INSERT INTO t SELECT id FROM other_rows", {}, "does not read FROM released_rows"),
        ("INSERT INTO t SELECT id, %(reason)s FROM released_rows", {"reason": 1}, "own"),
        ("INSERT INTO t SELECT id, %(who)s FROM released_rows", {}, "have no value"),
    ],
)
def test_a_write_that_breaks_the_contract_is_refused_when_made(
    sql: str, params: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        AttachedWrite(sql, params)
