"""Fixtures of the operations' tests (the capacity plan and the console's gauges)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def capacity_settings(settings: Any) -> Any:
    """No planned peak, no configured per-consumer rate, no headroom: each test sets its own."""
    settings.CLEANUP_CAPACITY_PEAK_ARRIVALS_PER_S = 0
    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 0
    settings.CLEANUP_CAPACITY_HEADROOM = 0
    return settings
