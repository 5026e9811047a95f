"""Private library APIs the code uses where no public one exists, each isolated in one function.
These tests fail loudly when a library upgrade changes them, instead of the product failing
quietly (a metrics compactor that corrupts files).

Our subclasses of kombu's Redis transport and of django-celery-beat's scheduler are checked by
the libraries' own test suites instead (scripts/library_suites.py, docs/TESTING.md, "The
libraries' own suites"); the tests below check that those suites follow requirements.txt."""

from __future__ import annotations

import inspect
import tempfile
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.project_scripts import load_script


def _library_suites() -> ModuleType:
    return load_script("library_suites")


def test_the_library_suites_fetch_the_versions_requirements_txt_pins() -> None:
    suites = _library_suites()
    runtime = suites.parse_pins((ROOT / "requirements.txt").read_text())

    pins = suites.check_pins(
        (ROOT / "requirements.txt").read_text(),
        (ROOT / "requirements-library-suites.txt").read_text(),
    )

    assert {name: version for name, (version, _) in pins.items()} == {
        "kombu": runtime["kombu"][0],
        "django-celery-beat": runtime["django-celery-beat"][0],
    }


def test_a_kombu_bump_without_the_suites_lock_fails_naming_both_versions() -> None:
    suites = _library_suites()
    runtime = (ROOT / "requirements.txt").read_text()
    pinned = suites.parse_pins(runtime)["kombu"][0]
    bumped = runtime.replace(f"kombu=={pinned} ", "kombu==9.9.9 ")
    assert bumped != runtime

    with pytest.raises(suites.PinMismatch) as refused:
        suites.check_pins(bumped, (ROOT / "requirements-library-suites.txt").read_text())

    message = str(refused.value)
    assert "kombu" in message and "9.9.9" in message and pinned in message
    assert "django-celery-beat" not in message


def test_a_suites_lock_hash_that_is_not_the_pinned_versions_is_refused() -> None:
    suites = _library_suites()
    lock = (ROOT / "requirements-library-suites.txt").read_text()
    sdist_hash = next(iter(suites.parse_pins(lock)["django-celery-beat"][1]))

    with pytest.raises(suites.PinMismatch, match="django-celery-beat 2"):
        suites.check_pins(
            (ROOT / "requirements.txt").read_text(), lock.replace(sdist_hash, "0" * 64)
        )


def test_the_metrics_compactor_can_still_read_and_write_mmap_files() -> None:
    # cleanup.operations.worker_metrics.compact reads and writes prometheus_client's multiprocess
    # files.
    from prometheus_client.mmap_dict import MmapedDict

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "counter_1.db")
        out = MmapedDict(path)
        out.write_value("key", 2.5, 0.0)
        out.close()
        values = [(k, v) for k, v, _ts, _pos in MmapedDict.read_all_values_from_file(path)]
    assert values == [("key", 2.5)]


def test_django_still_turns_psycopg_preparing_off_by_default() -> None:
    # reservations.db sets prepare_threshold itself because Django passes None.
    from django.db.backends.postgresql import base

    assert '"prepare_threshold"' in inspect.getsource(base.DatabaseWrapper.get_connection_params)


def test_kombu_still_marks_a_restored_redis_message_as_redelivered() -> None:
    # cleanup.release.delivery.CleanupTask.count_delivery counts only redelivered (or retried)
    # messages: kombu's restore must set delivery_info.redelivered on the message it pushes back.
    from unittest.mock import MagicMock

    from kombu.transport import redis
    from kombu.utils.json import loads

    Channel: Any = redis.Channel  # kombu's stubs lack its private helpers
    channel = MagicMock(spec=Channel)
    channel._lookup.return_value = ["cleanup.release"]
    channel._get_message_priority.return_value = 0
    channel._q_for_pri.side_effect = lambda queue, pri: queue
    channel.connection_errors = ()
    pipe = MagicMock()
    payload = {"body": "", "headers": {}, "properties": {"delivery_info": {}}}

    Channel._do_restore_message(channel, payload, "", "cleanup.release", pipe)

    ((queue, pushed),) = [c.args for c in pipe.rpush.call_args_list]
    assert queue == "cleanup.release"
    assert loads(pushed)["properties"]["delivery_info"]["redelivered"] is True


@pytest.mark.django_db(transaction=True)
def test_beat_rereads_every_entry_and_rebuilds_its_heap_when_told_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # cleanup.release.schedule.LeaderDatabaseScheduler._reload_from_database, on taking the
    # lease: `_initial_read = True` makes django-celery-beat's `schedule` re-read every row (the
    # previous leader's last_run_at, written without a change signal), and `_heap = None` makes
    # Celery's `Scheduler.tick` rebuild its heap from them. django-celery-beat's own suite does
    # not notice when either stops working (tried: the reload made a no-op, all passed).
    from django.utils import timezone
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    from config.celery_app import app

    name = "contract: reload"
    hourly, _ = IntervalSchedule.objects.get_or_create(every=3600, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name=name, task="cleanup.prune", interval=hourly, last_run_at=timezone.now()
    )
    scheduler: Any = DatabaseScheduler(app=app)
    monkeypatch.setattr(scheduler, "apply_async", lambda *args, **kwargs: None)  # never sends
    try:
        scheduler.tick()  # builds the heap; nothing is due
        written = timezone.now() - timedelta(minutes=10)
        PeriodicTask.objects.filter(name=name).update(last_run_at=written)  # no change signal
        assert scheduler.schedule[name].last_run_at != written  # not re-read unasked

        scheduler._initial_read = True
        scheduler._heap = None
        assert scheduler.schedule[name].last_run_at == written
        scheduler.tick()
        assert [e.entry.last_run_at for e in scheduler._heap if e.entry.name == name] == [written]
    finally:
        scheduler.close()
