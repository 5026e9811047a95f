"""The cleanup's health at a glance: what the admin's health page shows, read at request time
from PostgreSQL, the broker and the workers, plus the periodic samples behind its chart.

Every number comes from one query or broker call made while the page renders (the same
statements as the /metrics gauges where there is one), so the page and SQL agree at that
moment. Nothing here is cached.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone
from django_celery_beat.models import PeriodicTask

from cleanup import sql
from cleanup.broker.celery_app import app
from cleanup.broker.readers import QueueStats, queue_stats
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter, HealthSample, SweepRecord
from cleanup.operations.samples import read_shards
from cleanup.operations.scaling.capacity import DESIRED_WINDOW_S, desired_consumers
from cleanup.release import delivery_cap, locks
from cleanup.release.schedule import (
    BEAT_LOCK_APP_PREFIX,
    SWEEP_PREFIX,
    current_schedule,
    installed_shards,
)
from reservations import db

logger = logging.getLogger("cleanup.health")

WINDOWS_MINUTES = (5, 60)
# Remote-control replies are awaited this long at most: the page never blocks for longer.
PING_TIMEOUT_S = 1.0
CHART_MINUTES = 60


def slo_state(age_seconds: float, slo_seconds: float) -> str:
    """green below half the SLO, amber up to the SLO, red beyond it."""
    if age_seconds >= slo_seconds:
        return "red"
    if age_seconds >= slo_seconds / 2:
        return "amber"
    return "green"


@dataclass
class ShardHealth:
    shard: int
    oldest_age_seconds: float
    eligible: int
    capped: bool
    state: str
    last_sweep: SweepRecord | None


@dataclass
class WindowCounts:
    minutes: int
    since: datetime
    outcomes: dict[str, int]
    transitions: int
    attempts: int | None  # release-message deliveries (None: not tallied, no Redis counter)
    retries: int
    dead_lettered: int
    messages: int = 0  # release messages that wrote these receipts (a batch is one)

    @property
    def terminal(self) -> int:
        return sum(self.outcomes.values())


@dataclass
class WorkerInfo:
    name: str
    pool: int | None
    queues: list[str]


@dataclass
class Health:
    taken_at: datetime
    slo_seconds: int
    cap: int
    shards: int
    schedule: Any
    shard_rows: list[ShardHealth]
    queue: QueueStats | None
    queue_error: str
    windows: list[WindowCounts]
    open_dead_letters: list[tuple[str, str, int]]  # (reason, label, count)
    open_dead_letter_cap: int
    beat_lock: dict[str, Any] | None
    last_sent: datetime | None
    workers: list[WorkerInfo] | None
    workers_error: str
    running_pool: int | None
    desired: float | None
    samples: list[HealthSample] = field(default_factory=list)

    @property
    def outcome_rows(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """Each outcome seen in any window, with (window minutes, count) per window."""
        names = sorted({name for w in self.windows for name in w.outcomes})
        return [
            (name, [(w.minutes, w.outcomes.get(name, 0)) for w in self.windows]) for name in names
        ]

    @property
    def open_dead_letter_total(self) -> int:
        return sum(n for _, _, n in self.open_dead_letters)

    @property
    def worst_state(self) -> str:
        order = ("green", "amber", "red")
        return max((s.state for s in self.shard_rows), key=order.index, default="green")


def window_start(minutes: int, now: float | None = None) -> datetime:
    """The start of the current UTC minute, minus ``minutes - 1`` minutes: the windows are
    whole minutes, like the per-minute delivery tally."""
    current = delivery_cap.current_minute(now)
    return datetime.fromtimestamp((current - minutes + 1) * 60, tz=UTC)


def read_window(minutes: int, now: float) -> WindowCounts:
    since = window_start(minutes, now)
    outcomes = dict(db.rows(sql.RECEIPT_OUTCOMES_SINCE, [since]))
    retries = db.scalar(sql.RETRIES_SINCE, [since])
    messages = db.scalar(sql.MESSAGES_HANDLED_SINCE, [since])
    dead = DeadLetter.objects.filter(created_at__gte=since).count()
    try:
        attempts = delivery_cap.attempts_since(minutes, now=now)
    except Exception as exc:  # noqa: BLE001 - the tally is informative only
        logger.warning("attempt tally unavailable", extra={"error": repr(exc)[:200]})
        attempts = None
    return WindowCounts(
        minutes=minutes,
        since=since,
        outcomes={str(k): int(v) for k, v in outcomes.items()},
        transitions=int(outcomes.get("released", 0)),
        attempts=attempts,
        retries=int(retries),
        dead_lettered=dead,
        messages=int(messages),
    )


def read_open_dead_letters() -> list[tuple[str, str, int]]:
    counts = dict(db.rows(sql.OPEN_DEAD_LETTERS_BY_REASON))
    labels = dict(DeadLetter.Reason.choices)
    return [(r, str(labels.get(r, r)), int(n)) for r, n in sorted(counts.items())]


def read_beat_lock() -> dict[str, Any] | None:

    rows = db.rows(
        sql.ADVISORY_LOCK_HOLDERS, list(locks.beat_lock(cleanup_settings().beat_lock_id))
    )
    if not rows:
        return None
    app_name, client, pid, since = rows[0]
    return {
        "process": str(app_name).removeprefix(BEAT_LOCK_APP_PREFIX) or "(unnamed)",
        "client": client or "local socket",
        "backend_pid": pid,
        "since": since,
    }


def read_last_sent() -> datetime | None:

    value = (
        PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX)
        .order_by("-last_run_at")
        .values_list("last_run_at", flat=True)
        .first()
    )
    return value


def read_workers(timeout: float = PING_TIMEOUT_S) -> list[WorkerInfo]:
    """Workers that answered within ``timeout`` (two remote-control broadcasts sent at once:
    ``stats`` for the pool size, ``active_queues`` for what each consumes)."""

    def stats() -> dict[str, Any]:
        return app.control.inspect(timeout=timeout).stats() or {}

    def queues() -> dict[str, Any]:
        return app.control.inspect(timeout=timeout).active_queues() or {}

    with ThreadPoolExecutor(max_workers=2) as pool:
        stats_f, queues_f = pool.submit(stats), pool.submit(queues)
        by_stats, by_queues = stats_f.result(), queues_f.result()
    infos = []
    for name in sorted(set(by_stats) | set(by_queues)):
        pool_info = (by_stats.get(name) or {}).get("pool") or {}
        size = pool_info.get("max-concurrency")
        names = sorted(q.get("name", "?") for q in by_queues.get(name) or [])
        infos.append(WorkerInfo(name, int(size) if size is not None else None, names))
    return infos


def read_desired(samples: list[HealthSample]) -> float | None:
    """``reservation_cleanup_desired_consumers`` as /metrics computes it, with the backlog
    growth taken from the last two samples."""
    growth = 0.0
    if len(samples) >= 2:
        a, b = samples[-2], samples[-1]
        seconds = (b.taken_at - a.taken_at).total_seconds()
        if seconds > 0:
            growth = (b.eligible - a.eligible) / seconds
    ((processed, mean_ms),) = db.rows(sql.RECENT_RECEIPTS, [DESIRED_WINDOW_S])
    return desired_consumers(
        int(processed), float(mean_ms) if mean_ms is not None else None, growth
    )


def collect(*, with_workers: bool = True) -> Health:

    now = time.time()
    schedule = current_schedule()
    shards = schedule.shards if schedule else (installed_shards() or 1)
    conf = cleanup_settings()
    cap = conf.eligible_count_cap
    slo = conf.slo_seconds
    with transaction.atomic():
        db.set_local_statement_timeout(conf.metrics_statement_timeout_ms)
        readings = read_shards(shards, cap)
    sweeps = {r.shard: r for r in SweepRecord.objects.filter(shards=shards)}
    shard_rows = [
        ShardHealth(k, age, n, capped, slo_state(age, slo), sweeps.get(k))
        for k, (age, n, capped) in enumerate(readings)
    ]
    queue: QueueStats | None = None
    queue_error = ""
    try:
        queue = queue_stats(conf.release_queue)
    except Exception as exc:  # noqa: BLE001 - shown on the page
        queue_error = f"{type(exc).__name__}: {str(exc)[:200]}"
    samples = list(
        HealthSample.objects.filter(
            taken_at__gte=timezone.now() - timedelta(minutes=CHART_MINUTES)
        ).order_by("taken_at")
    )
    workers: list[WorkerInfo] | None = None
    workers_error = ""
    running_pool: int | None = None
    if with_workers:
        try:
            workers = read_workers()
        except Exception as exc:  # noqa: BLE001 - shown on the page
            workers_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        if workers is not None:
            running_pool = sum(w.pool or 0 for w in workers if conf.release_queue in w.queues)
    return Health(
        taken_at=timezone.now(),
        slo_seconds=slo,
        cap=cap,
        shards=shards,
        schedule=schedule,
        shard_rows=shard_rows,
        queue=queue,
        queue_error=queue_error,
        windows=[read_window(m, now) for m in WINDOWS_MINUTES],
        open_dead_letters=read_open_dead_letters(),
        open_dead_letter_cap=conf.dead_letter_open_cap,
        beat_lock=read_beat_lock(),
        last_sent=read_last_sent(),
        workers=workers,
        workers_error=workers_error,
        running_pool=running_pool,
        desired=read_desired(samples),
        samples=samples,
    )
