"""A task that kills the pool process running it: a stand-in for a poison message (a payload
that segfaults an extension, say). Loaded only by test workers (``celery worker -I``)."""

from __future__ import annotations

import os
from typing import Any

from celery import shared_task

from cleanup.release.delivery import CleanupTask


@shared_task(bind=True, base=CleanupTask, name="tests.poison_kills_worker")
def poison_kills_worker(self: CleanupTask, message: dict[str, Any]) -> None:
    os._exit(13)
