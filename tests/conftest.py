"""Root fixtures. Tests run against a real PostgreSQL (pytest-django's ``test_`` database)."""

from __future__ import annotations

import pytest

from reservations import services
from reservations.models import Offering


@pytest.fixture
def offering(db: None) -> Offering:
    return services.create_offering("Intro to Databases, section A", capacity=3)


@pytest.fixture
def make_offering(db: None):  # type: ignore[no-untyped-def]
    def _make(capacity: int = 3, name: str = "section") -> Offering:
        return services.create_offering(name, capacity=capacity)

    return _make
