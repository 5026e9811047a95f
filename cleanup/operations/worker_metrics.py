"""Worker-side metrics serving: prometheus_client multiprocess mode under prefork.

- ``cleanup.metrics_boot.ensure_prepared`` (called at this module's import, from the
  app's ``ready`` in the worker's main process before the pool forks, and by
  ``cleanup.metrics``) has set ``PROMETHEUS_MULTIPROC_DIR`` to this worker instance's
  own, freshly wiped directory.
- ``worker_ready`` (MainProcess, once per start): serve a ``CollectorRegistry`` with a
  ``MultiProcessCollector`` on ``WORKER_METRICS_PORT`` and start the compactor thread.
- ``worker_process_shutdown`` (inside the exiting pool child): ``mark_process_dead``.
- The compactor (MainProcess, every ``WORKER_METRICS_COMPACT_INTERVAL`` s) bounds the files that
  recycled children leave: counter and histogram files of dead pids are summed key by key into
  one ``<type>_archive.db`` (written to a temporary name, renamed over the old archive, then the
  dead files are removed) under the same lock the scrape takes, so a scrape never sees a value
  counted twice or not at all, and totals never go backwards. Dead pids' ``live*`` gauge files
  are removed (``mark_process_dead``), which also covers children killed by SIGKILL/OOM.
  Limitation: non-live gauge files of dead pids are left as they are, so every gauge the
  cleanup defines uses a live* mode (tests/unit/cleanup/operations/console/test_endpoints.py checks
  that nothing of a dead pool process is left after a pass); a pid reused by a new child between the
  liveness check and the archive would lose that child's first increments (the window is one
  compaction pass).
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections import defaultdict
from typing import Any

from celery.signals import worker_process_shutdown, worker_ready, worker_shutdown

from cleanup import metrics_boot
from cleanup.broker.celery_app import runs_this_app
from cleanup.conf import cleanup_settings
from cleanup.processes import pid_alive

logger = logging.getLogger("cleanup.observability")

# Imported from the app's ``ready``: in a worker, before the pool forks (docs/LIBRARY-NOTES.md §3).
metrics_boot.ensure_prepared()

_lock = threading.Lock()
_stop = threading.Event()
ARCHIVED_TYPES = ("counter", "histogram")


def multiproc_dir() -> str | None:
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return path if path and os.path.isdir(path) else None


def _pid_of(path: str) -> int | None:
    stem = os.path.basename(path)[: -len(".db")]
    tail = stem.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _has_header(path: str) -> bool:
    """An mmap file starts with an 8-byte header (used size + padding) once initialized."""
    try:
        return os.path.getsize(path) >= 8
    except OSError:
        return False


def compact(path: str) -> dict[str, int]:
    """Fold dead pids' counter/histogram files into one archive per type; returns counts.

    prometheus_client has no public API to merge files, so this is the one place that uses its
    file format through ``MmapedDict`` (``read_all_values_from_file``, ``write_value``,
    ``close``); tests/unit/project/test_library_contracts.py fails if that API changes."""
    from prometheus_client.mmap_dict import MmapedDict  # noqa: PLC0415 - prometheus_client chooses its multiprocess mode at first import (docs/LIBRARY-NOTES.md §3)
    from prometheus_client.multiprocess import mark_process_dead  # noqa: PLC0415 - prometheus_client chooses its multiprocess mode at first import (docs/LIBRARY-NOTES.md §3)

    folded = 0
    with _lock:
        dead_pids: set[int] = set()
        for typ in ARCHIVED_TYPES:
            archive = os.path.join(path, f"{typ}_archive.db")
            dead = []
            for f in glob.glob(os.path.join(path, f"{typ}_*.db")):
                pid = _pid_of(f)
                if pid is not None and not pid_alive(pid):
                    dead.append(f)
                    dead_pids.add(pid)
            if not dead:
                continue
            totals: dict[str, float] = defaultdict(float)
            for f in [f for f in dead if not _has_header(f)]:
                os.remove(f)  # died before writing anything
                dead.remove(f)
            sources = ([archive] if os.path.exists(archive) else []) + dead
            for f in sources:
                for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(f):
                    totals[key] += value
            tmp = os.path.join(path, f".{typ}_archive.tmp")
            if os.path.exists(tmp):
                os.remove(tmp)
            out = MmapedDict(tmp)
            try:
                for key, value in totals.items():
                    out.write_value(key, value, 0.0)
            finally:
                out.close()
            os.replace(tmp, archive)
            for f in dead:
                os.remove(f)
            folded += len(dead)
        for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
            pid = _pid_of(f)
            if pid is not None and not pid_alive(pid):
                dead_pids.add(pid)
        for pid in dead_pids:
            mark_process_dead(pid, path)
    return {"folded_files": folded, "dead_pids": len(dead_pids)}


def _collector_class() -> Any:
    from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415 - prometheus_client chooses its multiprocess mode at first import (docs/LIBRARY-NOTES.md §3)

    class LockedMultiProcessCollector(MultiProcessCollector):  # type: ignore[misc]
        """Reads the directory under the compactor's lock."""

        def collect(self) -> Any:
            # A child that is starting creates its file empty and sizes it a moment later;
            # prometheus_client's reader fails on such a file (struct.error → HTTP 500 for the
            # whole scrape). Skip files that have no header yet: they hold no samples.
            with _lock:
                files = [f for f in glob.glob(os.path.join(self._path, "*.db")) if _has_header(f)]
                return list(self.merge(files, accumulate=True))

    return LockedMultiProcessCollector


def _compactor(path: str, interval: float) -> None:
    while not _stop.wait(interval):
        try:
            result = compact(path)
            if result["folded_files"]:
                logger.debug("worker metrics compacted", extra=result)
        except Exception:  # never take the worker down for metrics
            logger.exception("worker metrics compaction failed")


class PoolCollector:
    """``reservation_cleanup_worker_pool_processes``: the pool processes (consumers) this worker
    runs now, read at scrape time from the worker's pool. Every worker serves it, autoscaled or
    not, so "consumers running" is ``sum(...)`` and "no consumer" does not depend on how a
    deployment names its scrape job."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    def processes(self) -> float | None:
        pool = getattr(self._consumer, "pool", None)
        try:
            return float(pool.num_processes) if pool is not None else None
        except Exception:  # noqa: BLE001 - a pool being torn down has no size to report
            return None

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415 - prometheus_client chooses its multiprocess mode at first import (docs/LIBRARY-NOTES.md §3)

        size = self.processes()
        if size is not None:
            yield GaugeMetricFamily(
                "reservation_cleanup_worker_pool_processes",
                "Pool processes (consumers) of this worker at scrape time",
                value=size,
            )


def start_metrics_server(port: int, addr: str = "0.0.0.0", consumer: Any = None) -> Any:
    from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415 - prometheus_client chooses its multiprocess mode at first import (docs/LIBRARY-NOTES.md §3)

    path = multiproc_dir()
    if path is None:
        logger.warning(
            "WORKER_METRICS_PORT is set but PROMETHEUS_MULTIPROC_DIR is not; worker metrics "
            "are off (start the worker with `celery -A config worker`)"
        )
        return None
    registry = CollectorRegistry()
    _collector_class()(registry, path=path)
    if consumer is not None:
        registry.register(PoolCollector(consumer))  # type: ignore[arg-type]
    server = start_http_server(port, addr=addr, registry=registry)

    interval = cleanup_settings().worker_metrics_compact_interval
    threading.Thread(
        target=_compactor, args=(path, interval), name="metrics-compactor", daemon=True
    ).start()
    logger.info("worker metrics served", extra={"port": port, "dir": path})
    return server


@worker_ready.connect
def serve_worker_metrics(sender: Any = None, **_: Any) -> None:
    if not runs_this_app(sender):
        return
    conf = cleanup_settings()
    if conf.worker_metrics_port > 0:
        from cleanup import metrics  # noqa: PLC0415 - prometheus_client chooses its multiprocess mode at first import (docs/LIBRARY-NOTES.md §3)

        metrics.initialize_worker_series()
        try:
            port, addr = conf.worker_metrics_port, conf.worker_metrics_addr
            start_metrics_server(port, addr, consumer=sender)
        except OSError:
            logger.exception(
                "worker metrics port unavailable", extra={"port": conf.worker_metrics_port}
            )


@worker_process_shutdown.connect
def mark_child_dead(pid: int | None = None, **_: Any) -> None:
    path = multiproc_dir()
    if path is None:
        return
    from prometheus_client.multiprocess import mark_process_dead  # noqa: PLC0415 - prometheus_client chooses its multiprocess mode at first import (docs/LIBRARY-NOTES.md §3)

    mark_process_dead(pid or os.getpid(), path)


@worker_shutdown.connect
def stop_compactor(**_: Any) -> None:
    _stop.set()
