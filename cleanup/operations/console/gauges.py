"""Scrape-time gauges of the web process's /metrics: the SLO signal (oldest eligible hold per
shard), the capped backlog, the queues, the outbox, dead letters, desired consumers, the pause
switch and each shard's last sweep.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from django.db import transaction
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cleanup import sql
from cleanup.broker import celery_policy
from cleanup.broker.readers import queue_stats
from cleanup.conf import cleanup_settings
from cleanup.metrics import PREFIX
from cleanup.models import DeadLetter
from cleanup.operations.console import backlog_reading
from cleanup.operations.scaling.capacity import DESIRED_WINDOW_S, desired_consumers
from cleanup.release.schedule import enabled_sweep_intervals, installed_shards
from reservations.db import rows, set_local_statement_timeout

# --- Scrape-time gauges (web process only) ---------------------------------------------------
#
# ``BacklogCollector`` is NOT registered at import: ``cleanup.operations.console.endpoints``
# registers one instance in its own registry for the /metrics view of the web process. Workers never
# run these
# queries.
#
# Every DB section runs in its own transaction under ``SET LOCAL statement_timeout``; when a
# section fails (timeout, database or broker down), its last good values are exported again,
# ``reservation_cleanup_scrape_failed{collector}`` is 1 for that scrape and
# ``reservation_cleanup_scrape_errors_total{collector}`` is incremented. The counter belongs to one
# web process: behind gunicorn each process has its own, and successive scrapes reach different
# processes, so ``increase()`` over it sees resets and jumps that are no errors. Alert on the
# per-scrape gauge instead (``sum_over_time`` counts failed scrapes whichever process answered).

_log = logging.getLogger("cleanup.metrics")

Sample = tuple[tuple[str, ...], float]


class BacklogCollector(Collector):
    """Scrape-time gauges: the SLO signal, the capped backlog, queues, outbox, dead letters,
    desired consumers, the pause switch, the sweeps."""

    SECTIONS = (
        "eligible",
        "queues",
        "outbox",
        "dead_letters",
        "desired_consumers",
        "pause",
        "sweeps",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # section -> metric name -> samples (label values, value): the last good reading.
        self._last: dict[str, dict[str, list[Sample]]] = {}
        self._errors: dict[str, float] = {s: 0.0 for s in self.SECTIONS}
        self._failed: dict[str, bool] = {s: False for s in self.SECTIONS}
        self._durations: dict[str, float] = {}
        # (monotonic time, eligible count, the fleet reading's taken_at) of the last reading
        self._previous_backlog: tuple[float, float, float | None] | None = None
        self._eligible_reading: tuple[float, float | None] = (time.monotonic(), None)
        self._growth = 0.0

    # -- readings ---------------------------------------------------------------------------

    @staticmethod
    def _shards() -> int:

        return installed_shards() or 1

    @staticmethod
    def _db(fn: Callable[[], dict[str, list[Sample]]]) -> dict[str, list[Sample]]:

        with transaction.atomic():
            set_local_statement_timeout(cleanup_settings().metrics_statement_timeout_ms)
            return fn()

    def read_eligible(self) -> dict[str, list[Sample]]:
        """The fleet's reading of the eligible backlog (backlog_reading: one scrape of the fleet
        reads it per interval), and how old it is."""
        conf = cleanup_settings()
        reading = backlog_reading.current(
            self._shards(),
            conf.eligible_count_cap,
            conf.eligible_reading_seconds,
            conf.metrics_statement_timeout_ms,
        )
        self._eligible_reading = (time.monotonic() - reading.age_seconds, reading.taken_at)
        shards = [(str(k),) for k in range(len(reading.shards))]
        return {
            "oldest_eligible_reservation_age_seconds": [
                (k, oldest) for k, (oldest, _, _) in zip(shards, reading.shards, strict=True)
            ],
            "eligible_reservations": [
                (k, float(n)) for k, (_, n, _) in zip(shards, reading.shards, strict=True)
            ],
            "eligible_reservations_capped": [
                (k, 1.0 if capped else 0.0)
                for k, (_, _, capped) in zip(shards, reading.shards, strict=True)
            ],
            "eligible_reading_age_seconds": [((), reading.age_seconds)],
        }

    @staticmethod
    def read_queues() -> dict[str, list[Sample]]:

        depth: list[Sample] = []
        age: list[Sample] = []
        unacked: list[Sample] = []
        unreadable: list[Sample] = []
        conf = cleanup_settings()
        for queue in (conf.sweep_queue, conf.release_queue, conf.maintenance_queue):
            stats = queue_stats(queue)
            unreadable.append(((queue,), float(len(stats.unreadable_keys))))
            if not stats.readable:
                # A key of the queue holds another type (planted): its depth and age are
                # unknown, and exporting what the other keys hold would read as the truth.
                continue
            depth.append(((queue,), float(stats.depth)))
            if stats.oldest_age_seconds is not None:
                age.append(((queue,), stats.oldest_age_seconds))
            elif (
                celery_policy.broker_is_redis() and stats.depth == 0
            ):  # empty on Redis: nothing waits
                age.append(((queue,), 0.0))
            # RabbitMQ cannot peek, and on Redis the oldest entries may all have been skipped as
            # unreadable (cleanup.broker.readers): the age is not exported rather than faked.
            if stats.unacked is not None:
                unacked.append(((queue,), float(stats.unacked)))
        return {
            "queue_depth": depth,
            "queue_oldest_message_age_seconds": age,
            "queue_unacked": unacked,
            "queue_unreadable_keys": unreadable,
        }

    def read_outbox(self) -> dict[str, list[Sample]]:
        def run() -> dict[str, list[Sample]]:
            found = rows(sql.OLDEST_UNPUBLISHED_EVENT_AGE)
            age = max(0.0, float(found[0][0])) if found else 0.0
            return {"outbox_oldest_unpublished_age_seconds": [((), age)]}

        return self._db(run)

    def read_dead_letters(self) -> dict[str, list[Sample]]:

        def run() -> dict[str, list[Sample]]:
            counts = {str(reason): float(n) for reason, n in rows(sql.OPEN_DEAD_LETTERS_BY_REASON)}
            reasons = [c for c, _ in DeadLetter.Reason.choices]
            reasons += [r for r in counts if r not in reasons]
            return {
                "dead_letters_open": [((r,), counts.get(r, 0.0)) for r in reasons],
                "dead_letters_open_cap": [((), float(cleanup_settings().dead_letter_open_cap))],
            }

        return self._db(run)

    def read_desired_consumers(self) -> dict[str, list[Sample]]:

        # Backlog growth between the last two readings of the eligible count (a scrape that
        # exports the fleet's reading again keeps the growth it had).
        backlog = sum(v for _, v in self._last.get("eligible", {}).get("eligible_reservations", []))
        read_at, taken_at = self._eligible_reading
        previous = self._previous_backlog
        if previous is None or taken_at is None or taken_at != previous[2]:
            if previous is not None and read_at > previous[0]:
                self._growth = (backlog - previous[1]) / (read_at - previous[0])
            self._previous_backlog = (read_at, backlog, taken_at)
        growth = self._growth

        def run() -> dict[str, list[Sample]]:
            ((processed, mean_ms),) = rows(sql.RECENT_RECEIPTS, [DESIRED_WINDOW_S])
            value = desired_consumers(
                int(processed), float(mean_ms) if mean_ms is not None else None, growth
            )
            return {"desired_consumers": [] if value is None else [((), value)]}

        return self._db(run)

    def read_pause(self) -> dict[str, list[Sample]]:

        def run() -> dict[str, list[Sample]]:
            found = rows(sql.RELEASE_PAUSE_AGE)
            paused, age = (bool(found[0][0]), float(found[0][1] or 0.0)) if found else (False, 0.0)
            return {
                "releases_paused": [((), 1.0 if paused else 0.0)],
                "releases_paused_seconds": [((), max(0.0, age) if paused else 0.0)],
            }

        return self._db(run)

    def read_sweeps(self) -> dict[str, list[Sample]]:
        """For each shard whose sweep entry is enabled: its interval, and how long ago its last
        sweep finished (a shard not swept yet under this N: since the schedule was saved). A
        sweep records itself whatever it found, so the age grows only when no sweep of the
        shard runs to its end: beat down, the sweep queue unconsumed, sweeps failing."""

        def run() -> dict[str, list[Sample]]:
            found = enabled_sweep_intervals()
            if found is None:
                return {"sweep_interval_seconds": [], "last_sweep_age_seconds": []}
            shards, intervals = found
            finished = {int(k): float(age) for k, age in rows(sql.LAST_SWEEP_AGES, [shards])}
            since_saved = None
            if intervals.keys() - finished.keys():  # a shard not swept yet under this N
                saved = rows(sql.SCHEDULE_SAVED_AGE)
                since_saved = float(saved[0][0]) if saved else None
            ages: list[Sample] = []
            for shard in sorted(intervals):
                age = finished.get(shard, since_saved)
                if age is not None:
                    ages.append(((str(shard),), max(0.0, age)))
            return {
                "sweep_interval_seconds": [((str(k),), v) for k, v in sorted(intervals.items())],
                "last_sweep_age_seconds": ages,
            }

        return self._db(run)

    # -- collection -------------------------------------------------------------------------

    def refresh(self) -> None:
        readers: dict[str, Callable[[], dict[str, list[Sample]]]] = {
            "eligible": self.read_eligible,
            "queues": self.read_queues,
            "outbox": self.read_outbox,
            "dead_letters": self.read_dead_letters,
            "desired_consumers": self.read_desired_consumers,
            "pause": self.read_pause,
            "sweeps": self.read_sweeps,
        }
        for section, reader in readers.items():
            started = time.perf_counter()
            try:
                self._last[section] = reader()
                self._failed[section] = False
            except Exception as exc:  # noqa: BLE001 - keep the last value, count the error
                self._errors[section] = self._errors.get(section, 0.0) + 1
                self._failed[section] = True
                _log.warning(
                    "metrics collector failed; exporting its last values",
                    extra={"collector": section, "error": repr(exc)[:300]},
                )
            self._durations[section] = time.perf_counter() - started

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            self.refresh()
            yield from self._families()

    def _families(self) -> Iterable[Metric]:
        labels = {
            "oldest_eligible_reservation_age_seconds": ["shard"],
            "eligible_reservations": ["shard"],
            "eligible_reservations_capped": ["shard"],
            "eligible_reading_age_seconds": [],
            "queue_depth": ["queue"],
            "queue_oldest_message_age_seconds": ["queue"],
            "queue_unacked": ["queue"],
            "queue_unreadable_keys": ["queue"],
            "outbox_oldest_unpublished_age_seconds": [],
            "dead_letters_open": ["reason"],
            "dead_letters_open_cap": [],
            "desired_consumers": [],
            "releases_paused": [],
            "releases_paused_seconds": [],
            "sweep_interval_seconds": ["shard"],
            "last_sweep_age_seconds": ["shard"],
        }
        for name, label_names in labels.items():
            family = GaugeMetricFamily(f"{PREFIX}_{name}", GAUGE_HELP[name], labels=label_names)
            for section in self._last.values():
                for label_values, value in section.get(name, []):
                    family.add_metric(list(label_values), value)
            yield family
        errors = CounterMetricFamily(
            f"{PREFIX}_scrape_errors",
            "Scrape-time collector failures (the gauge kept its last value)",
            labels=["collector"],
        )
        for collector, n in sorted(self._errors.items()):
            errors.add_metric([collector], n)
        yield errors
        failed = GaugeMetricFamily(
            f"{PREFIX}_scrape_failed",
            "1 when this scrape's collector failed (its gauges repeat their last good values)",
            labels=["collector"],
        )
        for collector, did_fail in sorted(self._failed.items()):
            failed.add_metric([collector], 1.0 if did_fail else 0.0)
        yield failed
        # The SLO the alert rules and dashboards compare the oldest eligible age with: one
        # setting (CLEANUP_SLO_SECONDS) for the app, the rules and the panels.
        yield GaugeMetricFamily(
            f"{PREFIX}_slo_seconds",
            "CLEANUP_SLO_SECONDS: the oldest eligible hold must be released within this",
            value=float(cleanup_settings().slo_seconds),
        )
        duration = GaugeMetricFamily(
            f"{PREFIX}_scrape_duration_seconds",
            "Time each scrape-time collector took in the last scrape",
            labels=["collector"],
        )
        for collector, seconds in sorted(self._durations.items()):
            duration.add_metric([collector], seconds)
        yield duration


GAUGE_HELP = {
    "oldest_eligible_reservation_age_seconds": (
        "SLO signal: now - min(expires_at) over held, expired holds (claimed or not); 0 if none"
    ),
    "eligible_reservations": "Held, expired holds (counted up to CLEANUP_ELIGIBLE_COUNT_CAP)",
    "eligible_reservations_capped": "1 when eligible_reservations hit the count cap",
    "eligible_reading_age_seconds": (
        "Age of the fleet's reading of the three gauges above (one scrape of the fleet reads "
        "them per CLEANUP_ELIGIBLE_READING_SECONDS)"
    ),
    "queue_depth": "Messages waiting in the broker queue (all priorities)",
    "queue_oldest_message_age_seconds": (
        "Age of the oldest waiting message (enqueued_at header); 0 when the queue is empty"
    ),
    "queue_unacked": "Messages fetched by workers and not yet acknowledged (Redis)",
    "queue_unreadable_keys": (
        "Keys of the queue holding another type than a list (Redis): depth and age not exported"
    ),
    "outbox_oldest_unpublished_age_seconds": "Age of the oldest unpublished outbox event (0: none)",
    "dead_letters_open": "Dead letters not yet resolved (requeued, discarded, summarised, ...)",
    "dead_letters_open_cap": (
        "CLEANUP_DEAD_LETTER_OPEN_CAP: open letters beyond it are summarised (one per reason "
        "and task)"
    ),
    "desired_consumers": (
        "Consumers needed: measured arrival rate x service time / 0.7 utilization, with headroom"
    ),
    "releases_paused": "1 while the console's pause switch stops workers consuming releases",
    "releases_paused_seconds": "How long releases have been paused (0 while they run)",
    "sweep_interval_seconds": "Interval of each shard's sweep entry, while it is enabled",
    "last_sweep_age_seconds": (
        "Since each shard's last sweep finished (one not swept yet: since the schedule was saved)"
    ),
}
