"""The pool autoscaler (cleanup.operations.scaling.autoscale): its policy (``decide``) on hand-made
readings, the sustained arrivals its reader estimates, and the reader past bad entries planted
in the broker."""

from __future__ import annotations

import pytest
import redis

from cleanup.operations.scaling.autoscale import Policy, Reader, Reading, decide
from tests.support.planted import (
    GOOD_AGE,
    plant_bad_state,
    redis_only,
    skipped,
)

POLICY = Policy(min_procs=1, max_procs=8, slo_seconds=300, slo_target=0.5, cooldown_seconds=60)
NOW = 1000.0


def reading(**kw: object) -> Reading:
    base: dict[str, object] = {"taken_at": NOW, "service_time_s": 0.05}
    base.update(kw)
    return Reading(**base)  # type: ignore[arg-type]


def test_a_backlog_that_would_outlive_the_slo_target_grows_the_pool_to_drain_it_in_time() -> None:
    # 6,000 holds × 0.05 s = 300 process-seconds; 150 s budget − 10 s age → ceil(300/140) = 3
    d = decide(reading(backlog=6000, oldest_eligible_age_s=10), POLICY, 1, NOW)
    assert (d.action, d.target, d.reason, d.fleet_drain) == ("grow", 3, "backlog", 3)


def test_a_backlog_past_the_slo_target_goes_straight_to_max() -> None:
    d = decide(reading(backlog=10, oldest_eligible_age_s=151), POLICY, 2, NOW)
    assert (d.action, d.target, d.reason) == ("grow", 8, "slo_at_risk")


def test_an_old_message_in_a_shallow_queue_grows_the_pool_like_an_old_hold() -> None:
    # given: no eligible hold left in PostgreSQL (all claimed), and a release queue only 10
    # messages deep whose oldest message has waited past the SLO target (150 s of 300 s): the
    # holds in those messages are late whatever the depth says
    late = reading(queue_depth=10, queue_oldest_age_s=151)
    # then: the pool goes straight to its maximum, as for an eligible hold that old
    d = decide(late, POLICY, 1, NOW)
    assert (d.action, d.target, d.reason) == ("grow", 8, "slo_at_risk")
    # and the same queue with a young oldest message is drained by the one process it has
    d = decide(reading(queue_depth=10, queue_oldest_age_s=5), POLICY, 1, NOW)
    assert (d.action, d.target, d.reason) == ("hold", 1, "at_target")


def test_a_backlog_one_process_drains_in_time_keeps_the_pool() -> None:
    d = decide(reading(backlog=500, oldest_eligible_age_s=5), POLICY, 1, NOW)
    assert (d.action, d.target) == ("hold", 1)


def test_the_share_is_divided_among_peers() -> None:
    d = decide(reading(backlog=6000, oldest_eligible_age_s=10, peers=3), POLICY, 1, NOW)
    assert d.target == 1  # ceil(3 / 3)
    d = decide(reading(backlog=60000, oldest_eligible_age_s=10, peers=3), POLICY, 1, NOW)
    assert d.target == 8  # ceil(22 / 3) = 8


def test_sustained_arrivals_use_the_capacity_arithmetic() -> None:
    # 40 msg/s × 0.05 s × 1.5 headroom / 0.7 = 4.3 → 5 consumers
    d = decide(reading(backlog=1, arrival_per_s=40), POLICY, 1, NOW)
    assert (d.target, d.fleet_sustain, d.reason) == (5, 5, "arrivals")


def test_shrinking_waits_for_the_cooldown_of_a_lower_target() -> None:
    idle = reading()
    assert decide(idle, POLICY, 4, NOW, last_change_at=NOW - 100, lower_since=None).action == "hold"
    d = decide(idle, POLICY, 4, NOW, last_change_at=NOW - 100, lower_since=NOW - 30)
    assert (d.action, d.reason) == ("hold", "cooldown")
    d = decide(idle, POLICY, 4, NOW, last_change_at=NOW - 30, lower_since=NOW - 61)
    assert (d.action, d.reason) == ("hold", "cooldown")
    d = decide(idle, POLICY, 4, NOW, last_change_at=NOW - 100, lower_since=NOW - 61)
    assert (d.action, d.target, d.reason) == ("shrink", 1, "idle")


def test_errors_and_stale_readings_keep_the_current_size() -> None:
    assert decide(None, POLICY, 3, NOW).action == "hold"
    d = decide(reading(error="database: timeout"), POLICY, 3, NOW, lower_since=NOW - 999)
    assert (d.action, d.target, d.reason) == ("hold", 3, "read_error")
    d = decide(reading(taken_at=NOW - 31), POLICY, 3, NOW, lower_since=NOW - 999)
    assert (d.action, d.target, d.reason) == ("hold", 3, "stale_reading")


def test_bounds_are_respected() -> None:
    bounded = Policy(min_procs=2, max_procs=3)
    assert decide(reading(backlog=10**6, oldest_eligible_age_s=999), bounded, 2, NOW).target == 3
    d = decide(reading(), bounded, 3, NOW, last_change_at=0, lower_since=0)
    assert d.target == 2


def _reader_with(history: list[tuple[float, int]], halves: tuple[int, int]) -> Reader:
    reader = Reader("me@host", 60, lambda: 2)
    reader._backlog_history.extend(history)
    reader._processed_halves = halves
    return reader


def test_a_steady_stream_counts_as_sustained_arrivals() -> None:
    # 10 holds/s for a minute, all processed, backlog flat at 5
    history = [(float(t), 5) for t in range(0, 61, 5)]
    reader = _reader_with(history, (300, 300))
    assert reader._sustained_arrivals(60.0, 5) == 10.0


def test_a_one_off_burst_is_not_a_stream() -> None:
    # 600 holds landed at t=2, drained by t=40; nothing else arrived
    history = [(0.0, 0), (5.0, 560), (10.0, 480), (30.0, 160), (40.0, 0), (50.0, 0), (60.0, 0)]
    reader = _reader_with(history, (440, 160))
    assert reader._sustained_arrivals(60.0, 0) == 0.0


def test_no_estimate_before_the_window_is_covered() -> None:
    reader = _reader_with([(30.0, 0), (40.0, 0)], (0, 0))
    assert reader._sustained_arrivals(60.0, 0) is None


# --- the reader, past bad entries planted in the broker ---------------------------------------


@redis_only
@pytest.mark.django_db
def test_the_autoscaler_reads_the_good_values_instead_of_an_error(broker: redis.Redis) -> None:
    # given
    plant_bad_state(broker)
    before = skipped("queue_age")
    # when
    reading = Reader("reader-test", 60.0, lambda: 1).read()
    # then: no read_error (which holds the pool), no absurd age (which grows it to max)
    assert reading.error == ""
    assert reading.queue_depth == 3
    assert reading.queue_oldest_age_s == pytest.approx(GOOD_AGE, abs=5)
    assert skipped("queue_age") == before + 2
