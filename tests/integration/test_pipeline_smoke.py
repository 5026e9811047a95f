"""Scenario 1: 2,000 holds expire across 4 shards; sweeps run on real workers; all released."""

import pytest

from tests.support.fleet import (
    create_eligible_holds,
    invariant_violations,
    outcome_counts,
    released_count,
    sweep_until,
)

pytestmark = [pytest.mark.workers]


def test_every_eligible_hold_is_released_exactly_once_by_real_workers(workers, clean):
    # given
    ids = create_eligible_holds(2000, offerings=8)
    # when: sweeps run as beat would send them, until the backlog is gone
    sweep_until(lambda: released_count(ids) == len(ids), shards=4, timeout=180)
    # then
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts() == {"released": len(ids)}
