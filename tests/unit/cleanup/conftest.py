"""Fixtures shared by the cleanup's tests in more than one of its packages."""

from __future__ import annotations

from typing import Any

import pytest

from cleanup.release import sizing


@pytest.fixture
def adaptive(settings: Any) -> Any:
    """The adaptive release mode with a 10 s target and a floor of 20 messages/s, its last
    sizing forgotten."""
    settings.CLEANUP_RELEASE_MODE = "adaptive"
    settings.CLEANUP_RELEASE_TARGET_SECONDS = 10
    settings.CLEANUP_RELEASE_BATCH_SIZE = 100
    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 0
    # no measured rate: the floor is cleanup.conf.ASSUMED_SERVICE_TIME_S, 20 messages/s
    sizing._last_sizing.clear()
    return settings
