"""Sweep one shard: claim bounded batches of its eligible holds and publish their release
messages, each batch's messages before its claim commits.

- Claims go through ``cleanup.release.claim.claim_expired`` (FOR UPDATE SKIP LOCKED, a lease).
- A per-shard advisory lock, held for the whole run, makes a second sweep of the shard a no-op.
- A global publish lock, waited for in line (PostgreSQL grants a lock to its waiters in the
  order they asked) for at most ``CLEANUP_SWEEP_LOCK_WAIT``, serializes "check depth → take
  room" across sweeps; ``_PublishTurn`` holds it for one batch and lets go of it (and of the
  batch's reserved room) however the batch ends.
- Whether a batch may be published and how many holds it takes (backpressure at the queue's
  cap, the room the sweeps ahead take, turns near the cap) is ``cleanup.release.admission``'s
  decision; the loop asks it and records why the run ends (``_stop``).
- How many holds each message carries is ``cleanup.release.sizing``'s.

docs/PIPELINE.md, "Sweep".
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.db import DatabaseError, InterfaceError, OperationalError, transaction

from cleanup import metrics, sql, tracing
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release import admission, dead_letters, locks
from cleanup.release.admission import Reason, Stop
from cleanup.release.claim import ClaimedReservation, claim_expired
from cleanup.release.messages import ReleaseMessage
from cleanup.release.publish import publish_release_messages
from cleanup.release.sizing import DueBacklog, ServiceRate, messages_for, note_sizing
from reservations import db

logger = logging.getLogger("cleanup.sweep")


@dataclass
class SweepResult:
    shard: int
    shards: int
    trace_id: str
    batches: int = 0
    claimed: int = 0
    published: int = 0
    set_aside: int = 0
    backpressure: bool = False
    skipped_locked: bool = False
    budget_exhausted: bool = False
    timed_out: bool = False
    took_share: bool = False  # stopped after its share of the room near the cap
    gave_way: bool = False  # left near the cap: another shard's oldest due hold is older
    duration_s: float = 0.0
    messages: int = 0  # release messages published (``published`` counts holds)
    largest_message: int = 0  # most holds in one message of this run
    sizing_reason: str = ""  # the adaptive sizing's reason for that size ("" in other modes)
    published_ids: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "shards": self.shards,
            "trace_id": self.trace_id,
            "batches": self.batches,
            "claimed": self.claimed,
            "published": self.published,
            "set_aside": self.set_aside,
            "backpressure": self.backpressure,
            "skipped_locked": self.skipped_locked,
            "budget_exhausted": self.budget_exhausted,
            "timed_out": self.timed_out,
            "took_share": self.took_share,
            "gave_way": self.gave_way,
            "messages": self.messages,
            "largest_message": self.largest_message,
            "sizing_reason": self.sizing_reason,
            "duration_s": round(self.duration_s, 4),
        }


def _try_shard_lock(shard: int, shards: int) -> bool:
    return locks.try_lock(locks.sweep_shard(shard, shards))


def _release_shard_lock(shard: int, shards: int) -> None:
    locks.unlock(locks.sweep_shard(shard, shards))


def _drop_leaked_locks() -> None:
    """A sweep starts holding no advisory lock. If an earlier sweep on this (pooled)
    connection was interrupted between taking a lock and its ``finally``, drop what it left."""
    locks.unlock_all()


def _acquire_publish_lock(deadline: float) -> bool:
    """Wait in line for the global publish lock, at most ``CLEANUP_SWEEP_LOCK_WAIT`` and never
    past ``deadline`` (a monotonic time).

    A blocking ``pg_advisory_lock`` under ``lock_timeout``, not a polling loop: PostgreSQL
    grants a lock to its waiters in the order they asked, and a newcomer (even a
    ``pg_try_advisory_lock``) does not jump the line. A sweep that lets go after a batch and asks
    again therefore goes behind the sweeps already waiting, so sweeps take turns batch by batch
    (a polling loop let the sweep that had just let go win again, before the others' next
    poll). The wait is bounded because a waiting sweep occupies a pool process that could be
    releasing holds."""
    wait = min(deadline - time.monotonic(), cleanup_settings().sweep_lock_wait)
    if wait <= 0:
        return locks.try_lock(locks.SWEEP_PUBLISH)
    return locks.wait_for_lock(locks.SWEEP_PUBLISH, wait)


def _release_publish_lock() -> None:
    locks.unlock(locks.SWEEP_PUBLISH)


def _let_go(unlock: Callable[[], None], what: str) -> None:
    """Release a session lock in a ``finally``. When the connection is gone (the error that
    ended the sweep, often), its session's locks went with it, and the unlock's own error
    ("the connection is closed") would replace the one that explains the failure in the dead
    letter and the log. So a connection error here is logged and the connection closed: a
    session that is somehow still alive ends, and its locks with it."""
    try:
        unlock()
    except (OperationalError, InterfaceError) as exc:
        logger.warning(
            "sweep lock not released: its connection failed; closing it ends the session's locks",
            extra={"lock": what, "error": repr(exc)[:300]},
        )
        try:
            locks.close_session()
        except Exception:  # noqa: BLE001 - already closed is what we want
            pass


def sweep_shard(
    shard: int,
    shards: int,
    *,
    trace_id: str | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    max_queue_depth: int | None = None,
) -> SweepResult:
    """Sweep one shard (see the module's docstring), in a ``cleanup.sweep`` span whose
    children are each batch's admission, claim and publish (docs/TRACING.md)."""
    with tracing.span("cleanup.sweep", {"cleanup.shard": shard, "cleanup.shards": shards}) as span:
        result = _sweep_shard(
            shard,
            shards,
            trace_id=trace_id,
            batch_size=batch_size,
            max_batches=max_batches,
            max_queue_depth=max_queue_depth,
        )
        tracing.set_attributes(
            span,
            {
                "cleanup.claimed": result.claimed,
                "cleanup.published": result.published,
                "cleanup.messages": result.messages,
                "cleanup.batches": result.batches,
                "cleanup.backpressure": result.backpressure,
                "cleanup.skipped_locked": result.skipped_locked,
                "cleanup.trace_id": result.trace_id,
            },
        )
        return result


def _sweep_shard(
    shard: int,
    shards: int,
    *,
    trace_id: str | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    max_queue_depth: int | None = None,
) -> SweepResult:
    if shards < 1 or not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards} is not a valid shard")
    conf = cleanup_settings()
    batch_size = batch_size or conf.sweep_batch_size
    max_batches = max_batches or conf.sweep_max_batches
    max_queue_depth = max_queue_depth or conf.max_queue_depth
    result = SweepResult(shard, shards, trace_id or uuid.uuid4().hex)
    started = time.perf_counter()
    deadline = time.monotonic() + conf.sweep_time_budget
    shard_locked = False
    try:
        _drop_leaked_locks()
        # Session-level for the whole run: a second sweep of this shard meanwhile is a no-op.
        # (A transaction-level lock would cover only one claim: a second sweep of the shard
        # could then claim between the first one's batches.) Its key also names this run's
        # room reservation, which counts only while this session holds it.
        shard_locked = _try_shard_lock(shard, shards)
        if shard_locked:
            _sweep_batches(
                shard, shards, result, deadline, batch_size, max_batches, max_queue_depth
            )
        else:
            result.skipped_locked = True
    except SoftTimeLimitExceeded:
        # A sweep is periodic, not poison: stop here. The batch being claimed rolled back, so
        # its holds are due again at once; the next sweep carries on.
        result.timed_out = True
        logger.warning("sweep hit its soft time limit", extra=result.as_dict())
    finally:
        if result.timed_out:
            # The limit can strike between PostgreSQL granting a lock and this code recording
            # it in a flag: drop every session lock, so none stays on this pooled connection.
            _let_go(_drop_leaked_locks, "all")
        elif shard_locked:
            _let_go(lambda: _release_shard_lock(shard, shards), "shard")
    result.duration_s = time.perf_counter() - started
    metrics.record_sweep(
        shard,
        result.claimed,
        result.published,
        result.duration_s,
        result.backpressure,
        messages=result.messages,
    )
    logger.info("sweep done", extra=result.as_dict())
    return result


class _PublishTurn:
    """The global publish lock for one batch, as a context manager: ``taken`` says whether the
    sweep got it within its wait. On leaving (a stop, an error, a soft time limit) the lock
    is let go if still held and the batch's reserved room given back, whatever the admission
    decided in between. ``let_go_early`` reserves the batch's room and lets go of the lock
    before the claim (far from the cap)."""

    def __init__(self, shard_key: tuple[int, int], deadline: float) -> None:
        self._shard_key = shard_key
        self._deadline = deadline
        self._locked = False
        self._reserved = False

    @property
    def taken(self) -> bool:
        return self._locked

    def __enter__(self) -> _PublishTurn:
        self._locked = _acquire_publish_lock(self._deadline)
        return self

    def let_go_early(self, holds: int) -> None:
        locks.reserve_room(self._shard_key, holds)
        self._reserved = True
        _release_publish_lock()
        self._locked = False

    def __exit__(self, *exc: object) -> None:
        if self._locked:
            _let_go(_release_publish_lock, "publish")
        if self._reserved:  # the batch's messages are in the queue (or it failed): room back
            _let_go(lambda: locks.clear_room(self._shard_key), "room")


def _stop(result: SweepResult, stop: Stop) -> None:
    """End the run: the flags on its result and the log line that say why."""
    if stop.reason is Reason.BUDGET_SPENT:
        result.budget_exhausted = True
    elif stop.reason is not Reason.NOTHING_DUE:
        result.backpressure = True  # every stop at or near the cap is a backpressure pause
        if stop.reason is Reason.GAVE_WAY:
            result.gave_way = True
        elif stop.reason is Reason.TOOK_SHARE:
            result.took_share = True
    if stop.message:
        logger.info(
            stop.message,
            extra={
                "shard": result.shard,
                **stop.fields,
                "trace_id": result.trace_id,
                **(stop.turn.as_log() if stop.turn is not None else {}),
            },
        )


def _sweep_batches(
    shard: int,
    shards: int,
    result: SweepResult,
    deadline: float,
    batch_size: int,
    max_batches: int,
    max_queue_depth: int,
) -> None:
    conf = cleanup_settings()
    queue = conf.release_queue
    rate = ServiceRate()
    due_backlog = DueBacklog()
    shard_key = locks.sweep_shard(shard, shards)
    # The adaptive mode sizes messages from the fleet's rate; with it, a queue that already
    # outlasts the shortest budget the sizing gives a batch, half the release target, pauses
    # the sweep (admission.before_the_line).
    fleet_starts = (
        (lambda depth: rate.starts_within(conf.release_target_seconds / 2, depth))
        if conf.release_mode == "adaptive"
        else None
    )

    def one_batch() -> Stop | None:
        """Claim and publish one batch if admission allows; why the run ends, if it does."""
        if time.monotonic() >= deadline:
            return Stop(Reason.BUDGET_SPENT)
        with tracing.span("cleanup.sweep.admission") as span:
            stop = admission.before_the_line(
                queue, shards, batch_size, max_queue_depth, fleet_starts
            )
            if stop is not None:
                tracing.set_attributes(span, {"cleanup.admission": stop.reason.value})
                return stop
        with _PublishTurn(shard_key, deadline) as publish:
            if not publish.taken:
                return Stop(Reason.BUDGET_SPENT)
            with tracing.span("cleanup.sweep.admission") as span:
                took = admission.under_the_lock(queue, shard, shards, batch_size, max_queue_depth)
                tracing.set_attributes(
                    span,
                    {
                        "cleanup.admission": (
                            took.reason.value if isinstance(took, Stop) else "admitted"
                        ),
                        "cleanup.admitted_holds": 0 if isinstance(took, Stop) else took.holds,
                    },
                )
            if isinstance(took, Stop):
                return took
            if not took.holds_the_lock:
                publish.let_go_early(took.holds)
            with transaction.atomic(), tracing.span("cleanup.sweep.claim") as span:
                claimed = claim_expired(
                    shard,
                    shards,
                    batch_size=took.holds,
                    lease_seconds=conf.lease_seconds,
                    max_claims=conf.max_claims,
                    trace_id=result.trace_id,
                )
                to_publish = [c for c in claimed if not c.set_aside]
                tracing.set_attributes(
                    span, {"cleanup.claimed": len(claimed), "cleanup.to_publish": len(to_publish)}
                )
                # A set-aside hold is never claimed again: its dead letter commits with it.
                for hold in claimed:
                    if hold.set_aside:
                        _dead_letter_set_aside(hold, shard, result.trace_id)
                # After a full batch, the run's later (partial) batches are sized from the
                # same count: a partial batch empties its shard, not the others.
                full = len(claimed) >= took.holds or due_backlog.counted
                messages, sizes, sizing = messages_for(
                    to_publish,
                    shard,
                    result.trace_id,
                    depth=took.depth,
                    rate=rate,
                    due_behind=due_backlog if full else None,
                )
                # Published before the claim commits: a sweep that fails or dies before the
                # commit leaves its holds due at once (the claim rolls back) rather than leased
                # for CLEANUP_LEASE_SECONDS with no message. A message whose claim rolled back
                # is harmless: the release decides on the hold itself, and a later copy ends
                # already_handled. (A release that starts first waits on the claim's row lock
                # for the few milliseconds until the commit.)
                with tracing.span("cleanup.sweep.publish", {"cleanup.messages": len(messages)}):
                    publish_release_messages(messages)
        result.batches += 1
        result.claimed += len(claimed)
        result.published += len(to_publish)
        result.messages += len(messages)
        result.set_aside += len(claimed) - len(to_publish)
        result.published_ids.extend(c.reservation_id for c in to_publish)
        metrics.record_message_sizes(sizes)
        result.largest_message = max([result.largest_message, *sizes])
        if sizing is not None:
            if sizing.size >= result.largest_message:
                result.sizing_reason = sizing.reason
            note_sizing(shard, result.trace_id, sizing)
        return admission.after_the_batch(took, len(claimed), len(messages))

    for _ in range(max_batches):
        stop = one_batch()
        if stop is not None:
            _stop(result, stop)
            break


def _dead_letter_set_aside(hold: ClaimedReservation, shard: int, trace_id: str) -> None:
    dead_letters.record(
        DeadLetter.Reason.CLAIMS_EXHAUSTED,
        error=(
            f"hold claimed {hold.claim_count} times (limit {cleanup_settings().max_claims}) "
            f"without being released; set aside until requeued"
        ),
        reservation_id=hold.reservation_id,
        version=hold.version,
        delivery_count=hold.claim_count,
        trace_id=trace_id,
        message=ReleaseMessage.for_hold(
            hold.reservation_id, hold.version, hold.expires_at, shard, trace_id
        ).as_dict(),
    )


def record_last_sweep(result: Any) -> None:
    """Keep the last sweep of the shard for the health page (one upsert per sweep; never fails
    the sweep)."""
    try:
        db.rows(
            sql.RECORD_SWEEP,
            [
                result.shard,
                result.shards,
                result.claimed,
                result.published,
                getattr(result, "messages", result.published),
                getattr(result, "largest_message", 0),
                getattr(result, "sizing_reason", "")[:16],
                result.set_aside,
                result.backpressure,
                result.skipped_locked,
                round(result.duration_s * 1000, 3),
                result.trace_id[:64],
            ],
        )
    except DatabaseError:
        logger.exception("last sweep not recorded", extra={"shard": result.shard})
