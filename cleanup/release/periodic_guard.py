"""What the admin refuses in a periodic task of this project: an interval below
``CLEANUP_PERIODIC_MIN_INTERVAL`` and routing to a queue that is not one of the project's.

django-celery-beat lets a staff user give any entry a microsecond interval, or point it at any
queue, exchange or routing key; a project task sent thousands of times a second floods its queue,
and one sent elsewhere never reaches a cleanup worker. The queue names are the ones settings
declare (``CELERY_TASK_QUEUES``), not a second list.
"""

from __future__ import annotations

from typing import Any

from cleanup.broker.celery_app import app
from cleanup.conf import cleanup_settings
from cleanup.wire import TASK_PREFIX


def is_project_task(task: str | None) -> bool:
    return bool(task) and str(task).startswith(TASK_PREFIX)


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
    be saved. Tasks of other applications are not this project's business."""
    if not is_project_task(task):
        return {}
    found: dict[str, str] = {}
    floor = cleanup_settings().periodic_min_interval
    seconds = interval_seconds(interval)
    if seconds is not None and seconds < floor:
        found["interval"] = (
            f"{task} would be sent every {seconds:g} s; tasks of this project run at most once "
            f"every {floor:g} s (CLEANUP_PERIODIC_MIN_INTERVAL). Choose a longer interval."
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
            f"Tasks of this project are routed by queue, not by exchange {exchange!r}: leave it "
            "blank."
        )
    if routing_key and routing_key not in queues:
        found["routing_key"] = (
            f"{routing_key!r} does not route to one of this project's queues ({names}): leave "
            "it blank or name one of them."
        )
    return found
