"""Fixtures for real-worker tests: one worker fleet per test session, clean state per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .fleet import Worker, purge_broker

TABLES = (
    "cleanup_cleanupreceipt, cleanup_deadletter, cleanup_deliverycount, "
    "reservations_outboxevent, reservations_reservation, reservations_offering"
)


@pytest.fixture(scope="session")
def worker_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


class SessionFleet:
    """Two worker instances of concurrency 2 on the standard queues, started on first use and
    shared by the session's tests. Tests that run their own workers on the same queues pause it
    first (``exclusive_workers``), so no other consumer takes their messages."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.workers: list[Worker] = []
        self.generation = 0

    def ensure(self) -> list[Worker]:
        if self.workers and all(w.alive() for w in self.workers):
            return self.workers
        self.pause()
        self.generation += 1
        self.workers = [
            Worker(f"itw{i}-g{self.generation}-{os.getpid()}", 2, self.logs / f"worker{i}.log")
            for i in range(2)
        ]
        for w in self.workers:
            w.start()
        for w in self.workers:
            w.wait_ready()
        return self.workers

    def pause(self) -> None:
        for w in self.workers:
            w.stop(timeout=20)
        self.workers = []


@pytest.fixture(scope="session")
def session_fleet(
    django_db_setup: None, django_db_blocker: object, worker_logs: Path
) -> Iterator[SessionFleet]:
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        purge_broker()
    shared = SessionFleet(worker_logs)
    try:
        yield shared
    finally:
        shared.pause()


@pytest.fixture
def workers(session_fleet: SessionFleet) -> list[Worker]:
    """The shared fleet, running."""
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
