"""A real ``celery beat`` (cleanup.release.schedule:LeaderDatabaseScheduler) against periodic-task
rows written straight into the table, past the admin form (cleanup.release.periodic_guard):

- a Celery built-in and a project task at 1 µs, one of them onto the release queue, are skipped
  and logged, never sent; an acceptable row beside them is sent as usual;
- a schedule of many due entries is sent at no more than CLEANUP_BEAT_MAX_SENDS_PER_SECOND, the
  excess deferred (every entry is still sent) and the deferral logged with its count.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.utils import timezone
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from cleanup.broker import readers as broker
from cleanup.wire import SAMPLE_HEALTH_TASK
from tests.support.fleet import Beat, beats, wait_until

pytestmark = [pytest.mark.workers]

_STAMP = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)[.,](\d{3})")
_ENTRY = re.compile(r"Sending due task (.+?) \(")


@pytest.fixture
def beat_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("beat-guard")


@pytest.fixture
def no_periodic_tasks(clean: None) -> Iterator[None]:
    PeriodicTask.objects.all().delete()
    yield
    PeriodicTask.objects.all().delete()


def _plant(name: str, task: str, every: int, period: str, queue: str) -> None:
    """A row as a script or a SQL shell would write it: no form, no check; last run a minute
    ago, so it is due as soon as beat reads it."""
    interval, _ = IntervalSchedule.objects.get_or_create(every=every, period=period)
    PeriodicTask.objects.create(
        name=name, task=task, interval=interval, queue=queue,
        last_run_at=timezone.now() - timedelta(minutes=1),
    )  # fmt: skip


def _sends(beat: Beat, prefix: str = "") -> list[tuple[float, str]]:
    """(when, entry) of each send the beat logged, in order."""
    found = []
    for line in beat.lines(f"Sending due task {prefix}"):
        stamp, entry = _STAMP.search(line), _ENTRY.search(line)
        assert stamp and entry, line
        when = datetime.fromisoformat(f"{stamp[1]}T{stamp[2]}.{stamp[3]}").replace(tzinfo=UTC)
        found.append((when.timestamp(), entry[1]))
    return found


def test_rows_planted_past_the_form_are_skipped_by_a_real_beat(no_periodic_tasks, beat_logs):
    # given: Celery's built-in onto the release queue and a project task, both every 1 µs, and
    # one acceptable entry, all written straight into the table
    _plant("flood", "celery.backend_cleanup", 1, IntervalSchedule.MICROSECONDS, "cleanup")
    _plant("fast prune", "cleanup.prune", 1, IntervalSchedule.MICROSECONDS, "maintenance")
    _plant("sample", SAMPLE_HEALTH_TASK, 1, IntervalSchedule.SECONDS, "maintenance")
    with beats(beat_logs, 1) as (beat,):
        # when: beat leads for a few sends of the acceptable entry
        wait_until(beat.is_leader, timeout=60, what="beat lock acquired")
        wait_until(lambda: len(_sends(beat, "sample")) >= 3, timeout=30, what="3 sample sends")
        # then: the two others were never sent, each refused in the log with its reason
        sends = _sends(beat)
        refused = beat.lines("periodic task refused")
    sent = {entry for _, entry in sends}
    assert sent == {"sample"}
    assert any("entry=flood" in line and "celery.backend_cleanup" in line for line in refused)
    assert any("fast prune" in line and "CLEANUP_PERIODIC_MIN_INTERVAL" in line for line in refused)
    assert broker.queue_depth("cleanup") == 0
    print(f"\nplanted rows: {len(refused)} refusals logged; sends: {len(sends)}, all 'sample'")


ENTRIES = 40
BOUND = 10


def test_many_due_entries_are_sent_within_the_bound_per_second(no_periodic_tasks, beat_logs):
    # given: 40 entries every second (40 sends a second asked), and a bound of 10 a second
    for k in range(ENTRIES):
        _plant(f"sample {k}", SAMPLE_HEALTH_TASK, 1, IntervalSchedule.SECONDS, "maintenance")
    settings = {"CLEANUP_BEAT_MAX_SENDS_PER_SECOND": BOUND}
    with beats(beat_logs, 1, django_settings=settings) as (beat,):
        wait_until(beat.is_leader, timeout=60, what="beat lock acquired")
        wait_until(lambda: len(_sends(beat)) >= 1, timeout=30, what="a first send")
        time.sleep(6)
        sends = _sends(beat)
        deferred = beat.lines("beat sends deferred")
    times = [t for t, _ in sends]
    # then: no second (by the beat's own log stamps, to the millisecond) holds more than the
    # bound; the excess was deferred, not dropped: every entry was sent; and beat said so
    busiest = max(sum(1 for u in times if t <= u < t + 1.0) for t in times)
    span = times[-1] - times[0]
    print(f"\n{len(sends)} sends in {span:.2f} s, busiest second {busiest}, bound {BOUND}")
    assert busiest <= BOUND
    assert len(sends) >= BOUND * 4  # sends went on at the bound, not fewer
    assert {entry for _, entry in sends} == {f"sample {k}" for k in range(ENTRIES)}
    assert deferred and "deferred_total=" in deferred[0]
