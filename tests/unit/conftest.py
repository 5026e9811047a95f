"""Fixtures for the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from cleanup.broker.readers import redis_client
from tests.integration.fleet import SessionFleet


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    """The tests' own Redis database number (never another), empty before and after the test."""
    client = redis_client()
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture(autouse=True)
def no_worker_consuming(session_fleet: SessionFleet) -> None:
    """Unit tests write queues and kombu's ``unacked`` hash in the tests' Redis database and read
    them back: no worker of the session's fleet may be consuming them, whatever order the tests
    run in. Pausing is a no-op when the fleet is not running (the usual case: unit tests are
    collected first, or run in a pytest of their own as scripts/test.sh does)."""
    session_fleet.pause()
