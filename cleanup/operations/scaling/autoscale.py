"""A pool autoscaler for ``celery worker --autoscale=MAX,MIN`` driven by the cleanup's backlog.

Celery's own autoscaler (``celery.worker.autoscale.Autoscaler``) sizes the pool from the number
of tasks this worker has already reserved. It cannot see how old the backlog is, whether the SLO
is at risk, or how many holds wait in PostgreSQL behind the broker's backpressure cap. This one
sizes the pool from what the SLO cares about:

- the eligible backlog (held, expired holds; claimed or not) and the age of the oldest one,
- the release queue's depth and the age of its oldest waiting message (Redis; RabbitMQ cannot
  peek, so there the age is absent and the eligible hold's age stands in),
- the measured service time per pool process and the measured arrival rate, through the same
  ``cleanup.operations.scaling.capacity.compute_desired_consumers`` arithmetic as the
  ``desired_consumers`` gauge.

Enable it with ``CELERY_WORKER_AUTOSCALER =
"cleanup.operations.scaling.autoscale:BacklogAutoscaler"`` (set in base settings) and ``celery
worker --autoscale=MAX,MIN``. The policy (``decide``) is a pure
function; docs/AUTOSCALING.md explains it with numbers.

Threads: Celery calls ``maybe_scale`` from the worker's event loop (every ``keepalive`` seconds
and on every task message), where nothing may block. The readings (SQL and broker round trips)
are taken by a daemon thread of this class every ``CLEANUP_AUTOSCALE_INTERVAL`` seconds; the
event loop only compares the latest reading with the pool and grows or shrinks it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from celery.worker import state as worker_state
from celery.worker.autoscale import Autoscaler
from django.db import connection, transaction

from cleanup import metrics, sql
from cleanup.broker.readers import queue_stats
from cleanup.conf import ASSUMED_SERVICE_TIME_S, cleanup_settings
from cleanup.operations.scaling.capacity import compute_desired_consumers
from cleanup.release.sizing import drain_consumers
from reservations.db import rows, set_local_statement_timeout
from reservations.models import BUCKETS
from reservations.services import eligible_backlog

log = logging.getLogger("cleanup.autoscale")

GROW, SHRINK, HOLD = "grow", "shrink", "hold"


@dataclass(frozen=True)
class Policy:
    """Bounds and knobs (settings ``CLEANUP_AUTOSCALE_*``; min/max from ``--autoscale``)."""

    min_procs: int
    max_procs: int
    slo_seconds: float = 300.0
    # The backlog must be drained before its oldest hold reaches this fraction of the SLO.
    slo_target: float = 0.5
    utilization: float = 0.7
    headroom: float = 0.5
    # A lower target must persist this long (and this long after the last change) to shrink.
    cooldown_seconds: float = 60.0
    # A reading older than this is not acted on (the reader thread is stuck or failing).
    stale_after_seconds: float = 30.0
    default_service_time_s: float = 0.05


@dataclass(frozen=True)
class Reading:
    """One sample of the signals, taken by the reader thread."""

    taken_at: float  # time.monotonic()
    backlog: int = 0  # eligible holds, counted up to the cap
    backlog_capped: bool = False
    oldest_eligible_age_s: float = 0.0
    queue_depth: int = 0
    queue_oldest_age_s: float | None = None  # None on RabbitMQ (no peek) or when empty
    processed_per_s: float = 0.0  # receipts of the whole fleet per second over the window
    peers: int = 1  # worker instances sharing the backlog (this one included)
    arrival_per_s: float | None = None  # None until the window has enough history
    service_time_s: float | None = None
    service_source: str = "default"
    error: str = ""


@dataclass(frozen=True)
class Decision:
    action: str
    current: int
    target: int
    reason: str
    fleet_drain: int = 0
    fleet_sustain: int = 0
    inputs: dict[str, Any] = field(default_factory=dict)


def decide(
    reading: Reading | None,
    policy: Policy,
    current: int,
    now: float,
    last_change_at: float | None = None,
    lower_since: float | None = None,
) -> Decision:
    """The pool size this worker should have now.

    fleet consumers = max(drain, sustain), where
      drain   = ceil(backlog × S / (SLO × slo_target − oldest age)): clear what waits before the
                oldest eligible hold reaches the target fraction of the SLO (max when already
                past it);
      sustain = compute_desired_consumers(arrival rate, S, utilization, headroom): keep up with
                what keeps arriving (the ``desired_consumers`` gauge's arithmetic);
    this worker's share = ceil(fleet / peers), clamped to [min, max].
    Grow at once; shrink only after the lower target has held for the cooldown (and the cooldown
    has passed since the last change). A failed or stale reading keeps the current size.
    """
    if reading is None:
        return Decision(HOLD, current, current, "no_reading")
    inputs = asdict(reading)
    inputs.pop("taken_at", None)
    if reading.error:
        return Decision(HOLD, current, current, "read_error", inputs=inputs)
    if now - reading.taken_at > policy.stale_after_seconds:
        return Decision(HOLD, current, current, "stale_reading", inputs=inputs)

    service = reading.service_time_s or policy.default_service_time_s
    age = max(reading.oldest_eligible_age_s, reading.queue_oldest_age_s or 0.0)
    budget = policy.slo_seconds * policy.slo_target - age
    waiting = max(reading.backlog, reading.queue_depth)
    fleet_max = policy.max_procs * max(1, reading.peers)
    if waiting <= 0:
        drain, why = 0, "idle"
    elif budget <= 0 or reading.backlog_capped:
        drain, why = fleet_max, "slo_at_risk"
    else:
        drain, why = min(fleet_max, drain_consumers(waiting, service, budget)), "backlog"
    sustain = 0
    if reading.arrival_per_s:
        sustain = compute_desired_consumers(
            reading.arrival_per_s, service, policy.utilization, policy.headroom
        )
        if sustain > drain and waiting > 0:
            why = "arrivals"
    fleet = max(drain, sustain)
    share = math.ceil(fleet / max(1, reading.peers))
    target = min(policy.max_procs, max(policy.min_procs, share))

    def result(action: str, reason: str) -> Decision:
        return Decision(action, current, target, reason, drain, sustain, inputs)

    if target > current:
        return result(GROW, why)
    if target < current:
        if last_change_at is not None and now - last_change_at < policy.cooldown_seconds:
            return result(HOLD, "cooldown")
        if lower_since is None or now - lower_since < policy.cooldown_seconds:
            return result(HOLD, "cooldown")
        return result(SHRINK, why)
    return result(HOLD, "at_target")


# --- Readings ----------------------------------------------------------------------------------


class Reader:
    """Takes a ``Reading`` from PostgreSQL and the broker, and this worker's own counters."""

    def __init__(self, hostname: str, window_s: float, procs: Any) -> None:
        self.hostname = hostname
        self.window_s = window_s
        self._procs = procs  # () -> current pool size
        self._backlog_history: deque[tuple[float, int]] = deque()
        self._processed_halves = (0, 0)  # receipts in the older and the newer half-window
        # (monotonic, tasks completed by this worker, busy process-seconds so far)
        self._own: deque[tuple[float, int, float]] = deque()
        self._busy_s = 0.0
        self._last_at: float | None = None

    @staticmethod
    def _completed() -> int:
        for _ in range(3):
            try:
                return int(sum(worker_state.total_count.values()))
            except RuntimeError:  # the counter gained a key while we iterated
                continue
        return 0

    def _own_service_time(self, now: float) -> float | None:
        """Busy process-seconds per completed task over the window (Celery's per-message cost
        included). Busy time is sampled as min(tasks this worker holds, pool size) × elapsed:
        with acks_late and prefetch, a worker that holds at least as many tasks as processes
        keeps every process busy. (Sampling the *running* tasks instead undercounts short
        tasks, which are often between one and the next at the sampling instant.)"""
        procs = max(1, int(self._procs()))
        held = len(worker_state.reserved_requests)
        if self._last_at is not None:
            self._busy_s += min(held, procs) * (now - self._last_at)
        self._last_at = now
        self._own.append((now, self._completed(), self._busy_s))
        while len(self._own) > 2 and now - self._own[0][0] > self.window_s:
            self._own.popleft()
        first = self._own[0]
        done = self._own[-1][1] - first[1]
        busy = self._own[-1][2] - first[2]
        if done >= 20 and busy > 0:
            return busy / done
        return None

    def _database(self) -> tuple[int, bool, float, float, int]:

        cap = cleanup_settings().eligible_count_cap
        with transaction.atomic():
            set_local_statement_timeout(cleanup_settings().autoscale_statement_timeout_ms)
            backlog = eligible_backlog(range(BUCKETS), cap)
            ((processed, recent, others),) = rows(
                sql.AUTOSCALE_WINDOW_RECEIPTS,
                {"half": self.window_s / 2, "hostname": self.hostname, "window": self.window_s},
            )
        self._processed_halves = (int(processed) - int(recent), int(recent))
        return (
            backlog.eligible,
            backlog.capped,
            backlog.oldest_age_seconds,
            int(processed) / self.window_s,
            int(others) + 1,
        )

    def _sustained_arrivals(self, now: float, backlog: int) -> float | None:
        """Holds arriving per second, as a *sustained* rate: arrivals (processed + backlog
        growth) in each half of the window, and the lower of the two. A one-off burst lands in
        one half only, so it does not count as a stream; the drain term sizes for it. None
        until the history covers most of the window."""
        history = self._backlog_history
        t0, b0 = history[0]
        if now - t0 < 0.8 * self.window_s:
            return None
        middle = now - self.window_s / 2
        tm, bm = min(history, key=lambda sample: abs(sample[0] - middle))
        if not t0 < tm < now:
            return None
        half = self.window_s / 2
        old_processed, recent_processed = self._processed_halves
        older = old_processed / half + (bm - b0) / (tm - t0)
        newer = recent_processed / half + (backlog - bm) / (now - tm)
        return max(0.0, min(older, newer))

    def read(self) -> Reading:

        now = time.monotonic()
        own_service = self._own_service_time(now)
        try:
            backlog, capped, oldest, processed_per_s, peers = self._database()
        except Exception as exc:  # noqa: BLE001 - a failed reading keeps the pool as it is
            connection.close()
            return Reading(now, error=f"database: {exc!r}"[:300])
        try:
            stats = queue_stats(cleanup_settings().release_queue)
        except Exception as exc:  # noqa: BLE001
            return Reading(now, error=f"broker: {exc!r}"[:300])
        if not stats.readable:
            # A planted key: the depth is unknown, so the pool is kept as it is until a worker
            # sets the key aside.
            return Reading(now, error=f"broker: unreadable keys {', '.join(stats.unreadable_keys)}")

        history = self._backlog_history
        history.append((now, backlog))
        while len(history) > 2 and now - history[0][0] > self.window_s:
            history.popleft()
        arrival = None if capped else self._sustained_arrivals(now, backlog)

        per_consumer = cleanup_settings().capacity_per_consumer_per_s
        if per_consumer > 0:
            service, source = 1.0 / per_consumer, "configured"
        elif own_service is not None:
            service, source = own_service, "measured"
        else:
            service, source = None, "default"
        return Reading(
            taken_at=now,
            backlog=backlog,
            backlog_capped=capped,
            oldest_eligible_age_s=round(oldest, 3),
            queue_depth=stats.depth,
            queue_oldest_age_s=(
                round(stats.oldest_age_seconds, 3) if stats.oldest_age_seconds is not None else None
            ),
            processed_per_s=round(processed_per_s, 3),
            peers=peers,
            arrival_per_s=round(arrival, 3) if arrival is not None else None,
            service_time_s=round(service, 5) if service is not None else None,
            service_source=source,
        )


# --- The Celery autoscaler -------------------------------------------------------------------


class BacklogAutoscaler(Autoscaler):
    """``worker_autoscaler`` class: Celery's pool-resizing mechanics, this module's policy."""

    def __init__(
        self,
        pool: Any,
        max_concurrency: int,
        min_concurrency: int = 0,
        worker: Any = None,
        keepalive: float | None = None,
        mutex: Any = None,
    ) -> None:

        interval = cleanup_settings().autoscale_interval
        # Celery's event loop calls maybe_scale every `keepalive` seconds.
        super().__init__(pool, max_concurrency, min_concurrency, worker, interval, mutex)
        self.interval = interval
        self.policy = self._policy()
        hostname = getattr(worker, "hostname", "") or ""
        self.reader = Reader(hostname, cleanup_settings().autoscale_window, self._procs)
        self._reading: Reading | None = None
        self._reading_lock = threading.Lock()
        self._last_change_at: float | None = None
        self._lower_since: float | None = None
        self._last_logged: tuple[str, int, int, str, bool] | None = None
        self._reader_stop = threading.Event()
        self._thread = threading.Thread(
            target=self._read_forever, name="cleanup-autoscale-reader", daemon=True
        )
        self._thread.start()

    def _policy(self) -> Policy:

        conf = cleanup_settings()
        return Policy(
            min_procs=int(self.min_concurrency),
            max_procs=int(self.max_concurrency),
            slo_seconds=float(conf.slo_seconds),
            slo_target=conf.autoscale_slo_target,
            utilization=conf.autoscale_utilization,
            headroom=conf.capacity_headroom,
            cooldown_seconds=conf.autoscale_cooldown,
            stale_after_seconds=max(3 * self.interval, 10.0),
            default_service_time_s=ASSUMED_SERVICE_TIME_S,
        )

    def _procs(self) -> int:
        try:
            return int(self.pool.num_processes)
        except Exception:  # noqa: BLE001 - pool not started yet
            return int(self.min_concurrency)

    def _read_forever(self) -> None:
        while not self._reader_stop.is_set():
            try:
                reading = self.reader.read()
            except Exception as exc:  # noqa: BLE001 - never let the thread die
                reading = Reading(time.monotonic(), error=f"reader: {exc!r}"[:300])
            with self._reading_lock:
                self._reading = reading
            self._reader_stop.wait(self.interval)

    # Celery's bgThread.body (used without an event loop, e.g. the solo/threads pools).
    def body(self) -> None:
        with self.mutex:
            self.maybe_scale()
        time.sleep(self.interval)

    def stop(self) -> None:
        self._reader_stop.set()
        super().stop()

    def update(self, max: int | None = None, min: int | None = None) -> tuple[int, int]:
        result = super().update(max, min)
        self.policy = self._policy()
        return result  # type: ignore[no-any-return]

    def _maybe_scale(self, req: Any = None) -> bool:
        # Called on every task message too: decide at most once per interval.
        now = time.monotonic()
        last = getattr(self, "_last_decided_at", None)
        if req is not None and last is not None and now - last < self.interval:
            return False
        self._last_decided_at = now
        with self._reading_lock:
            reading = self._reading
        current = self._procs()
        decision = decide(
            reading, self.policy, current, now, self._last_change_at, self._lower_since
        )
        if decision.target < current and decision.reason != "read_error":
            if self._lower_since is None:
                self._lower_since = now
        else:
            self._lower_since = None
        changed = False
        if decision.action == GROW:
            pool: Any = self.pool
            pool.grow(decision.target - current)
            changed = True
        elif decision.action == SHRINK:
            try:
                cast(Any, self.pool).shrink(current - decision.target)
            except ValueError:
                # billiard shrinks idle processes only; busy ones stay until the next decision.
                log.debug("autoscale: some processes busy; shrunk what was idle")
            changed = True
        if changed:
            self._last_change_at = now
            self._lower_since = None
        self._record(decision)
        return changed

    def _record(self, decision: Decision) -> None:

        after = decision.current if decision.action == HOLD else decision.target
        metrics.record_autoscale_decision(decision.action, decision.reason, after, decision.target)
        busy = bool(decision.inputs.get("backlog") or decision.inputs.get("queue_depth"))
        key = (decision.action, decision.current, decision.target, decision.reason, busy)
        # Every grow/shrink, and every hold that differs from the previous decision (action,
        # sizes, reason, backlog or none), at INFO; repeats at DEBUG. The metric counts all.
        repeat = decision.action == HOLD and key == self._last_logged
        level = logging.DEBUG if repeat else logging.INFO
        self._last_logged = key
        log.log(
            level,
            "autoscale decision",
            extra={
                "action": decision.action,
                "reason": decision.reason,
                "pool": decision.current,
                "target": decision.target,
                "min": self.policy.min_procs,
                "max": self.policy.max_procs,
                "fleet_drain": decision.fleet_drain,
                "fleet_sustain": decision.fleet_sustain,
                **{f"in_{k}": v for k, v in decision.inputs.items()},
            },
        )

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = super().info()
        with self._reading_lock:
            reading = self._reading
        info["policy"] = "cleanup.operations.scaling.autoscale:BacklogAutoscaler"
        info["reading"] = asdict(reading) if reading is not None else None
        return info
