"""The contract between the domain's release statement (reservations/services.py) and the
receipts the cleanup attaches to it (cleanup/pipeline/release.py): the CTE the receipts read,
its columns, and the placeholders each side owns. A rename on one side fails here, not in the
first real release.

Break: rename ``RELEASED_ROWS``'s value, or the receipts' ``%(attempt)s`` to ``%(reason)s``, or
drop ``r.expires_at`` from the CTE's RETURNING: one of these fails.
"""

from __future__ import annotations

import re

import pytest

from cleanup.pipeline import release
from reservations import services
from reservations.services import (
    RELEASE_PARAMS,
    RELEASED_COLUMNS,
    RELEASED_ROWS,
    AttachedWrite,
)

PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def test_the_release_statement_keeps_its_side() -> None:
    ctes = services._RELEASE_CTES
    assert set(PLACEHOLDER.findall(ctes)) == RELEASE_PARAMS
    updated = re.search(rf"{RELEASED_ROWS} AS \((.*?)\)\s*,\s*seat AS", ctes, re.S)
    assert updated is not None, f"no {RELEASED_ROWS} CTE in the release statement"
    returning = re.search(r"RETURNING (.*)$", updated.group(1).strip())
    assert returning is not None
    columns = [c.strip().removeprefix("r.") for c in returning.group(1).split(",")]
    assert tuple(columns) == RELEASED_COLUMNS


def test_the_receipts_keep_theirs() -> None:
    sql = release._RELEASED_RECEIPTS
    assert re.search(rf"FROM {RELEASED_ROWS} x\b", sql)
    read = set(re.findall(r"\bx\.(\w+)", sql))
    assert read and read <= set(RELEASED_COLUMNS), read
    used = set(PLACEHOLDER.findall(sql))
    assert not used & RELEASE_PARAMS
    # the write the cleanup makes is accepted (every placeholder has a value)
    AttachedWrite(sql, dict.fromkeys(used))


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
