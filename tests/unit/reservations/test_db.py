"""The PostgreSQL connection (reservations.db): timestamps load through psycopg's own loader, and
``infinity`` still loads."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db(transaction=True)


def test_timestamps_load_through_psycopgs_own_loader_and_infinity_still_loads() -> None:
    """Every timestamptz a query returns goes through ``reservations.db``'s loader (the sweep's
    claim reads 500 at a time): finite values through psycopg's own loader (its C one where
    psycopg-binary is installed: a Python subclass parsed each value in Python, ~40x slower),
    ±infinity as datetime.max/min, every value in UTC."""
    import importlib.util

    import psycopg

    from reservations import db

    with connection.cursor() as cur:
        cur.execute(
            "SELECT 'infinity'::timestamptz, '-infinity'::timestamptz, "
            "'2026-01-02 03:04:05.123456+02'::timestamptz"
        )
        values = cur.fetchone()
    assert values == (
        datetime.max.replace(tzinfo=UTC),
        datetime.min.replace(tzinfo=UTC),
        datetime(2026, 1, 2, 1, 4, 5, 123456, tzinfo=UTC),
    )
    assert all(value.tzinfo is UTC for value in values)
    loader = connection.connection.adapters.get_loader(
        psycopg.adapters.types["timestamptz"].oid, psycopg.pq.Format.TEXT
    )
    assert loader is db.InfinityTimestamptzLoader
    if importlib.util.find_spec("psycopg_binary") or importlib.util.find_spec("psycopg_c"):
        assert db._FINITE_LOADER is not None
        assert db._FINITE_LOADER.__module__.startswith(("psycopg_binary", "psycopg_c"))
