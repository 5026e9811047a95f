"""The capacity arithmetic against the reference article's example."""

import json

import pytest
from django.core.management import call_command

from cleanup.operations.scaling import capacity


def receipts_of_releases(count: int, duration_ms: float) -> None:
    """Receipts of ``count`` releases made just now, each taking ``duration_ms``."""
    from cleanup.models import CleanupReceipt

    CleanupReceipt.objects.bulk_create(
        CleanupReceipt(
            idempotency_key=f"release:{i}:1",
            reservation_id=i,
            version=1,
            outcome="released",
            duration_ms=duration_ms,
        )
        for i in range(1, count + 1)
    )


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


def test_command_prints_the_arithmetic(capsys):
    call_command(
        "capacity_plan",
        "--holds",
        "12000",
        "--window-seconds",
        "300",
        "--per-worker-rate",
        "20",
        "--utilization",
        "0.7",
    )
    out = capsys.readouterr().out
    assert "12,000 holds / 300 s = 40 msg/s" in out
    assert "at utilization 1.0: ceil(2) = 2 consumers" in out
    assert "= 3 consumers" in out


def test_command_from_a_burst_report(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(
        json.dumps({"capacity_inputs": {"service_time_s": 0.05, "arrival_rate_per_s": 40}})
    )
    call_command("capacity_plan", "--from-report", str(report), "--utilization", "1.0")
    assert "at utilization 1.0: ceil(2) = 2 consumers" in capsys.readouterr().out


def test_the_desired_consumers_gauge_follows_the_measured_rate_and_service_time(db, settings):
    # given: 600 releases in the last minute (10/s), each taking 100 ms, no planned peak
    from cleanup.operations.console.gauges import BacklogCollector

    settings.CLEANUP_CAPACITY_PEAK_ARRIVALS_PER_S = 0
    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 0
    settings.CLEANUP_CAPACITY_HEADROOM = 0
    receipts_of_releases(600, duration_ms=100.0)
    # when
    reading = BacklogCollector().read_desired_consumers()
    # then: 10/s × 0.1 s = 1 busy consumer → ceil(1 / 0.7) = 2
    assert reading == {"desired_consumers": [((), 2.0)]}


def test_the_desired_consumers_gauge_is_absent_without_a_known_service_time(db, settings):
    from cleanup.operations.console.gauges import BacklogCollector

    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 0
    assert BacklogCollector().read_desired_consumers() == {"desired_consumers": []}


# --- the desired_consumers gauge's branches ----------------------------------------------------


@pytest.fixture
def capacity_settings(settings):
    settings.CLEANUP_CAPACITY_PEAK_ARRIVALS_PER_S = 0
    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 0
    settings.CLEANUP_CAPACITY_HEADROOM = 0
    return settings


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


def test_the_collector_measures_backlog_growth_between_scrapes(db, capacity_settings):
    # given: 10/s released at 100 ms each → 1 busy consumer → 2 at 0.7
    from cleanup.operations.console.gauges import BacklogCollector
    from reservations import services
    from tests.support.holds import expire

    receipts_of_releases(600, duration_ms=100.0)
    collector = BacklogCollector()
    collector.refresh()
    assert collector.read_desired_consumers() == {"desired_consumers": [((), 2.0)]}
    # when: 300 holds become eligible before the next scrape
    offering = services.create_offering("growth", 300)
    ids = [services.hold_seat(offering.pk, f"l{i}", 60).pk for i in range(300)]
    expire(*ids)
    collector.refresh()
    # then: the growth (300 holds over the seconds between scrapes) raises the gauge
    (((), value),) = collector._last["desired_consumers"]["desired_consumers"]
    assert value > 2.0
