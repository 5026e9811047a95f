"""The task names on the wire, and the queue each one is routed to.

A task name travels in every message's headers, and messages already in a queue (or in a dead
letter, or in a periodic task's row) carry it: the strings below are a contract with them and
never change. Everything that names a task (the tasks themselves, publishing, the beat schedule,
metrics, the admin's guard, settings' routes) imports it from here.

A leaf module: settings import it at start-up, before any app is loaded.
"""

from __future__ import annotations

from typing import Any, Protocol

TASK_PREFIX = "cleanup."

RELEASE_TASK = "cleanup.release_reservation"
RELEASE_BATCH_TASK = "cleanup.release_batch"
SWEEP_TASK = "cleanup.sweep_shard"
RELAY_OUTBOX_TASK = "cleanup.relay_outbox"
PRUNE_TASK = "cleanup.prune"
SAMPLE_HEALTH_TASK = "cleanup.sample_health"

# The queue each task is routed to, by the name of the setting (``cleanup.conf``) that names it.
QUEUE_SETTING: dict[str, str] = {
    SWEEP_TASK: "sweep_queue",
    RELEASE_TASK: "release_queue",
    RELEASE_BATCH_TASK: "release_queue",
    RELAY_OUTBOX_TASK: "maintenance_queue",
    PRUNE_TASK: "maintenance_queue",
    SAMPLE_HEALTH_TASK: "maintenance_queue",
}
TASKS = tuple(QUEUE_SETTING)


class _Queues(Protocol):  # cleanup.conf.CleanupSettings, without importing it here
    @property
    def sweep_queue(self) -> str: ...
    @property
    def release_queue(self) -> str: ...
    @property
    def maintenance_queue(self) -> str: ...


def task_routes(queues: _Queues) -> dict[str, dict[str, Any]]:
    """``CELERY_TASK_ROUTES`` for the configured queues: each task to its queue, and any other
    task of this project to the maintenance queue."""
    routes: dict[str, dict[str, Any]] = {
        name: {"queue": getattr(queues, setting)} for name, setting in QUEUE_SETTING.items()
    }
    routes[f"{TASK_PREFIX}*"] = {"queue": queues.maintenance_queue}
    return routes
