"""The per-minute tally of release attempts (cleanup.release.delivery_cap) reaches Redis within
seconds, with no flush by hand."""

from __future__ import annotations

import time
from typing import Any

import pytest

from cleanup.release import delivery_cap

pytestmark = pytest.mark.django_db(transaction=True)


def test_release_attempts_are_tallied_per_hold_and_reach_redis_within_seconds(
    settings: Any,
) -> None:
    assert settings.CLEANUP_COUNTER_REDIS_URL, "the tally lives in the counter's Redis"
    minute = delivery_cap.current_minute()
    delivery_cap.flush_tally()
    before = delivery_cap.attempts_from(minute)
    # when: three attempts are tallied, and nothing flushes them by hand
    delivery_cap.tally(3)
    # then: the process's flush thread adds them within a few seconds
    deadline = time.monotonic() + 5
    while delivery_cap.attempts_from(minute) - before < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert delivery_cap.attempts_from(minute) - before == 3
