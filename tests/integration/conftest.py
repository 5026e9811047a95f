"""Fixtures for real-worker tests: the session's worker fleet (``session_fleet``, defined in
tests/conftest.py so that the unit tests can pause it too), clean state per test."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from django.conf import settings

from tests.support import fleet
from tests.support.fleet import SessionFleet, Worker, purge_broker

TABLES = (
    "cleanup_cleanupreceipt, cleanup_deadletter, cleanup_deliverycount, "
    "reservations_outboxevent, reservations_reservation, reservations_offering"
)


@pytest.fixture(scope="session", autouse=True)
def pgbouncer_lets_go_of_the_test_database(request: pytest.FixtureRequest) -> Iterator[None]:
    """Behind a PgBouncer (``fleet.PGBOUNCER``): at the end of the session, after the workers
    stopped and before pytest-django drops the test database, PgBouncer closes its server
    connections to it (``KILL``), which it would otherwise keep open and fail the drop."""
    if not fleet.PGBOUNCER:
        yield
        return
    request.getfixturevalue("django_db_setup")  # torn down after this fixture
    yield
    db = settings.DATABASES["default"]
    host, _, port = fleet.PGBOUNCER.partition(":")
    with psycopg.connect(
        host=host, port=port, dbname="pgbouncer", user=str(db["USER"]), autocommit=True
    ) as admin:
        admin.execute(f"KILL {db['NAME']}")


@pytest.fixture
def workers(django_db_setup: None, session_fleet: SessionFleet) -> list[Worker]:
    """The shared fleet, running (on the test database, created first)."""
    return session_fleet.ensure()


@pytest.fixture
def exclusive_workers(session_fleet: SessionFleet) -> None:
    """Stop the shared fleet: this test starts its own workers on the standard queues."""
    session_fleet.pause()


@pytest.fixture
def clean(transactional_db: None) -> Iterator[None]:
    """Committed data visible to workers; an empty broker and tables before each test."""
    from django.db import connection

    purge_broker()
    with connection.cursor() as cur:
        cur.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    yield
    purge_broker()
    # pytest-django truncates every table after the test; a worker still finishing a task (or a
    # sweep sent by beat just before the purge) would deadlock with that TRUNCATE. Wait until
    # no other session of the test database is running a statement or holding a transaction.
    _wait_for_quiet_database()


def _wait_for_quiet_database(timeout: float = 30) -> None:
    import time

    from django.db import connection

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state IN ('active', 'idle in transaction')"
            )
            if cur.fetchone()[0] == 0:
                return
        time.sleep(0.1)
