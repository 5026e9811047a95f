"""Private library APIs the code uses where no public one exists, each isolated in one function.
These tests fail loudly when a library upgrade changes them, instead of the product failing
quietly (a beat that never reloads, a metrics compactor that corrupts files)."""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from typing import Any


def test_beat_reload_still_works_through_initial_read_and_heap() -> None:
    # cleanup.pipeline.schedule.LeaderDatabaseScheduler._reload_from_database sets these two.
    from celery.beat import Scheduler
    from django_celery_beat.schedulers import DatabaseScheduler

    scheduler: Any = DatabaseScheduler
    assert "self._initial_read" in inspect.getsource(scheduler.schedule.fget)
    assert "self._heap is None" in inspect.getsource(Scheduler.tick)


def test_beat_still_keeps_its_entries_in_the_schedule_dict() -> None:
    # cleanup.pipeline.schedule.LeaderDatabaseScheduler.reserve writes the sent entry into
    # _schedule, the dict the schedule property returns and the heap is rebuilt from.
    from django_celery_beat.schedulers import DatabaseScheduler

    scheduler: Any = DatabaseScheduler
    assert "return self._schedule" in inspect.getsource(scheduler.schedule.fget)


def test_the_metrics_compactor_can_still_read_and_write_mmap_files() -> None:
    # cleanup.telemetry.worker_metrics.compact reads and writes prometheus_client's multiprocess
    # files.
    from prometheus_client.mmap_dict import MmapedDict

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "counter_1.db")
        out = MmapedDict(path)
        out.write_value("key", 2.5, 0.0)
        out.close()
        values = [(k, v) for k, v, _ts, _pos in MmapedDict.read_all_values_from_file(path)]
    assert values == [("key", 2.5)]


def test_kombu_still_pipelines_a_producer_batch_on_redis() -> None:
    # cleanup.pipeline.publish.publish_release_messages publishes a fan-out inside Producer.batch().
    from kombu import Producer
    from kombu.transport.redis import Channel, Transport

    producer: Any = Producer
    channel: Any = Channel
    assert callable(producer.batch)
    assert Transport.implements.batch_publish
    assert callable(channel.create_publish_batch)


def test_kombu_still_marks_a_restored_redis_message_as_redelivered() -> None:
    # cleanup.tasks.CleanupTask.count_delivery counts only redelivered (or retried) messages.
    from kombu.transport.redis import Channel

    channel: Any = Channel
    source = inspect.getsource(channel._do_restore_message)
    assert "['delivery_info']['redelivered'] = True" in source


def test_django_still_turns_psycopg_preparing_off_by_default() -> None:
    # reservations.db sets prepare_threshold itself because Django passes None.
    from django.db.backends.postgresql import base

    assert '"prepare_threshold"' in inspect.getsource(base.DatabaseWrapper.get_connection_params)
