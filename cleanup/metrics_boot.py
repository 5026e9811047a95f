"""Prepare prometheus_client's multiprocess mode for a ``celery worker`` — before anything
imports prometheus_client.

The mode is chosen when prometheus_client is imported (docs/LIBRARY-NOTES.md §3): the variable
``PROMETHEUS_MULTIPROC_DIR`` must already be set then. ``cleanup.metrics`` calls
``ensure_prepared`` before it constructs a metric, and ``cleanup.operations.worker_metrics`` at its
import (from the app's ``ready``, in the worker's main process before the pool forks), so the
order in which modules are imported does not matter. When the process is a celery worker
(detected from ``sys.argv``) and ``WORKER_METRICS_PORT`` > 0, it points the variable at
``<WORKER_METRICS_DIR>/<worker name>`` (default ``var/prometheus/<name>`` under the directory the
worker starts in, one
directory per worker instance, the name from ``-n``/``--hostname`` with ``%h``/``%n``/``%d``
expanded, else the pid) and wipes that directory: a restarted process would otherwise read its
pid's old values, and container pids are reused.

Celery's CLI loads command plugins before it imports ``-A config``, and Flower's plugin imports
prometheus_client, so by the time this module runs under ``celery worker`` the value class has
already been chosen. prometheus_client picks it per metric through ``values.ValueClass`` ("chosen
before the first metric is constructed"), so ``prepare`` re-selects it once the variable is set;
the cleanup's metrics are constructed right after, in the same import. For a launcher that
sets everything before any import, run
``python -m cleanup.metrics_boot -A config worker …`` (same arguments as ``celery``).

Outside prometheus_client's re-selection, this module imports nothing but the standard library.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from pathlib import Path

ENV_DIR = "PROMETHEUS_MULTIPROC_DIR"


def is_celery_worker(argv: list[str]) -> bool:
    if not argv:
        return False
    # `celery ... worker`, or `python -m celery ... worker` (argv[0] = .../celery/__main__.py)
    tail = argv[0].replace("\\", "/").rsplit("/", 2)[-2:]
    return any("celery" in part for part in tail) and "worker" in argv[1:]


def worker_name(argv: list[str]) -> str:
    name = ""
    for i, arg in enumerate(argv):
        if arg in ("-n", "--hostname") and i + 1 < len(argv):
            name = argv[i + 1]
        elif arg.startswith("--hostname="):
            name = arg.split("=", 1)[1]
        elif arg.startswith("-n") and len(arg) > 2:
            name = arg[2:].lstrip("=")
    if not name:
        return f"pid{os.getpid()}"
    host = socket.gethostname()
    short, _, domain = host.partition(".")
    name = name.replace("%h", host).replace("%n", short).replace("%d", domain)
    return re.sub(r"[^A-Za-z0-9_.@-]", "_", name)[:200]


def _port() -> int:
    raw = os.environ.get("WORKER_METRICS_PORT", "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        return 0  # settings (config.settings.base) reject it with the variable's name


def prepare(argv: list[str] | None = None) -> Path | None:
    """Set and wipe this worker instance's metrics directory; None when not applicable."""
    argv = sys.argv if argv is None else argv
    if not is_celery_worker(argv) or _port() <= 0:
        return None
    # The working directory, not this package's: installed, it sits in site-packages.
    base = Path(os.environ.get("WORKER_METRICS_DIR") or Path.cwd() / "var" / "prometheus")
    path = base / worker_name(argv)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    os.environ[ENV_DIR] = str(path)
    if "prometheus_client" in sys.modules:
        _reselect_value_class()
    return path


def _reselect_value_class() -> None:
    from prometheus_client import values  # noqa: PLC0415 - only after PROMETHEUS_MULTIPROC_DIR is set above (docs/LIBRARY-NOTES.md §3)

    values.ValueClass = values.get_value_class()


_prepared: list[Path | None] = []  # [the result] once this process has been prepared


def ensure_prepared() -> Path | None:
    """``prepare`` once per process (a forked pool child inherits the parent's preparation and
    must not wipe the directory again); what the first call returned."""
    if not _prepared:
        _prepared.append(prepare())
    return _prepared[0]


def main() -> None:
    """``python -m cleanup.metrics_boot <celery arguments>``: prepare, then run celery."""
    argv = ["celery", *sys.argv[1:]]
    _prepared.append(prepare(argv))
    sys.argv = argv
    from celery.__main__ import main as celery_main  # noqa: PLC0415 - only when run as a script

    celery_main()


if __name__ == "__main__":
    main()
