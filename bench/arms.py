"""How a benchmark gives the processes it runs Django settings that are not environment
variables: the cleanup's tuning settings (``cleanup.conf.tuning``: the release mode, the worker
pools, ...) and Celery's task events. They travel as JSON in ``BENCH_SETTINGS``, which
``bench/settings.py``, the settings module of every process a benchmark starts, reads."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

SETTINGS_MODULE = "bench.settings"
VARIABLE = "BENCH_SETTINGS"


# The benchmark's own tasks (bench/tasks.py) and their queue, declared and routed as the
# product's are (cleanup.conf's CLEANUP_EXTRA_TASK_ROUTES): the broker edge refuses any queue
# that is not declared, and runs each routed task only from its own queue.
QUEUE = "bench"
ROUTES: dict[str, object] = {
    "CLEANUP_EXTRA_TASK_ROUTES": [f"bench.noop={QUEUE}", f"bench.wait={QUEUE}"]
}


def events(on: bool) -> dict[str, object]:
    """Celery's task events on or off (the product sends them: Flower shows nothing without
    them); the benchmarks turn them off unless they measure their cost."""
    return {"CELERY_WORKER_SEND_TASK_EVENTS": on, "CELERY_TASK_SEND_SENT_EVENT": on}


def settings_env(settings: Mapping[str, object]) -> dict[str, str]:
    """The variables that give a process these settings, on top of those this process was
    given (``BENCH_SETTINGS`` in its own environment)."""
    current = json.loads(os.environ.get(VARIABLE) or "{}")
    return {
        "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
        VARIABLE: json.dumps({**current, **settings}),
    }
