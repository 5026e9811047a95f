"""Root fixtures. Tests run against a real PostgreSQL (pytest-django's ``test_`` database)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservations import services
from reservations.models import Offering

# A skip for a missing tool fails in CI and is listed at the end of a person's run.
from tests.support.fleet import SessionFleet, purge_broker
from tests.support.missing_tools import (  # noqa: F401  (hooks: pytest finds them by name here)
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)

# Fixtures every test may ask for: the API's development token (``api_token``), a logged-in
# superuser (``root_client``), and the web behind gunicorn (``web``, set up by ``web_options``).
pytest_plugins = ("tests.support.api", "tests.support.staff", "tests.support.web")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unit tests run before the real-worker modules when both are collected (the sort is
    stable: the order within each group is unchanged).

    This is for speed only: isolation does not depend on it. Unit tests put messages and
    ``unacked`` entries straight into the tests' Redis database and read them back, so every
    unit test pauses the session's worker fleet first (``tests/unit/conftest.py``); ordering
    them first means the fleet is started once, after them, instead of stopped and restarted.
    """
    items.sort(key=lambda item: item.nodeid.startswith("tests/integration/"))
    for item in items:
        skip_drill_unless_asked(item)


def skip_drill_unless_asked(item: pytest.Item) -> None:
    """A drill (marker ``drill``) that names its variable runs only when that variable is 1:
    its own phase sets it (scripts/test.sh, the Makefile's drill targets)."""
    drill = item.get_closest_marker("drill")
    if drill is None or "env" not in drill.kwargs:
        return
    variable = drill.kwargs["env"]
    item.add_marker(
        pytest.mark.skipif(os.environ.get(variable) != "1", reason=drill.kwargs["reason"])
    )


@pytest.fixture(scope="session")
def worker_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="session")
def session_fleet(django_db_blocker: object, worker_logs: Path) -> Iterator[SessionFleet]:
    """The session's shared worker fleet (tests/support/fleet.py): not started until a
    real-worker test asks for it (``workers``); paused by unit tests and exclusive tests."""
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        purge_broker()
    shared = SessionFleet(worker_logs)
    try:
        yield shared
    finally:
        shared.pause()


@pytest.fixture
def offering(db: None) -> Offering:
    return services.create_offering("Intro to Databases, section A", capacity=3)


@pytest.fixture
def make_offering(db: None):  # type: ignore[no-untyped-def]
    def _make(capacity: int = 3, name: str = "section") -> Offering:
        return services.create_offering(name, capacity=capacity)

    return _make
