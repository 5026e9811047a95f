"""What the health page reads (cleanup.operations.console.health): the broker's good values,
past bad entries planted beside them."""

from __future__ import annotations

import pytest
import redis

from cleanup.operations.console import health
from tests.support.planted import (
    GOOD_AGE,
    plant_bad_state,
    redis_only,
)

pytestmark = redis_only


@pytest.mark.django_db
def test_the_health_page_reads_the_good_values_instead_of_an_error(broker: redis.Redis) -> None:
    # given
    plant_bad_state(broker)
    # when
    page = health.collect(with_workers=False)
    # then
    assert page.queue_error == ""
    assert page.queue is not None
    assert page.queue.oldest_age_seconds == pytest.approx(GOOD_AGE, abs=5)
    assert (page.queue.depth, page.queue.unacked) == (3, 1)
