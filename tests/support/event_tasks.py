"""A host project's side of the events queue, for the tests: a task that keeps each event it
is handed (a Redis list of the tests' own broker database), and the consumer step that hands it
each event of the events queue. Loaded only by test workers (``celery worker -I``); the
product's workers never consume the events queue."""

from __future__ import annotations

import json
from typing import Any

from celery import current_app, shared_task

from cleanup.broker.readers import redis_client
from cleanup.conf import cleanup_settings
from cleanup.worker.events_consumer import events_consumer

KEEP_EVENT_TASK = "tests.keep_event"
# Where the task keeps the events it was handed, in order.
KEPT_EVENTS_KEY = "tests:kept-events"


@shared_task(name=KEEP_EVENT_TASK)
def keep_event(event: dict[str, Any]) -> None:
    redis_client().rpush(KEPT_EVENTS_KEY, json.dumps(event))


def kept_events() -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in redis_client().lrange(KEPT_EVENTS_KEY, 0, -1)]


# The project's app refuses a task publish to any queue but its own task queues
# (cleanup.broker.routes), so the host task goes to the maintenance queue.
current_app.steps["consumer"].add(
    events_consumer(current_app, KEEP_EVENT_TASK, queue=cleanup_settings().maintenance_queue)
)
