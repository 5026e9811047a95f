"""The burst drill: create a burst of expiring holds, watch the pipeline drain it, check the
invariants, and write a report (JSON, Markdown, and a PNG plot when matplotlib is installed).

Samples every second, from the sources the metrics use: the oldest eligible hold's age per shard
(one index probe per bucket), the release queue's depth and oldest message age
(``cleanup.broker.readers.queue_stats``), delivery attempts (the delivery counters), dead
letters; and, every ``count_every`` seconds (one second up to 100,000 holds, one more per
100,000 above), the counts that scan the drill's holds: eligible, released, outcomes and
retries (receipts), redeliveries. A sample between two counts repeats the last ones. The
drill's own reads must not compete with the pipeline it measures: at a million holds, counting
every second took a share of the database comparable to the releases. Optionally
renews a fraction of the holds before they expire, delivers a fraction of the release messages
twice (``_copy_messages``), and — when it started the workers itself — drains one worker
(SIGTERM) and SIGKILLs another.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

from cleanup.broker import readers as broker
from cleanup.conf import cleanup_settings
from cleanup.release import delivery_cap
from cleanup.release.messages import BATCH_KIND
from cleanup.release.publish import send_sweep
from reservations import services
from reservations.db import rows, scalar
from reservations.errors import NotHeld, ReservationExpired, StaleVersion
from reservations.models import BUCKETS
from tools.drills import set_based, sql
from tools.drills.invariants import invariant_violations
from tools.drills.report import write_outputs
from tools.drills.state import BurstConfig, BurstState, Sample
from tools.drills.workers import WorkerProcess
from tools.seed import seed_holds

RENEW_TTL_SECONDS = 3600  # renewed holds outlive the drill: they must stay held
# Holds seeded per second, well below what a loaded 2-core machine did (48,000): the start of
# the holds' expiries is set this far ahead of the seeding's start.
SEED_HOLDS_PER_S_ESTIMATE = 30_000
SEED_SETUP_S = 2.0  # and the statistics refreshed after it (ANALYZE), whatever the holds


def create_holds(cfg: BurstConfig, start: datetime) -> list[int]:
    """``cfg.holds`` held reservations over ``cfg.offerings`` offerings (seats accounted),
    expiring evenly from ``start`` + lead to ``start`` + lead + window (window 0: all at
    ``start`` + lead); ``next_attempt_at = expires_at`` as ``hold_seat`` sets it. Bulk SQL, one
    statement per offering."""
    stamp = datetime.now(UTC).strftime("%H%M%S")
    return seed_holds(
        cfg.holds,
        offerings=cfg.offerings,
        expires_in=lambda p: cfg.lead + cfg.window * p / cfg.holds,
        name=f"burst-{stamp}",
        interleave=True,
        anchor=start,
    )


def seed_then_start(cfg: BurstConfig, state: BurstState, rng: random.Random) -> None:
    """Seed the holds, all expiring relative to one start a little after the seeding should
    end, then wait for that start: a seeding of a million holds takes tens of seconds, and
    expiries relative to each statement's time would have the first holds due (and a backlog
    built) before the drill's clock starts. A seeding that overruns its estimate is an event of
    the report, and its holds were due that much before the clock started. The holds to renew
    are chosen while it waits."""
    began = datetime.now(UTC)
    start = began + timedelta(seconds=SEED_SETUP_S + cfg.holds / SEED_HOLDS_PER_S_ESTIMATE)
    state.ids = create_holds(cfg, start)
    seeded = datetime.now(UTC)
    state.events.append(
        {"t": 0.0, "event": "holds created", "count": len(state.ids),
         "seeding_s": round((seeded - began).total_seconds(), 1)}
    )  # fmt: skip
    if cfg.renew_fraction:
        state.renew_set = set(rng.sample(state.ids, int(len(state.ids) * cfg.renew_fraction)))
    state.renew_schedule = expiring_by(state.renew_set)
    wait = (start - datetime.now(UTC)).total_seconds()
    if wait > 0:
        time.sleep(wait)
    else:
        state.events.append({"t": 0.0, "event": f"seeding overran its start by {-wait:.1f} s"})


def expiring_by(ids: set[int]) -> list[tuple[datetime, int]]:
    """(expires_at, id) of ``ids``, soonest first: read once, so that each second the drill
    asks only about the holds whose time has come."""
    return sorted(rows(sql.DRILL_EXPIRY, [list(ids)])) if ids else []


def _come_due(schedule: list[tuple[datetime, int]], until: datetime) -> list[int]:
    """The ids of ``schedule`` expiring by ``until`` (removed from it)."""
    n = 0
    while n < len(schedule) and schedule[n][0] <= until:
        n += 1
    due = [rid for _, rid in schedule[:n]]
    del schedule[:n]
    return due


def _renew_due(cfg: BurstConfig, state: BurstState) -> None:
    """Renew renew-set holds that expire within the next 2.5 s (before they expire)."""
    state.renew_window.extend(
        _come_due(state.renew_schedule, datetime.now(UTC) + timedelta(seconds=2.5))
    )
    if not state.renew_window:
        return
    due = rows(sql.DRILL_HOLDS_TO_RENEW, [state.renew_window])
    for rid, version in due:
        try:
            services.renew(rid, version, ttl_seconds=RENEW_TTL_SECONDS)
            state.renewed.append(rid)
        except (ReservationExpired, StaleVersion, NotHeld):
            state.renew_missed += 1
        state.renew_set.discard(rid)
    # Those that expired before we got to them are ordinary eligible holds now (one that
    # expired between that read and its renew was counted above).
    gone = rows(sql.DRILL_HOLDS_EXPIRED, [state.renew_window])
    for (rid,) in gone:
        if rid in state.renew_set:
            state.renew_set.discard(rid)
            state.renew_missed += 1
    state.renew_window = [rid for rid in state.renew_window if rid in state.renew_set]


# The newest release messages the drill looks at each round for messages not seen before: more
# than the sweeps publish in a second at the largest message size.
COPY_PEEK = 500


def _copy_messages(cfg: BurstConfig, state: BurstState, rng: random.Random) -> None:
    """Deliver ``duplicate_fraction`` of the release messages twice: each round, every message
    in the release queue not seen before is copied back into it with that probability. A
    duplicate delivery is a copy of a whole message, the way it happens in production (a
    redelivery after a lost acknowledgment, a publisher's retry after a lost confirm): the same
    envelope, signature and holds. (One-hold copies of the holds of 500-hold messages, as the
    drill once sent, were 45,000 extra messages in a million-hold sale, a load nothing in the
    product makes.) A message consumed before the drill looks is never copied, so at light load
    fewer than the fraction are; the report counts the copies."""
    if not cfg.duplicate_fraction:
        return
    client = broker.redis_client()
    for key in broker.priority_keys(cleanup_settings().release_queue):
        for raw in client.lrange(key, 0, COPY_PEEK - 1):
            try:
                envelope = json.loads(raw)
                tag = envelope["properties"]["delivery_tag"]
            except (ValueError, KeyError, TypeError):
                continue
            if tag in state.seen_messages:
                continue
            state.seen_messages.add(tag)
            if rng.random() < cfg.duplicate_fraction:
                client.lpush(key, raw)
                state.duplicate_messages += 1
                state.duplicates += _holds_in(envelope)


def _holds_in(envelope: dict[str, Any]) -> int:
    """The holds a release message's envelope carries (a batch's items, else one)."""
    message = delivery_cap.envelope_message(envelope)
    if isinstance(message, dict) and message.get("kind") == BATCH_KIND:
        return len(message.get("items", []))
    return 1


def _send_sweeps(cfg: BurstConfig, stop: threading.Event) -> None:
    """Every ``sweep_every`` seconds, one sweep per shard, as beat would send them: on a clock
    of their own, so that the drill's samples, renewals and duplicates never delay them."""
    while not stop.is_set():
        began = time.monotonic()
        for shard in range(cfg.shards):
            send_sweep(shard, cfg.shards)
        stop.wait(max(0.0, cfg.sweep_every - (time.monotonic() - began)))


def count_every(holds: int) -> float:
    """Seconds between two readings of the counts that scan the drill's holds."""
    return max(1.0, holds / 100_000)


def sample(
    cfg: BurstConfig,
    state: BurstState,
    t: float,
    workers: list[WorkerProcess],
    *,
    count: bool,
) -> Sample:
    """One sample; the counts are read when ``count`` is true, else repeated from the last."""
    lo, hi = state.ids[0], state.ids[-1]
    shards = rows(
        sql.DRILL_OLDEST_BY_SHARD,
        # only the drill's own holds: other rows never pollute it
        {"shards": cfg.shards, "buckets": BUCKETS, "lo": lo, "hi": hi},
    )
    by_shard = {str(s): round(float(age), 2) for s, age in shards}
    last = state.samples[-1] if state.samples else None
    if count or last is None:
        eligible = int(scalar(sql.DRILL_ELIGIBLE, [lo, hi]))
        released = int(scalar(sql.DRILL_RELEASED, [lo, hi]))
        receipts = rows(sql.DRILL_RECEIPT_OUTCOMES, [lo, hi])
        outcomes = {o: int(c) for o, c, _r in receipts}
        retries = sum(int(r) for _o, _c, r in receipts)
        redeliveries = int(scalar(sql.DRILL_REDELIVERIES, [lo, hi]))
    else:
        eligible, released, outcomes = last.eligible, last.released, last.outcomes
        retries, redeliveries = last.retries, last.redeliveries
    dead = scalar(sql.DEAD_LETTERS_IN_LAST, [t + 60])
    q = broker.queue_stats(cleanup_settings().release_queue)
    return Sample(
        t=round(t, 2),
        eligible=eligible,
        oldest_eligible_s=max(by_shard.values()) if by_shard else None,
        oldest_by_shard=by_shard,
        queue_depth=q.depth,
        oldest_message_s=None if q.oldest_age_seconds is None else round(q.oldest_age_seconds, 2),
        unacked=q.unacked,
        released=released,
        attempts=attempts_so_far(state),
        redeliveries=redeliveries,
        receipts=sum(outcomes.values()),
        outcomes=outcomes,
        retries=retries,
        dead_letters=int(dead),
        renewed=len(state.renewed),
        duplicates=state.duplicates,
        workers_alive=sum(1 for w in workers if w.alive()),
    )


def caught_up(eligible: int, queue_depth: int) -> bool:
    """Whether the pipeline has caught up: no eligible hold left, nothing in the release
    queue (the burst drill's and the soak's ``finished``, once their traffic has stopped)."""
    return eligible == 0 and queue_depth == 0


def attempts_so_far(state: BurstState) -> int:
    """Release attempts (one per hold, batched or not) since the drill began, as tallied."""
    return delivery_cap.attempts_from(state.tally_minute) - state.tally_before


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total) if total else width
    return "#" * filled + "-" * (width - filled)


def status_text(s: Sample, expected: int) -> str:
    oldest = "-" if s.oldest_eligible_s is None else f"{s.oldest_eligible_s:.1f}s"
    age = "-" if s.oldest_message_s is None else f"{s.oldest_message_s:.1f}s"
    return (
        f"[{s.t:6.0f}s] |{_bar(s.released, expected)}| released {s.released}/{expected} "
        f"eligible {s.eligible} oldest {oldest} queue {s.queue_depth} (oldest {age}) "
        f"workers {s.workers_alive}"
    )


def progress_line(s: Sample, expected: int) -> str:
    """The status redrawn in place on a terminal."""
    return f"\r{status_text(s, expected)}   "


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """The drill's progress on ``stream``. On a terminal: one line redrawn in place (``\\r``)
    every sample. Anywhere else (a log file, a pipe, CI): a plain line every ``every`` seconds
    and the last sample's at the end, never a ``\\r``."""

    def __init__(self, stream: TextIO, every: float = 10.0) -> None:
        self.stream = stream
        self.tty = _isatty(stream)
        self.every = every
        self.last_line_at = -math.inf
        self.unwritten = ""

    def update(self, s: Sample, expected: int) -> None:
        if self.tty:
            self.stream.write(progress_line(s, expected))
        elif s.t - self.last_line_at >= self.every:
            self.stream.write(status_text(s, expected) + "\n")
            self.last_line_at = s.t
            self.unwritten = ""
        else:
            self.unwritten = status_text(s, expected)
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        elif self.unwritten:
            self.stream.write(self.unwritten + "\n")
            self.unwritten = ""
        self.stream.flush()


def run(cfg: BurstConfig, stream: TextIO = sys.stderr) -> dict[str, Any]:
    """Run the drill; return the report (also written to ``cfg.out``)."""
    rng = random.Random(cfg.seed)
    cfg.out.mkdir(parents=True, exist_ok=True)
    state = BurstState()
    workers: list[WorkerProcess] = []
    if cfg.workers:
        stamp = datetime.now(UTC).strftime("%H%M%S")
        workers = [
            WorkerProcess(f"burst{i}-{stamp}", cfg.concurrency, cfg.out / f"worker{i}.log")
            for i in range(cfg.workers)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready()
    timeout = cfg.timeout if cfg.timeout is not None else cfg.lead + cfg.window + 600
    progress = Progress(stream)
    stop = threading.Event()
    try:
        seed_then_start(cfg, state, rng)
        state.tally_minute = delivery_cap.current_minute()
        state.tally_before = delivery_cap.attempts_from(state.tally_minute)
        t0 = time.monotonic()
        drained = killed = False
        sweeper: threading.Thread | None = None
        last_count = -math.inf
        finished = False
        while True:
            t = time.monotonic() - t0
            if cfg.send_sweeps and sweeper is None:
                sweeper = threading.Thread(target=_send_sweeps, args=(cfg, stop), daemon=True)
                sweeper.start()
            if workers and cfg.drain_at is not None and not drained and t >= cfg.drain_at:
                workers[0].terminate()
                drained = True
                state.events.append(
                    {"t": round(t, 2), "event": f"drain (SIGTERM) {workers[0].name}"}
                )
            if workers and cfg.kill_at is not None and not killed and t >= cfg.kill_at:
                victim = workers[-1] if len(workers) > 1 else workers[0]
                victim.kill()
                killed = True
                state.events.append({"t": round(t, 2), "event": f"kill (SIGKILL) {victim.name}"})
            _renew_due(cfg, state)
            _copy_messages(cfg, state, rng)
            past_window = t >= cfg.lead + cfg.window
            # Count on schedule, and whenever the cheap readings say the drain may be done.
            quiet = bool(state.samples) and not state.samples[-1].oldest_by_shard
            count = t - last_count >= count_every(cfg.holds) or (past_window and quiet)
            if count:
                last_count = t
            s = sample(cfg, state, t, workers, count=count)
            state.samples.append(s)
            expected = len(state.ids) - len(state.renewed) - len(state.renew_set)
            progress.update(s, expected)
            if (
                count
                and past_window
                and caught_up(s.eligible, s.queue_depth)
                and s.released >= expected
                and not state.renew_set
            ):
                finished = True
                break
            if t >= timeout:
                break
            time.sleep(max(0.0, 1.0 - ((time.monotonic() - t0) - t)))
        progress.close()
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        for w in workers:
            w.stop(timeout=60)
    renewed = sorted(state.renewed)
    renewed_set = set(renewed)
    expected_released = [i for i in state.ids if i not in renewed_set]
    violations = invariant_violations(expected_released, renewed)
    if not finished:
        violations.insert(0, f"did not finish within {timeout:.0f} s")
    report = build_report(cfg, state, elapsed, finished, violations, workers)
    if cfg.set_based:
        # After the invariants are read and with the workers stopped: alone on the machine, as
        # the bench measures it, in the same database the drain just used.
        report["set_based"] = set_based.measure(cfg.set_based, cfg.offerings)
        rate = report["summary"]["processing_rate_per_s"]
        ceiling = report["set_based"]["rows_per_s"]
        report["drain_vs_set_based"] = round(rate / ceiling, 3) if rate and ceiling else None
    write_outputs(cfg, report, state)
    return report


def build_report(
    cfg: BurstConfig,
    state: BurstState,
    elapsed: float,
    finished: bool,
    violations: list[str],
    workers: list[WorkerProcess],
) -> dict[str, Any]:
    lo, hi = state.ids[0], state.ids[-1]
    stats = rows(sql.DRILL_RECEIPT_STATS, [lo, hi])[0]
    receipts, mean_ms, median_ms, p99_queue_age, busy_s = stats
    lateness = rows(sql.DRILL_RELEASE_LATENESS, [lo, hi])[0]
    # Release messages that wrote these receipts (a batch message is one task id), and how
    # many of them carried a single hold.
    messages, single_hold_messages = rows(sql.DRILL_MESSAGES, [lo, hi])[0]
    last = state.samples[-1] if state.samples else None
    ages = [s.oldest_eligible_s or 0.0 for s in state.samples]
    # When each shard's oldest eligible hold was last seen (its backlog cleared after that).
    shard_cleared: dict[str, float] = {}
    for sample in state.samples:
        for shard, age in sample.oldest_by_shard.items():
            if age and age > 0:
                shard_cleared[shard] = sample.t
    above = sum(1 for a in ages if a > cfg.slo)
    consumers = cfg.workers * cfg.concurrency
    processed = int(receipts or 0)
    # Effective service time per consumer: consumer-seconds while receipts were being written,
    # over messages processed (includes Celery/broker overhead and the lost consumers' time).
    service_eff = (
        consumers * float(busy_s) / processed if consumers and processed and busy_s else None
    )
    arrival = cfg.holds / cfg.window if cfg.window else None
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "finished": finished,
        "elapsed_s": round(elapsed, 2),
        "holds": len(state.ids),
        "first_id": state.ids[0] if state.ids else 0,
        "last_id": state.ids[-1] if state.ids else 0,
        "release_mode": cleanup_settings().release_mode,
        "renewed": len(state.renewed),
        "renew_missed": state.renew_missed,
        "duplicates_published": state.duplicates,
        "duplicate_messages": state.duplicate_messages,
        "events": state.events,
        "summary": {
            "peak_oldest_eligible_s": max(ages) if ages else None,
            "seconds_above_slo": above,
            "slo_s": cfg.slo,
            "peak_eligible": max((s.eligible for s in state.samples), default=0),
            "peak_queue_depth": max((s.queue_depth for s in state.samples), default=0),
            "released": last.released if last else 0,
            "outcomes": last.outcomes if last else {},
            # Read after the drill's workers stopped (each adds its tally when it stops).
            "attempts": attempts_so_far(state),
            "redeliveries": last.redeliveries if last else 0,
            "retries": last.retries if last else 0,
            "dead_letters": last.dead_letters if last else 0,
            "receipts": processed,
            "messages": int(messages or 0),
            "single_hold_messages": int(single_hold_messages or 0),
            "single_hold_message_share": (
                round(int(single_hold_messages) / int(messages), 4) if messages else None
            ),
            "shard_backlog_last_seen_s": dict(sorted(shard_cleared.items())),
            "processing_window_s": None if busy_s is None else round(float(busy_s), 2),
            "processing_rate_per_s": round(processed / float(busy_s), 2) if busy_s else None,
            "release_db_ms_mean": None if mean_ms is None else round(float(mean_ms), 2),
            "release_db_ms_median": None if median_ms is None else round(float(median_ms), 2),
            "queue_age_p99_s": None if p99_queue_age is None else round(float(p99_queue_age), 2),
            "release_lateness_p50_s": None if not lateness[0] else round(lateness[0][0], 2),
            "release_lateness_p99_s": None if not lateness[0] else round(lateness[0][1], 2),
            "release_lateness_max_s": None if lateness[1] is None else round(lateness[1], 2),
        },
        "capacity_inputs": {
            "arrival_rate_per_s": arrival,
            "consumers": consumers or None,
            "service_time_s": None if service_eff is None else round(service_eff, 5),
            "service_time_note": "consumers × processing window ÷ messages processed",
        },
        "invariants": {"ok": not violations, "violations": violations},
        "workers": [{"name": w.name, "pid": w.pid, "log": str(w.log_path)} for w in workers],
        "samples": [asdict(s) for s in state.samples],
    }
