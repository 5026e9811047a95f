"""The burst drill: create a burst of expiring holds, watch the pipeline drain it, check the
invariants, and write a report (JSON, Markdown, and a PNG plot when matplotlib is installed).

Samples every second, from the sources the metrics use: the oldest eligible hold's age per shard
(SQL), the eligible count, the release queue's depth and oldest message age
(``cleanup.broker.readers.queue_stats``), delivery attempts (the delivery counters),
transitions (holds released), outcomes and retries (receipts), dead letters. Optionally
renews a fraction of the holds before they expire, re-publishes a fraction of already published
release messages, and — when it started the workers itself — drains one worker (SIGTERM) and
SIGKILLs another.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from cleanup.broker import readers as broker
from cleanup.conf import cleanup_settings
from cleanup.release import delivery_cap
from cleanup.release.messages import ReleaseMessage, idempotency_key
from cleanup.release.publish import publish_release_messages, send_sweep
from reservations import services
from reservations.db import rows, scalar
from reservations.errors import NotHeld, ReservationExpired, StaleVersion
from tools.drills import sql
from tools.drills.invariants import invariant_violations
from tools.drills.report import write_outputs
from tools.drills.state import BurstConfig, BurstState, Sample
from tools.drills.workers import WorkerProcess
from tools.seed import seed_holds

RENEW_TTL_SECONDS = 3600  # renewed holds outlive the drill: they must stay held


def create_holds(cfg: BurstConfig) -> list[int]:
    """``cfg.holds`` held reservations over ``cfg.offerings`` offerings (seats accounted),
    expiring evenly from now + lead to now + lead + window (window 0: all at now + lead);
    ``next_attempt_at = expires_at`` as ``hold_seat`` sets it. Bulk SQL, one statement per
    offering."""
    stamp = datetime.now(UTC).strftime("%H%M%S")
    return seed_holds(
        cfg.holds,
        offerings=cfg.offerings,
        expires_in=lambda p: cfg.lead + cfg.window * p / cfg.holds,
        name=f"burst-{stamp}",
        interleave=True,
    )


def _renew_due(cfg: BurstConfig, state: BurstState) -> None:
    """Renew renew-set holds that expire within the next 2.5 s (before they expire)."""
    if not state.renew_set:
        return
    due = rows(sql.DRILL_HOLDS_TO_RENEW, [list(state.renew_set)])
    for rid, version in due:
        try:
            services.renew(rid, version, ttl_seconds=RENEW_TTL_SECONDS)
            state.renewed.append(rid)
        except (ReservationExpired, StaleVersion, NotHeld):
            state.renew_missed += 1
        state.renew_set.discard(rid)
    # Those that expired before we got to them are ordinary eligible holds now.
    gone = rows(sql.DRILL_HOLDS_EXPIRED, [list(state.renew_set)])
    for (rid,) in gone:
        state.renew_set.discard(rid)
        state.renew_missed += 1


def _publish_duplicates(cfg: BurstConfig, state: BurstState) -> None:
    """Re-publish the release message of candidates a sweep has already published."""
    todo = list(state.dup_candidates - state.duplicated)
    if not todo:
        return
    dupes = rows(sql.DRILL_HOLDS_CLAIMED, [todo])
    if not dupes:
        return
    publish_release_messages(
        [
            ReleaseMessage.for_hold(rid, v, exp, bucket % cfg.shards, "burst-duplicate")
            for rid, v, exp, bucket in dupes
        ]
    )
    state.duplicated.update(r[0] for r in dupes)


def _send_sweeps(cfg: BurstConfig) -> None:
    for shard in range(cfg.shards):
        send_sweep(shard, cfg.shards)


def sample(
    cfg: BurstConfig, state: BurstState, t: float, keys: list[str], workers: list[WorkerProcess]
) -> Sample:
    lo, hi = state.ids[0], state.ids[-1]
    shards = rows(
        sql.DRILL_ELIGIBLE_BY_SHARD,
        [cfg.shards, lo, hi],  # only the drill's own holds: other rows never pollute it
    )
    by_shard = {str(s): round(float(age), 2) for s, _c, age in shards}
    eligible = sum(int(c) for _s, c, _a in shards)
    released = scalar(sql.DRILL_RELEASED, [lo, hi])
    receipts = rows(sql.DRILL_RECEIPT_OUTCOMES, [lo, hi])
    outcomes = {o: int(c) for o, c, _r in receipts}
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
        released=int(released),
        attempts=attempts_so_far(state),
        redeliveries=delivery_cap.total(keys),
        receipts=sum(outcomes.values()),
        outcomes=outcomes,
        retries=sum(int(r) for _o, _c, r in receipts),
        dead_letters=int(dead),
        renewed=len(state.renewed),
        duplicates=len(state.duplicated),
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
    try:
        state.ids = create_holds(cfg)
        state.tally_minute = delivery_cap.current_minute()
        state.tally_before = delivery_cap.attempts_from(state.tally_minute)
        t0 = time.monotonic()
        state.events.append({"t": 0.0, "event": "holds created", "count": len(state.ids)})
        if cfg.renew_fraction:
            state.renew_set = set(rng.sample(state.ids, int(len(state.ids) * cfg.renew_fraction)))
        if cfg.duplicate_fraction:
            rest = [i for i in state.ids if i not in state.renew_set]
            state.dup_candidates = set(rng.sample(rest, int(len(rest) * cfg.duplicate_fraction)))
        keys = [idempotency_key(i, 1) for i in state.ids]
        drained = killed = False
        last_sweep = -math.inf
        finished = False
        while True:
            t = time.monotonic() - t0
            if cfg.send_sweeps and t - last_sweep >= cfg.sweep_every:
                _send_sweeps(cfg)
                last_sweep = t
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
            _publish_duplicates(cfg, state)
            s = sample(cfg, state, t, keys, workers)
            state.samples.append(s)
            expected = len(state.ids) - len(state.renewed) - len(state.renew_set)
            progress.update(s, expected)
            past_window = t >= cfg.lead + cfg.window
            dups_done = not (state.dup_candidates - state.duplicated)
            if (
                past_window
                and caught_up(s.eligible, s.queue_depth)
                and dups_done
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
        for w in workers:
            w.stop(timeout=60)
    renewed = sorted(state.renewed)
    renewed_set = set(renewed)
    expected_released = [i for i in state.ids if i not in renewed_set]
    violations = invariant_violations(expected_released, renewed)
    if not finished:
        violations.insert(0, f"did not finish within {timeout:.0f} s")
    report = build_report(cfg, state, elapsed, finished, violations, workers)
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
        "duplicates_published": len(state.duplicated),
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
