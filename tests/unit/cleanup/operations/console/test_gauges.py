"""The scrape-time gauges of /metrics (cleanup.operations.console.gauges): equal to SQL ground
truth with the capped count, a failing section keeping its last value, the SLO setting, the
queues read past bad broker entries, desired consumers from the measured rate, open dead
letters against their cap, the pause switch, and each enabled shard's interval and last sweep."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from django.db import connection
from django.db.models.functions import Now
from django.test import Client
from django_celery_beat.models import PeriodicTask
from prometheus_client.parser import text_string_to_metric_families

from cleanup.models import CleanupReceipt, CleanupSchedule, SweepRecord
from cleanup.operations import triage
from cleanup.operations.console.gauges import BacklogCollector
from cleanup.release import periodic_guard
from cleanup.release.schedule import install_schedule, sweep_entry_name
from cleanup.release.sweep import SweepResult, record_last_sweep
from reservations import services
from reservations.db import rows
from tests.support.dead_letters import MALFORMED, letter
from tests.support.fleet import create_eligible_holds
from tests.support.holds import expire
from tests.support.metrics import age_the_reading, pause_gauges, scrape
from tests.support.planted import (
    GOOD_AGE,
    QUEUE,
    plant_bad_state,
    redis_only,
    skipped,
)
from tools.seed import seed_holds

# --- the queues, past bad entries planted in the broker ---------------------------------------


@redis_only
def test_the_metrics_collector_exports_the_good_values(broker: redis.Redis) -> None:
    # given
    plant_bad_state(broker)
    before = skipped("queue_age") + skipped("unacked_count")
    # when
    queues = BacklogCollector.read_queues()
    # then
    assert dict(queues["queue_depth"])[(QUEUE,)] == 3
    assert dict(queues["queue_oldest_message_age_seconds"])[(QUEUE,)] == pytest.approx(
        GOOD_AGE, abs=5
    )
    assert dict(queues["queue_unacked"])[(QUEUE,)] == 1
    assert skipped("queue_age") + skipped("unacked_count") > before


# --- desired consumers, from the measured rate and service time -------------------------------


def receipts_of_releases(count: int, duration_ms: float) -> None:
    """Receipts of ``count`` releases made just now, each taking ``duration_ms``."""

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


def test_the_collector_measures_backlog_growth_between_scrapes(db, capacity_settings):
    # given: 10/s released at 100 ms each → 1 busy consumer → 2 at 0.7
    from cleanup.operations.console.gauges import BacklogCollector

    receipts_of_releases(600, duration_ms=100.0)
    collector = BacklogCollector()
    collector.refresh()
    assert collector.read_desired_consumers() == {"desired_consumers": [((), 2.0)]}
    # when: 300 holds become eligible before the next scrape
    offering = services.create_offering("growth", 300)
    ids = [services.hold_seat(offering.pk, f"l{i}", 60).pk for i in range(300)]
    expire(*ids)
    collector.refresh()
    # (the same fleet reading again: no new growth yet)
    (((), value),) = collector._last["desired_consumers"]["desired_consumers"]
    assert value == 2.0
    age_the_reading(10)
    collector.refresh()
    # then: the growth (300 holds over the seconds between readings) raises the gauge
    (((), value),) = collector._last["desired_consumers"]["desired_consumers"]
    assert value > 2.0


# --- open dead letters against their cap ------------------------------------------------------


def test_metrics_export_the_open_letters_against_the_cap_and_discarding_clears_them(
    client, db, broker, settings
):
    settings.METRICS_TOKEN = "t"
    settings.CLEANUP_DEAD_LETTER_OPEN_CAP = 7

    def scrape() -> dict[tuple[str, str], float]:
        response = client.get("/metrics", HTTP_AUTHORIZATION="Bearer t")
        assert response.status_code == 200
        return {
            (s.name, s.labels.get("reason", "")): s.value
            for family in text_string_to_metric_families(response.content.decode())
            for s in family.samples
            if s.name.startswith("reservation_cleanup_dead_letters_open")
        }

    letters = [letter(MALFORMED), letter(MALFORMED)]
    before = scrape()
    assert before[("reservation_cleanup_dead_letters_open", "malformed")] == 2
    assert before[("reservation_cleanup_dead_letters_open_cap", "")] == 7
    triage.discard(letters, by="ivan", why="seen")
    assert scrape()[("reservation_cleanup_dead_letters_open", "malformed")] == 0


# --- the backlog against SQL ground truth, a failing section, the SLO -------------------------


def truth_oldest(shards: int, k: int) -> float:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(expires_at)), 0)::float8 "
            "FROM reservations_reservation WHERE status='held' AND expires_at <= now() "
            "AND bucket %% %s = %s",
            [shards, k],
        )
        return float(cur.fetchone()[0])


def truth_count(shards: int, k: int) -> int:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM reservations_reservation WHERE status='held' "
            "AND expires_at <= now() AND bucket %% %s = %s",
            [shards, k],
        )
        return int(cur.fetchone()[0])


@pytest.mark.usefixtures("broker")
@pytest.mark.django_db(transaction=True)
def test_gauges_equal_sql_ground_truth_and_count_caps(client: Client, settings) -> None:
    from cleanup.release.schedule import install_schedule

    settings.METRICS_TOKEN = "t"
    install_schedule(4, 10)
    # expired 2 to 32 minutes ago (hold p: 120 + 6p s), every shard holding old and recent
    # ones, so the oldest and the newest of a shard are far apart
    seed_holds(300, offerings=3, expires_in=lambda p: -(120.0 + 6.0 * p), name="gauges")
    ids_fresh = create_eligible_holds(40, offerings=1, expired_seconds_ago=30)
    with connection.cursor() as cur:  # 40 not yet expired: not eligible
        cur.execute(
            "UPDATE reservations_reservation SET expires_at = now() + interval '1 hour', "
            "next_attempt_at = now() + interval '1 hour' WHERE id = ANY(%s)",
            [ids_fresh],
        )
    settings.CLEANUP_ELIGIBLE_COUNT_CAP = 1000

    before = [truth_oldest(4, k) for k in range(4)]
    m = scrape(client, "t")
    after = [truth_oldest(4, k) for k in range(4)]

    for k in range(4):
        shard = (("shard", str(k)),)
        got = m[("reservation_cleanup_oldest_eligible_reservation_age_seconds", shard)]
        # the age of the shard's oldest eligible hold when the scrape read it: between the
        # ages SQL reads just before and just after the scrape, however long the scrape took
        assert before[k] <= got <= after[k], (k, before[k], got, after[k])
        assert m[("reservation_cleanup_eligible_reservations", shard)] == truth_count(4, k)
        assert m[("reservation_cleanup_eligible_reservations_capped", shard)] == 0
    assert sum(truth_count(4, k) for k in range(4)) == 300
    q = (("queue", "cleanup"),)
    assert m[("reservation_cleanup_queue_depth", q)] == 0
    assert m[("reservation_cleanup_queue_oldest_message_age_seconds", q)] == 0
    assert m[("reservation_cleanup_dead_letters_open", (("reason", "malformed"),))] == 0
    assert ("reservation_cleanup_outbox_oldest_unpublished_age_seconds", ()) in m
    assert any(name == "process_cpu_seconds_total" for name, _ in m)  # the process's own

    settings.CLEANUP_ELIGIBLE_COUNT_CAP = 10
    m = scrape(client, "t")
    for k in range(4):
        shard = (("shard", str(k)),)
        assert m[("reservation_cleanup_eligible_reservations", shard)] == 10
        assert m[("reservation_cleanup_eligible_reservations_capped", shard)] == 1


@pytest.mark.usefixtures("broker")
@pytest.mark.django_db(transaction=True)
def test_a_failing_section_keeps_its_last_value_and_counts_an_error(settings) -> None:
    create_eligible_holds(5, offerings=1, expired_seconds_ago=100)
    collector = BacklogCollector()
    first = {m.name: m for m in collector.collect()}
    age = first["reservation_cleanup_oldest_eligible_reservation_age_seconds"].samples[0].value
    assert age >= 100
    settings.METRICS_STATEMENT_TIMEOUT_MS = 1
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(1)")
    # A statement that sleeps past the 1 ms timeout stands in for a slow backlog query.
    original = collector.read_eligible

    def slow() -> dict:
        def run() -> dict:
            rows("SELECT pg_sleep(0.1)")
            return {}

        return collector._db(run)

    collector.read_eligible = slow  # type: ignore[method-assign]
    second = {m.name: m for m in collector.collect()}
    collector.read_eligible = original  # type: ignore[method-assign]
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_unlock(1)")
    kept = second["reservation_cleanup_oldest_eligible_reservation_age_seconds"].samples[0].value
    assert kept == age
    errors = {
        s.labels["collector"]: s.value for s in second["reservation_cleanup_scrape_errors"].samples
    }
    assert errors["eligible"] == 1 and errors["queues"] == 0
    # The per-scrape gauge (what the alert counts): 1 for the failed section in this scrape,
    # back to 0 in the next good scrape.
    failed = {
        s.labels["collector"]: s.value for s in second["reservation_cleanup_scrape_failed"].samples
    }
    assert failed["eligible"] == 1 and failed["queues"] == 0
    settings.METRICS_STATEMENT_TIMEOUT_MS = 2000
    third = {m.name: m for m in collector.collect()}
    failed = {
        s.labels["collector"]: s.value for s in third["reservation_cleanup_scrape_failed"].samples
    }
    assert set(failed.values()) == {0.0}


@pytest.mark.usefixtures("broker")
@pytest.mark.django_db
def test_the_slo_setting_is_exported_for_the_rules_and_dashboards(client: Client, settings) -> None:
    settings.METRICS_TOKEN = "t" * 40
    settings.CLEANUP_SLO_SECONDS = 45
    metrics = scrape(client, "t" * 40)
    assert metrics[("reservation_cleanup_slo_seconds", ())] == 45


# --- the pause switch -------------------------------------------------------------------------


@pytest.mark.django_db
def test_before_anyone_paused_the_gauges_read_running(db: None) -> None:
    assert pause_gauges() == {
        "reservation_cleanup_releases_paused": 0,
        "reservation_cleanup_releases_paused_seconds": 0,
    }


# --- the sweeps ---------------------------------------------------------------------------------


def _sweep_gauges(client: Client) -> dict[tuple[str, str], float]:
    metrics = scrape(client, "t" * 40)
    return {
        (name.removeprefix("reservation_cleanup_"), dict(labels)["shard"]): value
        for (name, labels), value in metrics.items()
        if name.endswith(("_last_sweep_age_seconds", "_sweep_interval_seconds"))
    }


@pytest.mark.usefixtures("broker")
@pytest.mark.django_db
def test_each_enabled_shard_exports_its_interval_and_how_long_ago_its_last_sweep_finished(
    client: Client, settings
) -> None:
    settings.METRICS_TOKEN = "t" * 40
    # given: three shards every 2 s, saved ten minutes ago; shard 0 swept just now, shard 1
    # five minutes ago, shard 2 never under this N (its sweeps never ran to their end)
    install_schedule(shards=3, every=2)
    CleanupSchedule.objects.update(updated_at=Now() - timedelta(minutes=10))
    for shard in (0, 1):
        record_last_sweep(SweepResult(shard, 3, "trace"))
    SweepRecord.objects.filter(shard=1).update(finished_at=Now() - timedelta(minutes=5))
    # when
    found = _sweep_gauges(client)
    # then
    assert {k: v for k, v in found.items() if k[0] == "sweep_interval_seconds"} == {
        ("sweep_interval_seconds", "0"): 2,
        ("sweep_interval_seconds", "1"): 2,
        ("sweep_interval_seconds", "2"): 2,
    }
    assert found[("last_sweep_age_seconds", "0")] == pytest.approx(0, abs=5)
    assert found[("last_sweep_age_seconds", "1")] == pytest.approx(300, abs=5)
    assert found[("last_sweep_age_seconds", "2")] == pytest.approx(600, abs=5)
    # when: shard 1's entry is disabled (on purpose): nothing is exported for it
    PeriodicTask.objects.filter(name=sweep_entry_name(1, 3)).update(enabled=False)
    assert {shard for _, shard in _sweep_gauges(client)} == {"0", "2"}
    # when: shard 2's entry is rewritten past the admin's form to a queue beat refuses: beat
    # skips it, so it is still exported, and its age goes on growing
    PeriodicTask.objects.filter(name=sweep_entry_name(2, 3)).update(queue="elsewhere")
    assert periodic_guard.row_problems(PeriodicTask.objects.get(name=sweep_entry_name(2, 3)))
    assert _sweep_gauges(client)[("last_sweep_age_seconds", "2")] == pytest.approx(600, abs=5)


@pytest.mark.usefixtures("broker")
@pytest.mark.django_db
def test_without_a_schedule_no_sweep_gauge_is_exported(client: Client, settings) -> None:
    settings.METRICS_TOKEN = "t" * 40
    assert _sweep_gauges(client) == {}
