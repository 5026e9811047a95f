"""The backlog-driven pool autoscaler (cleanup.operations.scaling.autoscale) in real
``celery worker --autoscale`` processes: the pool size is read from /proc (the worker's pool
children), the decisions from the worker's log.

Each test runs one worker of its own (the shared fleet is paused), with a short decision
interval and cooldown so the scenarios finish in tens of seconds.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from cleanup.conf import cleanup_settings
from tests.support.fleet import (
    Worker,
    create_eligible_holds,
    free_port,
    invariant_violations,
    log_fields,
    log_lines,
    queue_settled,
    released_count,
    scrape_worker,
    service_env,
    sweep_until,
    total,
    wait_until,
)

pytestmark = [pytest.mark.workers, pytest.mark.usefixtures("exclusive_workers", "clean")]

FAST = {"CLEANUP_AUTOSCALE_COOLDOWN": "5"}
# The autoscaler's tuning settings (Django settings of the worker's, not variables).
FAST_SETTINGS = {
    "CLEANUP_AUTOSCALE_INTERVAL": 1,
    "CLEANUP_AUTOSCALE_WINDOW": 10,
    "CLEANUP_AUTOSCALE_STATEMENT_TIMEOUT_MS": 500,
}

# SLO 20 s and a configured 5 releases/s per process: a backlog of B holds needs
# ceil(B × 0.2 s / (10 s − age)) processes, whatever the measured speed of this machine. The rate
# is below what one process does even on a loaded 2-core machine, so the arithmetic never sizes
# the pool below what the drain really needs.
SLOW_SERVICE = {"CLEANUP_SLO_SECONDS": "20", "CLEANUP_CAPACITY_PER_CONSUMER_PER_S": "5"}


class PoolWatch:
    """Samples the worker's pool size (its child processes) every 0.2 s in a thread."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._started, len(self.worker.children())))
            self._stop.wait(0.2)

    def __enter__(self) -> PoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def now(self) -> int:
        return len(self.worker.children())

    def peak(self) -> int:
        return max((n for _, n in self.samples), default=0)

    def timeline(self) -> list[tuple[float, int]]:
        """(seconds, pool size) at every change."""
        out: list[tuple[float, int]] = []
        for t, n in self.samples:
            if not out or out[-1][1] != n:
                out.append((round(t, 1), n))
        return out


@contextmanager
def autoscaled_worker(
    tmp_path: Path, autoscale: str, tuned: Mapping[str, object] | None = None, /, **env: str
) -> Iterator[tuple[Worker, PoolWatch]]:
    """A worker autoscaled between ``autoscale``'s bounds, with ``env`` and the Django settings
    ``tuned`` on top of FAST's."""
    worker = Worker(
        f"as-{uuid.uuid4().hex[:6]}",
        int(autoscale.split(",")[0]),
        tmp_path / "autoscaled.log",
        extra_args=[f"--autoscale={autoscale}"],
        env_overrides={**FAST, **env},
        django_settings={**FAST_SETTINGS, **(tuned or {})},
    ).start()
    try:
        worker.wait_ready()
        with PoolWatch(worker) as watch:
            yield worker, watch
    finally:
        worker.stop(timeout=30)


def decisions(worker: Worker) -> list[dict[str, str]]:
    return [log_fields(line) for line in log_lines([worker.log_path], "autoscale decision")]


def write_report(tmp_path: Path, name: str, watch: PoolWatch, worker: Worker) -> None:
    """The pool size over time and the decisions, for the docs and the closing note."""
    report = {
        "pool_size_timeline_s": watch.timeline(),
        "decisions": [
            {
                k: d.get(k)
                for k in (
                    "action",
                    "reason",
                    "pool",
                    "target",
                    "in_backlog",
                    "in_oldest_eligible_age_s",
                    "in_queue_depth",
                    "in_service_time_s",
                    "in_service_source",
                    "fleet_drain",
                    "fleet_sustain",
                )
            }
            for d in decisions(worker)
            if d.get("action") != "hold"
            or d.get("reason") != "at_target"
            or d.get("in_backlog") not in (None, "0")
        ][:60],
    }
    out = Path(os.environ.get("AUTOSCALE_REPORT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))


# Deadlines: each wait inside ends before the test's own timeout, whose sum they stay under
# (a stuck step fails saying what it waited for). The drains are generous: a busy machine.
@pytest.mark.timeout(420)
def test_a_backlog_grows_the_pool_to_max_and_an_idle_queue_shrinks_it_to_min(
    tmp_path: Path,
) -> None:
    # given: one worker that may run 1..4 processes, an SLO of 20 s, a configured service rate of
    # 5 releases/s per process (SLOW_SERVICE), and 1,200 holds that just expired: one process
    # needs ~240 s by that rate, far past the SLO. (3,000 holds at 20/s missed the 150 s drain
    # deadline once in clean-clone CI on a loaded machine. Readings get 3 s, not FAST's 500 ms:
    # on a loaded CI machine a 500 ms statement timeout turned readings into read errors, which
    # hold the size.)
    # One hold per message (CLEANUP_RELEASE_MODE "single"): this checks that a backlog of
    # per-reservation messages grows the pool. In the default adaptive mode the sweeps answer
    # the same backlog with multi-hold messages, which one process drains before the pool has
    # grown (the sizing is covered by test_adaptive.py and
    # tests/unit/cleanup/release/test_sizing.py).
    with autoscaled_worker(
        tmp_path,
        "4,1",
        {"CLEANUP_AUTOSCALE_STATEMENT_TIMEOUT_MS": 3000, "CLEANUP_RELEASE_MODE": "single"},
        **SLOW_SERVICE,
    ) as (worker, watch):
        wait_until(lambda: watch.now() == 1, timeout=30, what="the pool to start at min (1)")
        ids = create_eligible_holds(1200, expired_seconds_ago=1)
        started = time.monotonic()

        # when: sweeps publish the backlog
        sweep_until(lambda: watch.now() == 4, shards=2, timeout=60)
        grew_after = time.monotonic() - started

        # then: the pool reached max while the backlog was there
        assert released_count(ids) < len(ids), "grew only after the work was done"
        sweep_until(lambda: released_count(ids) == len(ids), shards=2, timeout=150)
        drained_after = time.monotonic() - started

        # and when the queue is idle, the pool returns to min after the cooldown
        try:
            wait_until(lambda: watch.now() == 1, timeout=60, what="the pool to shrink to min (1)")
        except TimeoutError as exc:
            # the autoscaler's own account of why it held the size
            raise AssertionError(f"{exc}; last decisions: {decisions(worker)[-6:]}") from exc
        shrank_after = time.monotonic() - started
        write_report(tmp_path, "autoscale-grow-shrink", watch, worker)

    grows = [d for d in decisions(worker) if d.get("action") == "grow"]
    shrinks = [d for d in decisions(worker) if d.get("action") == "shrink"]
    assert grows and grows[0]["reason"] in {"backlog", "slo_at_risk", "arrivals"}, grows
    assert int(grows[0]["in_backlog"]) > 0
    # (it may already shrink while the tail of the backlog drains, once fewer processes clear
    # it within the SLO budget; an idle queue always ends at min)
    assert shrinks and shrinks[-1]["target"] == "1", shrinks
    assert {d["reason"] for d in shrinks} <= {"idle", "backlog"}, shrinks
    assert invariant_violations(ids) == []
    print(  # the measurement, shown with -s
        f"grew to 4 after {grew_after:.1f}s, drained after {drained_after:.1f}s, "
        f"back to 1 after {shrank_after:.1f}s; pool timeline {watch.timeline()}"
    )


def test_a_burst_the_current_pool_drains_within_the_slo_does_not_grow_it(
    tmp_path: Path,
) -> None:
    # given: a worker at 2 of up to 4 processes, the default 300 s SLO, and 600 holds that just
    # expired: two processes drain them in seconds, far inside the SLO.
    with autoscaled_worker(tmp_path, "4,2") as (worker, watch):
        wait_until(lambda: watch.now() == 2, timeout=30, what="the pool to start at min (2)")
        ids = create_eligible_holds(600, expired_seconds_ago=1)
        # the autoscaler sees the backlog before any sweep claims it (a claimed hold is not
        # eligible, and the queue drains in about a second: faster than one reading apart)
        wait_until(
            lambda: any(int(d.get("in_backlog", "0")) > 0 for d in decisions(worker)),
            timeout=30,
            what="a decision that saw the backlog",
        )

        # when
        sweep_until(lambda: released_count(ids) == len(ids), shards=2, timeout=120)
        # a decision after the burst, with the rates measured over it: the last one logged
        # saw no backlog (a decision is logged whenever it differs from the one before, and
        # the first idle reading differs from every busy one)
        wait_until(
            lambda: (seen := decisions(worker)) and seen[-1].get("in_backlog") == "0",
            timeout=30,
            what="a decision after the burst drained",
        )
        write_report(tmp_path, "autoscale-burst-no-growth", watch, worker)

    # then: every hold released, and the pool never grew
    assert invariant_violations(ids) == []
    assert watch.peak() == 2, watch.timeline()
    seen = decisions(worker)
    assert seen, "the autoscaler made no decision"
    assert not [d for d in seen if d.get("action") == "grow"]


# More failed decisions than the 8 s cooldown holds at one decision per 1 s interval.
READ_ERROR_DECISIONS = 12


def metrics_served(tmp_path: Path, port: int) -> dict[str, str]:
    """The worker's own metrics on ``port`` (the autoscaler counts every decision there)."""
    return {
        "WORKER_METRICS_PORT": str(port),
        "WORKER_METRICS_ADDR": "127.0.0.1",
        "WORKER_METRICS_DIR": str(tmp_path / "prom"),
    }


def _decisions_counted(port: int, reason: str) -> float:
    samples, _ = scrape_worker(port)
    return total(samples, "reservation_cleanup_autoscale_decisions_total", reason=reason)


@pytest.mark.timeout(480)
def test_a_database_read_error_keeps_the_current_size(tmp_path: Path) -> None:
    # given: a worker grown to 4 by a backlog, which then drains (so it would shrink to 1);
    # 600 holds at a configured 5 releases/s per process need 4 processes by the arithmetic,
    # and drain in well under a minute even on a loaded machine; one hold per message, as in the
    # test above, so the pool has grown before the backlog is gone
    port = free_port()
    with autoscaled_worker(
        tmp_path,
        "4,1",
        {"CLEANUP_RELEASE_MODE": "single"},
        **SLOW_SERVICE,
        **metrics_served(tmp_path, port),
        CLEANUP_AUTOSCALE_COOLDOWN="8",
    ) as (worker, watch):
        ids = create_eligible_holds(600, expired_seconds_ago=1)
        sweep_until(lambda: watch.now() == 4, shards=2, timeout=60)
        sweep_until(lambda: released_count(ids) == len(ids), shards=2, timeout=150)
        # and no task is left to run: a task started under the lock below (a sweep, or one of
        # the copies a busy machine leaves queued once leases run out) would keep a pool
        # process busy, and billiard shrinks idle processes only, so the pool would keep its
        # size whatever the autoscaler decided
        conf = cleanup_settings()
        queues = (conf.sweep_queue, conf.release_queue)
        wait_until(
            lambda: all(queue_settled(q) for q in queues),
            timeout=120,
            what="the sweep and release queues settled",
        )

        # when: the autoscaler's reads fail (the test holds an exclusive lock on the holds
        # table, so its statements hit their 500 ms timeout) for more than a cooldown's worth
        # of decisions
        dsn = service_env()["DATABASE_URL"]
        with psycopg.connect(dsn) as blocker:
            blocker.execute("LOCK TABLE reservations_reservation IN ACCESS EXCLUSIVE MODE")
            wait_until(
                lambda: any(d.get("reason") == "read_error" for d in decisions(worker)),
                timeout=20,
                what="a read_error decision",
            )
            failed_from = len(watch.samples)
            # the worker logs only the first of a run of equal decisions, but counts each in
            # its metrics: wait for more failed decisions than fit in a cooldown (one per
            # 1 s interval, cooldown 8 s), so the pool would have shrunk meanwhile
            wait_until(
                lambda: _decisions_counted(port, "read_error") >= READ_ERROR_DECISIONS,
                timeout=60,
                what=f"{READ_ERROR_DECISIONS} read_error decisions",
            )
            held = [n for _, n in watch.samples[failed_from:]]
            blocker.rollback()
        # then: the pool kept its size through every failed reading
        assert held and set(held) == {4}, watch.timeline()

        # and once reads work again it shrinks as usual (so it would have shrunk before)
        wait_until(lambda: watch.now() == 1, timeout=60, what="the pool to shrink after the error")
        write_report(tmp_path, "autoscale-read-error", watch, worker)

    errors = [d for d in decisions(worker) if d.get("reason") == "read_error"]
    assert errors and all(d["action"] == "hold" for d in errors)
    assert "database" in log_lines([worker.log_path], "reason=read_error")[0]
    assert invariant_violations(ids) == []


def test_a_broker_read_error_is_a_failed_reading(settings: object) -> None:
    """The reader reports an unreachable broker as an error (so ``decide`` holds), never as an
    empty queue. The database part reads the real test database."""
    from cleanup.operations.scaling.autoscale import Policy, Reader, decide

    # given: a broker URL where nothing listens (port 1 on this host), of the broker's kind
    redis = settings.BROKER_IS_REDIS  # type: ignore[attr-defined]
    settings.CELERY_BROKER_URL = (  # type: ignore[attr-defined]
        "redis://127.0.0.1:1/0" if redis else "amqp://guest:guest@127.0.0.1:1//"
    )
    reader = Reader("me@host", 10, lambda: 3)

    # when
    reading = reader.read()

    # then
    assert reading.error.startswith("broker:"), reading
    decision = decide(reading, Policy(min_procs=1, max_procs=4), 3, time.monotonic())
    assert (decision.action, decision.target, decision.reason) == ("hold", 3, "read_error")
