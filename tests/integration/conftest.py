"""Fixtures for real-worker tests: one worker fleet per test session, clean state per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .fleet import Worker, fleet, purge_broker

TABLES = (
    "cleanup_cleanupreceipt, cleanup_deadletter, cleanup_deliverycount, "
    "reservations_outboxevent, reservations_reservation, reservations_offering"
)


@pytest.fixture(scope="session")
def worker_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="session")
def workers(
    django_db_setup: None, django_db_blocker: object, worker_logs: Path
) -> Iterator[list[Worker]]:
    """Two worker instances of concurrency 2, shared by the session's integration tests."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        purge_broker()
    with fleet(worker_logs, count=2, concurrency=2) as ws:
        yield ws


@pytest.fixture
def clean(transactional_db: None) -> Iterator[None]:
    """Committed data visible to workers; an empty broker and tables before each test."""
    from django.db import connection

    purge_broker()
    with connection.cursor() as cur:
        cur.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    yield
    purge_broker()
