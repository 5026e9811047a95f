"""The beat schedule: per-shard sweep entries, and a scheduler that only sends while it holds
the beat lock.

django-celery-beat has no lock of its own: two beats both send (docs/LIBRARY-NOTES.md §4).
The lock is a
PostgreSQL *session* advisory lock held on a dedicated autocommit connection — not Django's,
which django-celery-beat closes each tick via ``close_old_connections()``. The connection sets
``idle_session_timeout`` so a frozen or partitioned leader loses the lock on the server side;
the leader pings it every tick (at most ``beat_max_loop_interval``, below the timeout).
On acquiring the lock the schedule is re-read from the database, and ``beat_sync_every=1``
persists ``last_run_at`` after each send, so a new leader does not re-send what the old one
just sent.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import psycopg
from django.conf import settings
from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler, ModelEntry

from cleanup import sql
from cleanup.broker.confirms import confirmed_producer, confirms_available
from cleanup.conf import cleanup_settings
from cleanup.models import CleanupSchedule
from cleanup.release import locks, periodic_guard
from cleanup.wire import PRUNE_TASK, RELAY_OUTBOX_TASK, SAMPLE_HEALTH_TASK, SWEEP_TASK
from reservations.db import psycopg_params, session_alias

logger = logging.getLogger("cleanup.schedule")

SWEEP_PREFIX = "cleanup: sweep shard "
RELAY_NAME = "cleanup: relay outbox"
PRUNE_NAME = "cleanup: prune"


def sweep_entry_name(shard: int, shards: int) -> str:
    return f"{SWEEP_PREFIX}{shard} of {shards}"


SAMPLE_NAME = "cleanup: sample health"
SAMPLE_EVERY = 30
# The entries the "Cleanup schedule" object drives: read-only in django-celery-beat's admin.
MANAGED_NOTE = (
    "Managed by the Cleanup schedule (Cleanup › Cleanup schedule): edit shards, interval and "
    "enabled there; saving it rewrites these entries."
)


def is_managed(name: str) -> bool:
    return name.startswith(SWEEP_PREFIX)


def _ensure(
    name: str,
    task: str,
    every: int,
    kwargs: dict[str, Any],
    queue: str,
    *,
    enabled: bool | None = None,
    overwrite: bool = True,
) -> bool:
    """Create or update one entry; True when something changed. With ``overwrite=False`` an
    existing entry is left exactly as it is (an operator may have edited it). ``enabled=None``
    leaves ``enabled`` as it is."""
    entry = PeriodicTask.objects.filter(name=name).first()
    if entry is not None and not overwrite:
        return False
    interval, _ = IntervalSchedule.objects.get_or_create(
        every=every, period=IntervalSchedule.SECONDS
    )
    wanted: dict[str, Any] = {
        "task": task,
        "interval": interval,
        "kwargs": json.dumps(kwargs, sort_keys=True),
        "queue": queue,
        # Relative expiry: a sweep that waited longer than one interval is dropped; the next
        # one covers the same range. (``expires`` is absolute and would disable the entry.)
        "expire_seconds": every,
    }
    if enabled is not None:
        wanted["enabled"] = enabled
    if entry is None:
        PeriodicTask.objects.create(name=name, **{"enabled": True, **wanted})
        return True
    changed = False
    for field, value in wanted.items():
        if getattr(entry, field) != value:
            setattr(entry, field, value)
            changed = True
    if changed:
        entry.save()  # save(), not update(): bumps beat's change marker
    return changed


def _validate(shards: int, every: int) -> None:
    if shards < 1 or shards > 1024:
        raise ValueError("shards must be between 1 and 1024")
    if every < 1:
        raise ValueError("every must be at least 1 second")


def apply_schedule(schedule: CleanupSchedule) -> dict[str, int]:
    """Make the per-shard sweep entries match ``schedule`` (one transaction): one entry per
    shard with kwargs {"shard": k, "shards": N}, interval and enabled from the schedule; entries
    of another N are deleted.

    Since a shard is a set of buckets (``bucket % N == k``) and every hold has a bucket, every
    hold belongs to exactly one shard under any N — changing N never strands a hold.
    """
    _validate(schedule.shards, schedule.every_seconds)
    shards, every = schedule.shards, schedule.every_seconds
    changed = 0
    with transaction.atomic():
        wanted = {sweep_entry_name(k, shards) for k in range(shards)}
        stale = PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX).exclude(name__in=wanted)
        removed = 0
        for entry in stale:  # delete() one by one so django-celery-beat sees the change
            entry.delete()
            removed += 1
        for k in range(shards):
            changed += _ensure(
                sweep_entry_name(k, shards),
                SWEEP_TASK,
                every,
                {"shard": k, "shards": shards},
                cleanup_settings().sweep_queue,
                enabled=schedule.enabled,
            )
    return {"shards": shards, "changed": changed, "removed": removed}


def save_schedule(
    shards: int, every: int, enabled: bool = True
) -> tuple[CleanupSchedule, dict[str, int]]:
    """Set the Cleanup schedule (creating it if needed) and apply it, in one transaction."""
    _validate(shards, every)
    with transaction.atomic():
        schedule = CleanupSchedule.objects.select_for_update().order_by("pk").first()
        if schedule is None:
            schedule = CleanupSchedule()
        schedule.shards, schedule.every_seconds, schedule.enabled = shards, every, enabled
        schedule.save()
        return schedule, apply_schedule(schedule)


def _maintenance_entries(relay_every: int, *, overwrite: bool) -> int:
    queue = cleanup_settings().maintenance_queue
    return (
        _ensure(RELAY_NAME, RELAY_OUTBOX_TASK, relay_every, {}, queue, overwrite=overwrite)
        + _ensure(PRUNE_NAME, PRUNE_TASK, 3600, {}, queue, overwrite=overwrite)
        + _ensure(SAMPLE_NAME, SAMPLE_HEALTH_TASK, SAMPLE_EVERY, {}, queue, overwrite=overwrite)
    )


def install_schedule(shards: int, every: int, *, relay_every: int = 5) -> dict[str, int]:
    """Reset the Cleanup schedule to these values (enabled) and rewrite every cleanup entry,
    relay, prune and sample included (``install_cleanup_schedule --force``). Idempotent."""
    with transaction.atomic():
        _schedule, result = save_schedule(shards, every, True)
        result["changed"] += _maintenance_entries(relay_every, overwrite=True)
    return result


def ensure_schedule(shards: int, every: int, *, relay_every: int = 5) -> dict[str, Any]:
    """Create the Cleanup schedule only when none exists (``install_cleanup_schedule``).

    An existing schedule keeps its values — an operator's edit survives a restart — and its
    entries are re-applied from it (a deleted entry comes back). Relay, prune and sample
    entries are created when missing and otherwise left as they are.
    """
    _validate(shards, every)
    with transaction.atomic():
        schedule = CleanupSchedule.objects.select_for_update().order_by("pk").first()
        created = schedule is None
        if schedule is None:
            # Sweep entries from before the Cleanup schedule existed (perhaps edited in the
            # admin then) are adopted as they are rather than reset to the arguments.
            shards, every, enabled = _installed_values() or (shards, every, True)
            schedule = CleanupSchedule.objects.create(
                shards=shards, every_seconds=every, enabled=enabled
            )
        result: dict[str, Any] = dict(apply_schedule(schedule))
        result["changed"] += _maintenance_entries(relay_every, overwrite=False)
    result.update(created=created, every=schedule.every_seconds, enabled=schedule.enabled)
    return result


def _installed_values() -> tuple[int, int, bool] | None:
    """(shards, every, enabled) of already installed sweep entries, if they agree on N."""
    entries = list(
        PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX).select_related("interval")
    )
    shards = installed_shards()
    if not entries or shards is None or not 1 <= shards <= 1024:
        return None
    intervals = [e.interval.every for e in entries if e.interval is not None and e.interval.every]
    every = max(intervals) if intervals else None
    if every is None:
        return None
    return shards, every, any(e.enabled for e in entries)


def current_schedule() -> CleanupSchedule | None:
    return CleanupSchedule.objects.order_by("pk").first()


def enabled_sweep_intervals() -> tuple[int, dict[int, float]] | None:
    """N of the installed sweep entries and, for each shard whose entry is enabled, its interval
    in seconds; None when none is installed. An entry ``periodic_guard`` refuses counts: beat
    skips it, so that shard is not swept, which is what the caller wants to see."""
    shards = installed_shards()
    if shards is None:
        return None
    intervals: dict[int, float] = {}
    for entry in PeriodicTask.objects.filter(
        name__startswith=SWEEP_PREFIX, enabled=True
    ).select_related("interval"):
        try:
            kwargs = json.loads(entry.kwargs)
            shard = int(kwargs["shard"])
            same_n = int(kwargs["shards"]) == shards
        except (ValueError, KeyError, TypeError):
            continue
        every = periodic_guard.interval_seconds(entry.interval)
        if same_n and every:
            intervals[shard] = every
    return shards, intervals


def installed_shards() -> int | None:
    """N of the installed sweep entries (None when no schedule is installed)."""
    for kwargs in PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX).values_list(
        "kwargs", flat=True
    ):
        try:
            return int(json.loads(kwargs)["shards"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


BEAT_LOCK_APP_PREFIX = "cleanup-beat-lease "


def beat_lock_application_name() -> str:

    return f"{BEAT_LOCK_APP_PREFIX}{socket.gethostname()}:{_pid()}"[:63]


def _lock_conninfo() -> dict[str, Any]:
    # The session's connection: behind a transaction pooler, DATABASE_DIRECT_URL's (a pooler
    # would neither keep the lock with this client nor honour idle_session_timeout).
    db = settings.DATABASES[session_alias()]
    timeout_ms = cleanup_settings().beat_idle_session_timeout * 1000
    params: dict[str, Any] = {
        "autocommit": True,
        # Names the beat on the server side: the health page shows which process leads.
        "application_name": beat_lock_application_name(),
        # The server drops a leader that stops pinging; keepalives catch a dead peer.
        "options": f"-c idle_session_timeout={timeout_ms}",
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "connect_timeout": 5,
    }
    # The settings above win over the entry's OPTIONS (a multi-host URL's connect_timeout).
    for key, value in psycopg_params(db).items():
        params.setdefault(key, value)
    return params


class RunRecordingEntry(ModelEntry):  # type: ignore[misc]
    """A beat entry whose sync writes only ``last_run_at`` and ``total_run_count``.

    django-celery-beat's ``ModelEntry.save`` reads the row, sets those fields and saves the
    whole row: an edit committed between that read and that write (the Cleanup schedule saved
    in the admin while beat syncs the entry it just sent) is overwritten with the old interval
    and enabled flag, and beat is not told (the write is ``no_changes``). Found with a real
    beat: one shard kept its old 1 s interval after an edit to 3 s. One UPDATE of the two
    columns cannot lose anyone's edit.
    """

    def save(self) -> None:
        PeriodicTask.objects.filter(pk=self.model.pk).update(
            last_run_at=self.model.last_run_at, total_run_count=self.model.total_run_count
        )


class SendBucket:
    """A token bucket of one token refilled at ``rate`` a second: sends at least ``1 / rate``
    seconds apart, so no second holds more than ``rate`` of them, whatever the schedule asks.
    A bucket of one second's worth would let a schedule send twice the rate across the edge of
    a second; beat's own sends (sweeps of a few shards every second) never need a burst."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate)
        self._clock = clock
        self._tokens = 1.0
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(1.0, self._tokens + (now - self._updated) * self.rate)
        self._updated = now

    def wait(self) -> float:
        """Seconds until the next send may go (0: now)."""
        self._refill()
        return 0.0 if self._tokens >= 1.0 else (1.0 - self._tokens) / self.rate

    def take(self) -> None:
        self._refill()
        self._tokens -= 1.0


class LeaderDatabaseScheduler(DatabaseScheduler):  # type: ignore[misc]
    """A DatabaseScheduler that sends only while it holds the beat lock, only the rows
    ``periodic_guard`` accepts, and at most ``CLEANUP_BEAT_MAX_SENDS_PER_SECOND`` a second."""

    Entry = RunRecordingEntry

    # How often beat says that sends are being deferred (with the running count), at most.
    DEFERRED_LOG_EVERY = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock_conn: psycopg.Connection[Any] | None = None
        self._is_leader = False
        # The error of the last failed attempt to take the lock ("" after a success), so a
        # beat that cannot reach PostgreSQL says why once per distinct error, not every tick.
        self._lock_error = ""
        self.send_bucket = SendBucket(cleanup_settings().beat_max_sends_per_second)
        # Counts for the logs: rows skipped at each read of the schedule, and ticks that found
        # a due send and waited for the bucket instead.
        self.refused_total = 0
        self.deferred_total = 0
        self._deferred_logged_at = float("-inf")
        super().__init__(*args, **kwargs)
        # Keep the ping interval below the server's idle-session timeout.
        self.max_interval: float = min(
            float(self.max_interval), max(1, cleanup_settings().beat_idle_session_timeout // 2)
        )

    @property
    def is_leader(self) -> bool:
        return self._is_leader

    def _drop_lock(self, why: str) -> None:
        if self._is_leader:
            logger.warning("beat lock lost", extra={"why": why})
        self._is_leader = False
        if self._lock_conn is not None:
            try:
                self._lock_conn.close()
            except Exception:  # noqa: BLE001
                pass
        self._lock_conn = None

    def _still_leader(self) -> bool:
        """Ping the lock session: False (and the lock dropped) when the server has ended it,
        e.g. after this process was frozen past the idle-session timeout."""
        if not self._is_leader or self._lock_conn is None:
            return False
        try:
            self._lock_conn.execute(sql.PING)
            return True
        except psycopg.Error as exc:
            self._drop_lock(repr(exc))
            return False

    def _hold_lock(self) -> bool:
        if self._still_leader():
            return True
        try:
            if self._lock_conn is None or self._lock_conn.closed:
                self._lock_conn = psycopg.connect(**_lock_conninfo())
            row = self._lock_conn.execute(
                sql.TRY_ADVISORY_LOCK,
                list(locks.beat_lock(cleanup_settings().beat_lock_id)),
            ).fetchone()
        except psycopg.Error as exc:
            self._drop_lock(repr(exc))
            self._lock_failed(exc)
            return False
        if self._lock_error:
            logger.info("beat reaches the database for its lock again")
            self._lock_error = ""
        if not row or not row[0]:
            return False
        # pg_try_advisory_lock is re-entrant; we only call it while not leader, so one hold.
        self._is_leader = True
        logger.info("beat lock acquired; this beat now sends", extra={"pid": _pid()})
        self._reload_from_database()
        return True

    def _lock_failed(self, exc: psycopg.Error) -> None:
        """A beat that cannot connect (or query) for its lock sends nothing, and before this
        said nothing either: a standby or a restarted beat failing to connect was silent."""
        error = " ".join(str(exc).split())[:300] or type(exc).__name__
        if error != self._lock_error:
            logger.warning(
                "beat cannot take its lock: nothing is sent until it can",
                extra={"error": error},
            )
        self._lock_error = error

    def _reload_from_database(self) -> None:
        """Re-read every entry (and its last_run_at, written by the previous leader) before the
        next tick. Neither library has a public call for this: ``_initial_read`` makes
        django-celery-beat's ``schedule`` property reload all rows, and ``_heap = None`` makes
        Celery's ``Scheduler.tick`` rebuild its heap from them. The only private names we use;
        tests/unit/project/test_library_contracts.py fails if either library stops reading them."""
        self._initial_read = True
        self._heap = None

    def reserve(self, entry: ModelEntry) -> ModelEntry:
        """Record a send in the scheduler's own entries too, as Celery's ``Scheduler.reserve``
        does and django-celery-beat's does not (it keeps the advanced entry only in the heap).

        django-celery-beat reloads its entries when it notices a schedule change and flags the
        heap for a rebuild on the next tick. A change noticed while the heap is being built
        (right after the lock is taken, or between the two reads of one tick) leaves the flag
        set, and the next tick rebuilds the heap from these entries: without this, the entry
        just sent still carried its previous run and was sent again at once. Only an entry
        that is still the scheduler's own is replaced (after a reload it is not)."""
        new_entry = super().reserve(entry)
        entries = self._schedule  # django-celery-beat's dict of entries, read without a reload
        if entries is not None and entries.get(entry.name) is entry:
            entries[entry.name] = new_entry
        return new_entry

    def apply_entry(self, entry: ModelEntry, producer: Any = None) -> None:
        """Send, after checking the lock once more: a tick checks it first, then reads the
        schedule from the database, and a leader frozen in between (seen with SIGSTOP in a
        test) must not send when it wakes on a lock the server has since ended. What is left
        is the instant between this ping and the publish."""
        if not self._still_leader():
            logger.warning("beat lock lost before a send; not sent", extra={"entry": entry.name})
            return
        self.send_bucket.take()
        producer = producer or self.producer
        if not confirms_available(producer.channel):
            super().apply_entry(entry, producer=producer)
            return
        # RabbitMQ: each send on a new channel, confirmed (cleanup.broker.confirms says why: a
        # long-lived channel that first sent to a queue while its leader was being replaced
        # loses every later send to it). Without kombu's retry, which would go on unconfirmed
        # on a channel of a new connection; a send that fails is logged, and the entry is due
        # again at its next run (a sweep: the next second).
        options = entry.options
        entry.options = {**options, "retry": False}  # (an entry cannot be copied: its pickling)
        try:
            with confirmed_producer(producer) as confirming:
                super().apply_entry(entry, producer=confirming)
        except Exception as exc:  # noqa: BLE001 - beat goes on with its next entry and tick
            logger.error(
                "beat send not confirmed by the broker; the entry is sent again at its next run",
                extra={"entry": entry.name, "error": " ".join(repr(exc).split())[:300]},
            )
        finally:
            entry.options = options

    def install_default_entries(self, data: Any) -> None:
        """Install nothing: django-celery-beat would save Celery's ``celery.backend_cleanup``
        (the project keeps no task results), which is not one of the project's periodic tasks
        and would only be skipped."""

    def all_as_schedule(self) -> dict[str, ModelEntry]:
        """The enabled rows, less those ``periodic_guard`` refuses (another task than the
        project's periodic ones, an interval below the floor, another queue): each is skipped,
        logged with its reasons and counted, at every read of the schedule; never sent."""
        entries: dict[str, ModelEntry] = super().all_as_schedule()
        for name, entry in list(entries.items()):
            refused = periodic_guard.row_problems(entry.model)
            if not refused:
                continue
            del entries[name]
            self.refused_total += 1
            logger.error(
                "periodic task refused; beat does not send it",
                extra={
                    "entry": name,
                    "task": entry.task,
                    "reasons": " | ".join(refused.values()),
                    "refused_total": self.refused_total,
                },
            )
        return entries

    def _head_is_due(self) -> bool:
        """Whether the next entry of Celery's heap is due (False while the heap is rebuilt)."""
        heap = self._heap
        if not heap:
            return False
        return bool(self.is_due(heap[0][2])[0])

    def populate_heap(self, *args: Any, **kwargs: Any) -> None:
        """Celery's heap, with every entry that is already due keyed by its last run instead of
        by the time of the build: Celery keys them all "now", in the order of the schedule's
        dict, and rebuilds the heap often, so while the send bound defers sends the same first
        entries came first at every rebuild and the others waited for ever (seen with a real
        beat: 10 of 40 due entries sent, again and again). By last run, the longest waiting
        goes first."""
        super().populate_heap(*args, **kwargs)
        heap = self._heap
        if not heap:
            return
        rebuilt = []
        for event in heap:
            entry = event[2]
            last_run = getattr(entry, "last_run_at", None)
            if last_run is not None and event[0] <= self._when(entry, 0):
                event = event._replace(time=min(event[0], last_run.timestamp()))
            rebuilt.append(event)
        heapq.heapify(rebuilt)
        self._heap = rebuilt

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self._hold_lock():
            return float(self.max_interval)
        wait = self.send_bucket.wait()
        if wait > 0:
            # The due entry stays at the head of the heap and goes when the bucket allows.
            if self._head_is_due():
                self._deferred()
            return min(wait, float(self.max_interval))
        return float(super().tick(*args, **kwargs))

    def _deferred(self) -> None:
        self.deferred_total += 1
        now = time.monotonic()
        if now - self._deferred_logged_at >= self.DEFERRED_LOG_EVERY:
            self._deferred_logged_at = now
            logger.warning(
                "beat sends deferred to stay within CLEANUP_BEAT_MAX_SENDS_PER_SECOND",
                extra={
                    "max_per_second": self.send_bucket.rate,
                    "deferred_total": self.deferred_total,
                },
            )

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._drop_lock("shutdown")


def _pid() -> int:

    return os.getpid()
