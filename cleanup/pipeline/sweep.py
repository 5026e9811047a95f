"""Sweep one shard: claim bounded batches of its eligible holds and publish one release
message per hold, each batch's messages before its claim commits.

- Claims go through ``reservations.services.claim_expired`` (FOR UPDATE SKIP LOCKED, a lease).
- A per-shard advisory lock, held for the whole run, makes a second sweep of the shard a no-op.
- Backpressure: before each batch the release queue's depth is read; at or above
  ``CLEANUP_MAX_QUEUE_DEPTH`` the sweep stops, so a backlog never becomes repeated copies of
  still-queued holds. A global session advisory lock serializes "check depth → claim →
  publish" across sweeps, so concurrent sweeps of different shards cannot each add a batch on
  top of the same reading; a batch is never larger than the room left, so the queue stays
  within the cap.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from django.db import InterfaceError, OperationalError, connection, transaction

from cleanup.broker import readers as broker
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.pipeline import deadletters, locks
from cleanup.pipeline.messages import build, build_batch
from cleanup.pipeline.publish import publish_release_messages
from cleanup.telemetry import metrics
from reservations.services import ClaimedHold, claim_expired

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
    duration_s: float = 0.0
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
    """Wait for the global publish lock until ``deadline`` (a monotonic time)."""
    while True:
        if locks.try_lock(locks.SWEEP_PUBLISH):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


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
            connection.close()
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
        # (A transaction-level lock would cover only one claim, and claims are already
        # serialized by the publish lock, so it would never make the second sweep skip.)
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
        shard, result.claimed, result.published, result.duration_s, result.backpressure
    )
    logger.info("sweep done", extra=result.as_dict())
    return result


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
    for _ in range(max_batches):
        if time.monotonic() >= deadline:
            result.budget_exhausted = True
            break
        publish_locked = False
        try:
            publish_locked = _acquire_publish_lock(deadline)
            if not publish_locked:
                result.budget_exhausted = True
                break
            depth = broker.queue_depth(conf.release_queue)
            if depth >= max_queue_depth:
                result.backpressure = True
                logger.info(
                    "sweep paused by backpressure",
                    extra={"shard": shard, "queue_depth": depth, "trace_id": result.trace_id},
                )
                break
            # Never past the cap: a batch is at most the room left under it.
            room = max_queue_depth - depth
            take = min(batch_size, room)
            with transaction.atomic():
                claimed = claim_expired(
                    shard,
                    shards,
                    batch_size=take,
                    lease_seconds=conf.lease_seconds,
                    max_claims=conf.max_claims,
                    trace_id=result.trace_id,
                )
                to_publish = [c for c in claimed if not c.set_aside]
                # A set-aside hold is never claimed again: its dead letter commits with it.
                for hold in claimed:
                    if hold.set_aside:
                        _dead_letter_set_aside(hold, shard, result.trace_id)
                # Published before the claim commits: a sweep that fails or dies before the
                # commit leaves its holds due at once (the claim rolls back) rather than leased
                # for CLEANUP_LEASE_SECONDS with no message. A message whose claim rolled back
                # is harmless: the release decides on the hold itself, and a later copy ends
                # already_handled. (A release that starts first waits on the claim's row lock
                # for the few milliseconds until the commit.)
                publish_release_messages(_messages_for(to_publish, shard, result.trace_id))
        finally:
            if publish_locked:
                _let_go(_release_publish_lock, "publish")
        result.batches += 1
        result.claimed += len(claimed)
        result.published += len(to_publish)
        result.set_aside += len(claimed) - len(to_publish)
        result.published_ids.extend(c.reservation_id for c in to_publish)
        if len(claimed) < take:
            break  # nothing more is due
        if take == room:
            # This batch filled the queue to the cap: the same pause as finding it full.
            result.backpressure = True
            logger.info(
                "sweep paused by backpressure",
                extra={"shard": shard, "queue_depth": depth + take, "trace_id": result.trace_id},
            )
            break


def _dead_letter_set_aside(hold: ClaimedHold, shard: int, trace_id: str) -> None:
    deadletters.record(
        DeadLetter.Reason.CLAIMS_EXHAUSTED,
        error=(
            f"hold claimed {hold.claim_count} times (limit {cleanup_settings().max_claims}) "
            f"without being released; set aside until requeued"
        ),
        reservation_id=hold.reservation_id,
        version=hold.version,
        delivery_count=hold.claim_count,
        trace_id=trace_id,
        message=build(hold.reservation_id, hold.version, hold.expires_at, shard, trace_id),
    )


def _messages_for(holds: list[ClaimedHold], shard: int, trace_id: str) -> list[dict[str, Any]]:
    """One message per hold (default), or one per batch of holds in the batched mode."""
    conf = cleanup_settings()
    if conf.release_mode != "batch":
        return [build(c.reservation_id, c.version, c.expires_at, shard, trace_id) for c in holds]
    size = conf.release_batch_size
    return [
        build_batch(
            [(c.reservation_id, c.version, c.expires_at) for c in holds[i : i + size]],
            shard,
            trace_id,
        )
        for i in range(0, len(holds), size)
    ]
