"""gunicorn's settings for the web, read from the working directory by every gunicorn started
at the checkout's root (the image's /app, the tests), whatever its command line says.

Request metrics in multiprocess mode: each worker process writes its counters to files in
``PROMETHEUS_MULTIPROC_DIR`` and ``/metrics`` adds them up (cleanup.operations.console.endpoints),
so a scrape answered by any worker shows all of them. prometheus_client chooses the mode when a
worker first imports it, so the variable is set here, in the master, before any worker forks.
The directory is ``WEB_METRICS_DIR`` (a directory of its own: it is emptied at start) or one
under the system's temporary directory named after the master's pid; a worker that exits has
its live gauges dropped (``mark_process_dead``), its counters kept.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

_configured = os.environ.get("WEB_METRICS_DIR", "")
METRICS_DIR = Path(_configured or tempfile.gettempdir()) / (
    "" if _configured else f"reservation-web-metrics-{os.getpid()}"
)
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(METRICS_DIR)


def on_starting(server: Any) -> None:
    # A reused directory would add a previous run's counts (and a reused pid's) to this one's.
    shutil.rmtree(METRICS_DIR, ignore_errors=True)
    METRICS_DIR.mkdir(parents=True, exist_ok=True)


def child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess  # noqa: PLC0415 - after the variable is set

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server: Any) -> None:
    if not _configured:
        shutil.rmtree(METRICS_DIR, ignore_errors=True)
