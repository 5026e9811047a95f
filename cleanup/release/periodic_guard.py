"""What a periodic task may be, whoever saved it: one of this project's periodic tasks, at an
interval of at least ``CLEANUP_PERIODIC_MIN_INTERVAL``, routed only to the project's queues.

django-celery-beat lets a staff user who may add periodic tasks name any task (Celery's built-in
``celery.backend_cleanup`` too), give it a microsecond interval, or point it at any queue,
exchange or routing key; beat then sends thousands of messages a second, onto whichever queue
the row says. The admin form refuses such a row with the reason on the field to change
(``cleanup.admin.CleanupPeriodicTaskForm``), and beat's scheduler skips, logs and counts one that
reaches the table another way (``cleanup.release.schedule.LeaderDatabaseScheduler``). The queue
names are the ones settings declare (``CELERY_TASK_QUEUES``), not a second list.
"""

from __future__ import annotations

from typing import Any

from cleanup.broker.celery_app import app
from cleanup.conf import cleanup_settings
from cleanup.wire import PRUNE_TASK, RELAY_OUTBOX_TASK, SAMPLE_HEALTH_TASK, SWEEP_TASK

# The tasks this project's schedule sends (cleanup.release.schedule). Releases are sent by
# sweeps, with a hold's id and version, never by beat; Celery's built-ins have no use here (the
# project keeps no task results, so ``celery.backend_cleanup`` has nothing to clean).
PERIODIC_TASKS = (SWEEP_TASK, RELAY_OUTBOX_TASK, PRUNE_TASK, SAMPLE_HEALTH_TASK)


def is_periodic_task(task: str | None) -> bool:
    return task in PERIODIC_TASKS


def project_queues() -> tuple[str, ...]:
    return tuple(queue.name for queue in app.conf.task_queues)


def interval_seconds(interval: Any) -> float | None:
    """Seconds between two sends of an ``IntervalSchedule`` (None for no interval)."""
    if interval is None:
        return None
    return float(interval.schedule.run_every.total_seconds())


def problems(
    task: str | None,
    interval: Any = None,
    queue: str | None = None,
    exchange: str | None = None,
    routing_key: str | None = None,
) -> dict[str, str]:
    """Form field → why it is refused, for a periodic task sending ``task``; empty when it may
    be saved (and sent)."""
    found: dict[str, str] = {}
    if task and not is_periodic_task(task):
        found["task"] = (
            f"{task!r} is not one of this project's periodic tasks "
            f"({', '.join(PERIODIC_TASKS)}): beat sends only those."
        )
    floor = cleanup_settings().periodic_min_interval
    seconds = interval_seconds(interval)
    if seconds is not None and seconds < floor:
        found["interval"] = (
            f"{task or 'This task'} would be sent every {seconds:g} s; periodic tasks run at "
            f"most once every {floor:g} s (CLEANUP_PERIODIC_MIN_INTERVAL). Choose a longer "
            "interval."
        )
    queues = project_queues()
    names = ", ".join(queues)
    if queue and queue not in queues:
        found["queue"] = (
            f"{queue!r} is not one of this project's queues ({names}): no cleanup worker "
            f"consumes it. Leave it blank to route by CELERY_TASK_ROUTES, or pick one of them."
        )
    if exchange:
        found["exchange"] = (
            f"Periodic tasks are routed by queue, not by exchange {exchange!r}: leave it blank."
        )
    if routing_key and routing_key not in queues:
        found["routing_key"] = (
            f"{routing_key!r} does not route to one of this project's queues ({names}): leave "
            "it blank or name one of them."
        )
    return found


def row_problems(row: Any) -> dict[str, str]:
    """``problems`` of a ``PeriodicTask`` row as beat reads it."""
    return problems(row.task, row.interval, row.queue, row.exchange, row.routing_key)
