"""Root fixtures. Tests run against a real PostgreSQL (pytest-django's ``test_`` database)."""

from __future__ import annotations

import pytest

from reservations import services
from reservations.models import Offering


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unit tests run before the real-worker modules, always.

    Unit tests put messages and ``unacked`` entries straight into the tests' Redis database and
    read them back. The integration modules start a session-wide worker fleet that consumes
    those same queues until the session ends, so a unit test running after them would race a
    live worker for its own entries. Ordering by location keeps the fleet from existing while
    any unit test runs (the sort is stable: the order within each group is unchanged).
    """
    items.sort(key=lambda item: item.nodeid.startswith("tests/integration/"))


@pytest.fixture
def offering(db: None) -> Offering:
    return services.create_offering("Intro to Databases, section A", capacity=3)


@pytest.fixture
def make_offering(db: None):  # type: ignore[no-untyped-def]
    def _make(capacity: int = 3, name: str = "section") -> Offering:
        return services.create_offering(name, capacity=capacity)

    return _make
