"""The capacity arithmetic against the reference article's example."""

import pytest

from cleanup.operations.scaling import capacity


def test_article_example_is_40_per_second_and_2_or_3_consumers():
    # given: 12,000 holds eligible within 5 minutes, 20 releases/s per worker
    result = capacity.plan(holds=12000, window_seconds=300, per_worker_rate=20, utilization=0.7)
    # then
    assert result.arrival_rate_per_s == pytest.approx(40)
    assert result.service_time_s == pytest.approx(0.05)
    assert result.offered_load == pytest.approx(2)
    assert result.consumers_at_full_utilization == 2
    assert result.consumers_at_target == 3


def test_retry_headroom_and_the_loss_of_one_node():
    result = capacity.plan(
        holds=12000,
        window_seconds=300,
        per_worker_rate=20,
        utilization=0.7,
        retry_ratio=0.25,
        consumers_per_node=2,
    )
    # 2 × 1.25 / 0.7 = 3.57 → 4 consumers → 2 nodes, + 1 for a lost node = 3 nodes = 6
    assert result.consumers_with_retries == 4
    assert result.nodes_for_load == 2
    assert result.nodes == 3
    assert result.consumers_total == 6


def test_desired_consumers_function():
    assert capacity.compute_desired_consumers(40, 0.05, 1.0) == 2
    assert capacity.compute_desired_consumers(40, 0.05, 0.7) == 3
    assert capacity.compute_desired_consumers(0, 0.05, 0.7) == 0
    with pytest.raises(ValueError):
        capacity.compute_desired_consumers(40, 0.05, 0)


# --- the desired_consumers gauge's branches ----------------------------------------------------


def test_a_configured_per_consumer_rate_is_the_service_time(capacity_settings):
    from cleanup.operations.scaling.capacity import desired_consumers

    capacity_settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 20
    # 2,400 processed in the 60 s window = 40/s; 1/20 s each (the receipts' 500 ms is ignored):
    # 40 × 0.05 / 0.7 = 2.86 → 3
    assert desired_consumers(2400, 500.0, 0.0) == 3
    # without it, the receipts' mean duration is the service time: 40 × 0.5 / 0.7 = 28.6 → 29
    capacity_settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 0
    assert desired_consumers(2400, 500.0, 0.0) == 29


def test_the_planned_peak_counts_when_it_is_above_the_measured_rate(capacity_settings):
    from cleanup.operations.scaling.capacity import desired_consumers

    capacity_settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 20
    capacity_settings.CLEANUP_CAPACITY_PEAK_ARRIVALS_PER_S = 40
    assert desired_consumers(60, None, 0.0) == 3  # planned 40/s beats the measured 1/s
    capacity_settings.CLEANUP_CAPACITY_PEAK_ARRIVALS_PER_S = 1
    assert desired_consumers(2400, None, 0.0) == 3  # measured 40/s beats the planned 1/s
    assert desired_consumers(0, None, 0.0) == 1  # idle: the planned 1/s still needs one


def test_a_growing_backlog_adds_to_the_arrival_rate_and_a_shrinking_one_does_not(
    capacity_settings,
):
    from cleanup.operations.scaling.capacity import desired_consumers

    # 600 processed in 60 s = 10/s at 50 ms: 10 × 0.05 / 0.7 = 0.71 → 1
    assert desired_consumers(600, 50.0, 0.0) == 1
    # and 30/s more piling up: 40/s → 3
    assert desired_consumers(600, 50.0, 30.0) == 3
    # a backlog shrinking by 100/s does not lower the measured arrivals below what was done
    assert desired_consumers(600, 50.0, -100.0) == 1


def test_headroom_scales_the_arrival_rate(capacity_settings):
    from cleanup.operations.scaling.capacity import desired_consumers

    capacity_settings.CLEANUP_CAPACITY_HEADROOM = 0.5
    # 40/s × 1.5 × 0.05 / 0.7 = 4.29 → 5
    assert desired_consumers(2400, 50.0, 0.0) == 5


def test_no_service_time_known_means_no_gauge(capacity_settings):
    from cleanup.operations.scaling.capacity import desired_consumers

    assert desired_consumers(2400, None, 30.0) is None
