"""Fixtures for the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from cleanup.broker.readers import redis_client


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    """The tests' own Redis database number (never another), empty before and after the test."""
    client = redis_client()
    client.flushdb()
    yield client
    client.flushdb()
