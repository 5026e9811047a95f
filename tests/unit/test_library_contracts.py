"""Private library APIs the code uses where no public one exists, each isolated in one function.
These tests fail loudly when a library upgrade changes them, instead of the product failing
quietly (a beat that never reloads, a metrics compactor that corrupts files)."""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from typing import Any


def test_beat_reload_still_works_through_initial_read_and_heap() -> None:
    # cleanup.schedule.LeaderDatabaseScheduler._reload_from_database sets these two.
    from celery.beat import Scheduler
    from django_celery_beat.schedulers import DatabaseScheduler

    scheduler: Any = DatabaseScheduler
    assert "self._initial_read" in inspect.getsource(scheduler.schedule.fget)
    assert "self._heap is None" in inspect.getsource(Scheduler.tick)


def test_the_metrics_compactor_can_still_read_and_write_mmap_files() -> None:
    # cleanup.observability.compact reads and writes prometheus_client's multiprocess files.
    from prometheus_client.mmap_dict import MmapedDict

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "counter_1.db")
        out = MmapedDict(path)
        out.write_value("key", 2.5, 0.0)
        out.close()
        values = [(k, v) for k, v, _ts, _pos in MmapedDict.read_all_values_from_file(path)]
    assert values == [("key", 2.5)]
