"""Backlog visibility with real workers: the drained-consumer drill, retries vs transitions,
and worker metrics' scrape time after hundreds of pool-child recycles."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import Client

from cleanup.release.messages import ReleaseMessage
from cleanup.release.publish import publish_release_messages
from cleanup.release.schedule import install_schedule
from cleanup.release.sweep import sweep_shard
from tests.support.fleet import (
    Samples,
    Worker,
    create_eligible_holds,
    free_port,
    parse,
    released_count,
    scalar,
    scrape_worker,
    total,
    wait_until,
)

pytestmark = [pytest.mark.workers, pytest.mark.slow]


def scrape_web(client: Client) -> tuple[Samples, float]:
    started = time.perf_counter()
    response = client.get("/metrics", HTTP_AUTHORIZATION="Bearer drill")
    assert response.status_code == 200
    return parse(response.content.decode()), time.perf_counter() - started


def slo_ages(m: Samples) -> list[float]:
    return [
        v
        for (n, _), v in m.items()
        if n == "reservation_cleanup_oldest_eligible_reservation_age_seconds"
    ]


def slo_alert(m: Samples, slo: float) -> bool:
    """alerts.yml ReservationCleanupSLOBreach: max(oldest_eligible_age) > SLO."""
    return max(slo_ages(m), default=0.0) > slo


def lag_alert(m: Samples, queue: str, max_age: float) -> bool:
    """alerts.yml ReservationCleanupConsumerLag: oldest message age > X and depth > 0."""
    q = (("queue", queue),)
    return (
        m[("reservation_cleanup_queue_oldest_message_age_seconds", q)] > max_age
        and m[("reservation_cleanup_queue_depth", q)] > 0
    )


def metric_worker(tmp_path: Path, name: str, port: int, *extra: str) -> Worker:
    return Worker(
        name,
        2,
        tmp_path / f"{name}.log",
        extra_args=list(extra),
        env_overrides={
            "WORKER_METRICS_PORT": str(port),
            "WORKER_METRICS_ADDR": "127.0.0.1",
            "WORKER_METRICS_DIR": str(tmp_path / "prom"),
        },
        django_settings={"WORKER_METRICS_COMPACT_INTERVAL": 1},
    )


def test_drained_consumer_drill(
    clean: Any,
    exclusive_workers: None,
    tmp_path: Path,
    client: Client,
    report: Any,
    settings: Any,
) -> None:
    settings.METRICS_TOKEN = "drill"  # pytest-django's settings fixture restores it afterwards
    # Each scrape reads the backlog itself, so that two scrapes 4 s apart read it twice (the
    # fleet's shared reading: tests/unit/cleanup/operations/console/test_backlog_reading.py).
    settings.CLEANUP_ELIGIBLE_READING_SECONDS = 0
    install_schedule(2, 3600)
    ids = create_eligible_holds(400, offerings=4, expired_seconds_ago=30)
    # Sweeps run (here in the test process, with the default release mode) but no consumer is
    # running: messages wait. The holds are already 30 s late, past the adaptive mode's 10 s
    # target, so the sweeps put several holds in a message: the queue's depth (in messages) is
    # what they published, and those messages carry every one of the 400 holds. A fleet's floor
    # of 30 messages a second starts 150 within half the target, so the second shard's sweep is
    # not paused behind the first one's 100 messages (docs/PIPELINE.md, "Release modes").
    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 30
    sweeps = [sweep_shard(shard, 2, trace_id=f"drill-{shard}") for shard in range(2)]
    first, t1 = scrape_web(client)
    time.sleep(4)
    second, t2 = scrape_web(client)

    q = (("queue", "cleanup"),)
    assert sum(s.published for s in sweeps) == 400
    assert sorted(i for s in sweeps for i in s.published_ids) == sorted(ids)
    published_messages = sum(s.messages for s in sweeps)
    assert 0 < published_messages <= 400
    assert second[("reservation_cleanup_queue_depth", q)] == published_messages
    age1 = first[("reservation_cleanup_queue_oldest_message_age_seconds", q)]
    age2 = second[("reservation_cleanup_queue_oldest_message_age_seconds", q)]
    assert age2 >= age1 + 3.5
    assert min(slo_ages(second)) >= min(slo_ages(first)) + 3.5 >= 33
    # The SLO rule (scaled: SLO 20 s, for 3 s) is true at both scrapes, 4 s apart: it fires.
    assert slo_alert(first, 20) and slo_alert(second, 20)
    assert lag_alert(second, "cleanup", 3)

    port = free_port()
    worker = metric_worker(tmp_path, "drill", port).start()
    try:
        worker.wait_ready()
        wait_until(lambda: released_count(ids) == len(ids), timeout=120, what="drain")
        third, t3 = scrape_web(client)
        assert max(slo_ages(third)) == 0
        assert third[("reservation_cleanup_queue_depth", q)] == 0
        assert third[("reservation_cleanup_queue_oldest_message_age_seconds", q)] == 0
        assert not slo_alert(third, 20) and not lag_alert(third, "cleanup", 3)
        wm, _ = scrape_worker(port)
        assert total(wm, "reservation_cleanup_transitions_total") == 400
        assert total(wm, "reservation_cleanup_outcomes_total", outcome="released") == 400
    finally:
        worker.stop()
    report(
        "drill",
        slo_age_s=[round(max(slo_ages(x)), 1) for x in (first, second, third)],
        queue_age_s=[
            round(x[("reservation_cleanup_queue_oldest_message_age_seconds", q)], 1)
            for x in (first, second, third)
        ],
        depth=[x[("reservation_cleanup_queue_depth", q)] for x in (first, second, third)],
        holds=400,
        messages=published_messages,
        web_scrape_ms=[round(t * 1000, 1) for t in (t1, t2, t3)],
    )


TRANSIENT_TRIGGER = """
CREATE SEQUENCE IF NOT EXISTS obs_test_failures;
CREATE OR REPLACE FUNCTION obs_test_fail_release() RETURNS trigger AS $$
BEGIN
  IF nextval('obs_test_failures') <= %(n)s THEN
    RAISE EXCEPTION 'injected serialization failure' USING ERRCODE = '40001';
  END IF;
  RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER obs_test_fail_release BEFORE UPDATE ON reservations_reservation
  FOR EACH ROW WHEN (NEW.status = 'released') EXECUTE FUNCTION obs_test_fail_release();
"""


def test_retries_add_to_attempts_and_retries_not_transitions(
    clean: Any, exclusive_workers: None, tmp_path: Path, report: Any
) -> None:
    ids = create_eligible_holds(60, offerings=2, expired_seconds_ago=30)
    injected = 25
    with connection.cursor() as cur:
        cur.execute(TRANSIENT_TRIGGER % {"n": injected})
    port = free_port()
    worker = metric_worker(tmp_path, "retry", port).start()
    try:
        worker.wait_ready()
        sweep_shard(0, 1, trace_id="retry-drill")
        wait_until(lambda: released_count(ids) == len(ids), timeout=120, what="releases")
        wm = wait_until(
            lambda: (
                m
                if total((m := scrape_worker(port)[0]), "reservation_cleanup_outcomes_total")
                >= len(ids)
                else None
            ),
            timeout=30,
        )
    finally:
        worker.stop()
        with connection.cursor() as cur:
            cur.execute(
                "DROP TRIGGER IF EXISTS obs_test_fail_release ON reservations_reservation; "
                "DROP FUNCTION IF EXISTS obs_test_fail_release(); "
                "DROP SEQUENCE IF EXISTS obs_test_failures"
            )
    attempts = total(wm, "reservation_cleanup_delivery_attempts_total")
    retries = total(wm, "reservation_cleanup_retries_total")
    transitions = total(wm, "reservation_cleanup_transitions_total")
    assert retries == injected
    assert attempts == len(ids) + injected
    assert transitions == len(ids)
    assert scalar("SELECT count(*) FROM cleanup_cleanupreceipt WHERE outcome='released'") == 60
    report("retries", attempts=attempts, retries=retries, transitions=transitions)


# Its own deadline: 200 recycles take about 3 minutes here, more on a busy machine; the
# waits inside (worker start 90 s, recycles 420 s, compaction 60 s) end before it, so a stuck
# run fails with what it was waiting for rather than with pytest-timeout's traceback.
@pytest.mark.timeout(600)
def test_scrape_time_stays_bounded_after_hundreds_of_child_recycles(
    clean: Any, exclusive_workers: None, tmp_path: Path, report: Any
) -> None:
    port = free_port()
    worker = metric_worker(tmp_path, "recycle", port, "--max-tasks-per-child", "1").start()
    prom = tmp_path / "prom"
    n = 200  # ~1 recycle/s on a 2-core machine: 200 recycles take about 3 minutes
    try:
        worker.wait_ready()
        # Tiny tasks: release messages for holds that do not exist (outcome not_found).
        messages = [
            ReleaseMessage.for_hold(1_000_000 + i, 1, _past(), 0, f"recycle-{i}") for i in range(n)
        ]
        publish_release_messages(messages)
        samples: list[tuple[float, int, float]] = []

        def progress() -> bool:
            m, took = scrape_worker(port)
            done = total(m, "reservation_cleanup_outcomes_total", outcome="not_found")
            files = len(list(prom.rglob("*.db")))
            samples.append((done, files, took))
            return done >= n

        wait_until(progress, timeout=420, interval=1.0, what="recycled tasks")
        # once the pool is quiet, compaction (every second) brings the files down
        wait_until(lambda: len(list(prom.rglob("*.db"))) <= 12, timeout=60, what="files compacted")
        m, took = scrape_worker(port)
        files = len(list(prom.rglob("*.db")))
    finally:
        worker.stop()
    times = sorted(t for _, _, t in samples)
    report(
        "recycles",
        tasks=n,
        files_after=files,
        max_files_seen=max(f for _, f, _ in samples),
        scrapes=len(samples),
        median_scrape_ms=round(times[len(times) // 2] * 1000, 1),
        max_scrape_ms=round(times[-1] * 1000, 1),
        final_scrape_ms=round(took * 1000, 1),
    )
    assert total(m, "reservation_cleanup_outcomes_total", outcome="not_found") == n
    assert total(m, "reservation_cleanup_delivery_attempts_total") == n
    # Without compaction: 2 files (counter + histogram) per recycled child, ~400 here.
    # Between compaction passes (every second) the files of children that exited meanwhile
    # accumulate: a few recycles' worth, never the whole history.
    assert max(f for _, f, _ in samples) <= 40
    assert files <= 12, files
    # Scrape times (above, in the report) are measurements on a shared machine, not limits:
    # what keeps a scrape cheap is the bounded file count asserted here.


def _past() -> Any:
    from datetime import UTC, datetime, timedelta

    return datetime.now(UTC) - timedelta(minutes=1)


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Any:
    def _report(name: str, **values: Any) -> None:
        line = f"[obs-report] {name}: " + ", ".join(f"{k}={v}" for k, v in values.items())
        print(line)
        path = Path(__file__).resolve().parents[2] / "var" / "obs-report.txt"
        path.parent.mkdir(parents=True, exist_ok=True)  # var/ is not in a fresh clone
        with path.open("a") as fh:
            fh.write(line + "\n")

    return _report
