"""The worker's consumer (cleanup.worker.consumer) refuses a pool without the time limits unless
the settings allow it."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured


def test_a_worker_pool_without_the_time_limits_fails_the_start_unless_allowed(
    settings: Any,
) -> None:
    """The consumer's check on the pool instance Celery hands it (the real pool classes; the
    worker itself: tests/integration/test_failure_paths_real.py)."""
    from celery.concurrency import prefork, solo, thread

    from cleanup.worker.consumer import refuse_unsafe_pool

    # object.__new__: the pool's class is what is checked; nothing is started
    threads, lone, processes = (object.__new__(m.TaskPool) for m in (thread, solo, prefork))
    refuse_unsafe_pool(processes)  # the default: prefork starts
    with pytest.raises(ImproperlyConfigured, match="--pool threads: the threads pool enforces no"):
        refuse_unsafe_pool(threads)
    with pytest.raises(
        ImproperlyConfigured, match=r"--pool solo: .*\(CLEANUP_WORKER_POOLS=prefork\)"
    ):
        refuse_unsafe_pool(lone)
    settings.CLEANUP_WORKER_POOLS = ["prefork", "threads"]
    refuse_unsafe_pool(threads)  # allowed, to measure it
