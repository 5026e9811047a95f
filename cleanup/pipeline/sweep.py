"""Sweep one shard: claim bounded batches of its eligible holds and publish one release
message per hold, each batch's messages before its claim commits.

- Claims go through ``reservations.services.claim_expired`` (FOR UPDATE SKIP LOCKED, a lease).
- A per-shard advisory lock, held for the whole run, makes a second sweep of the shard a no-op.
- Backpressure: before each batch the release queue's depth is read; at or above
  ``CLEANUP_MAX_QUEUE_DEPTH`` the sweep stops, so a backlog never becomes repeated copies of
  still-queued holds. A global session advisory lock serializes "check depth → take room"
  across sweeps, so concurrent sweeps of different shards cannot each add a batch on top of the
  same reading; a batch is never larger than the room left, so the queue stays within the cap.
  Far from the cap a sweep reserves its batch's room (``cleanup_publishreservation``, counted
  by every later reading until its messages are in the queue) and lets go of the lock before
  it claims and publishes; near the cap it holds the lock through the publish.
- Before waiting in line a sweep reads the depth: at the cap, or near it with the room already
  spoken for by the sweeps ahead in line, it leaves at once (a waiting sweep holds a pool
  process that could be releasing).
- Turns: sweeps wait for the publish lock in line (PostgreSQL grants a lock to its waiters in
  the order they asked), for at most ``CLEANUP_SWEEP_LOCK_WAIT``. Near the cap, with
  ``CLEANUP_SWEEP_TURNS=lateness`` (the default) the room goes to the shards furthest behind: a
  sweep whose shard's oldest due hold is younger than the oldest due hold of all shards by more
  than ``TURN_SLACK_S`` leaves; the others take at most an equal share of the cap among the
  shards that are behind, and end their run after it unless theirs is the only shard behind.
  With ``arrival`` each batch takes at most an equal share of the cap (cap ÷ shards) and the
  sweep then ends its run (docs/PIPELINE.md "Turns").
- Sizing (``CLEANUP_RELEASE_MODE=adaptive``, the default): each batch's messages carry one hold
  each unless the queue ahead and the batch would push its oldest hold past
  ``CLEANUP_RELEASE_TARGET_SECONDS`` (``cleanup.pipeline.sizing``).
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
from django.utils import timezone

from cleanup import sql
from cleanup.broker import readers as broker
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.pipeline import deadletters, locks
from cleanup.pipeline.messages import BatchMessage, ReleaseMessage
from cleanup.pipeline.publish import publish_release_messages
from cleanup.pipeline.sizing import ReleaseSize, ceil_whole, choose_release_size, split_evenly
from cleanup.telemetry import metrics
from common.db import scalar
from reservations.models import BUCKETS
from reservations.services import (
    ClaimedHold,
    claim_expired,
    eligible_count,
    oldest_due_by_shard,
)

logger = logging.getLogger("cleanup.sweep")

# Near the cap a sweep gives way when its shard's oldest due hold is younger than the oldest due
# hold of all shards by more than this: one sweep interval of the schedule's default (2 s), so a
# shard gives way only once it is a whole round ahead, and readings a few milliseconds apart (or
# holds expiring together) never make every shard leave.
TURN_SLACK_S = 2.0


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
    rate = ServiceRate()
    due_backlog = DueBacklog()
    shard_key = locks.sweep_shard(shard, shards)
    for _ in range(max_batches):
        if time.monotonic() >= deadline:
            result.budget_exhausted = True
            break
        # Before waiting in line: a sweep in line holds a pool process that could be releasing
        # holds, so one that would find no room when its turn came leaves now (its shard's next
        # sweep comes anyway). The depth is read again under the lock below: that reading, not
        # this one, guards the cap.
        full_at = _no_room_ahead(conf.release_queue, shards, batch_size, max_queue_depth)
        if full_at is not None:
            result.backpressure = True
            logger.info(
                "sweep paused by backpressure",
                extra={"shard": shard, "queue_depth": full_at, "trace_id": result.trace_id},
            )
            break
        publish_locked = False
        reserved = False
        try:
            publish_locked = _acquire_publish_lock(deadline)
            if not publish_locked:
                result.budget_exhausted = True
                break
            depth = broker.queue_depth(conf.release_queue)
            # what the sweeps that let go of the lock before claiming will still publish
            in_flight = locks.room_reserved_by_others()
            if depth + in_flight >= max_queue_depth:
                result.backpressure = True
                logger.info(
                    "sweep paused by backpressure",
                    extra={
                        "shard": shard,
                        "queue_depth": depth,
                        "reserved_elsewhere": in_flight,
                        "trace_id": result.trace_id,
                    },
                )
                break
            # Never past the cap: a batch is at most the room left under it (in holds, so also
            # in messages whatever their size), net of the room other sweeps are publishing into.
            room = max_queue_depth - depth - in_flight
            take = min(batch_size, room)
            # Near the cap every shard's sweep competes for the same room: each takes at most
            # its share and then ends its run, so the shards publish in turns.
            crowded = near_the_cap(room, shards, batch_size)
            turn: Turn | None = None
            if not crowded:
                # Far from the cap: the room this batch takes stays reserved (keyed by the shard
                # lock, so it lapses with this session) and the lock goes to the next sweep in
                # line now, not after this claim and publish. The sweeps then claim and publish
                # side by side instead of waiting in line for each other with pool processes
                # that could be releasing; every reading under the lock still counts all
                # batches not yet in the queue, so the cap stays exact. Near the cap the lock is
                # held through the publish, where the turns below decide who goes next.
                locks.reserve_room(shard_key, take)
                reserved = True
                _release_publish_lock()
                publish_locked = False
            elif conf.sweep_turns == "arrival":
                take = min(take, fair_share(shards, batch_size, max_queue_depth))
            else:
                asked = time.perf_counter()
                ages = oldest_due_by_shard(shards)
                turn = whose_turn(shard, ages, query_ms=(time.perf_counter() - asked) * 1000)
                if turn.own_age is None:
                    break  # nothing of this shard is due
                if turn.gives_way:
                    # The room goes to the shards further behind: the SLO is the oldest
                    # eligible hold of all shards, and this shard's next sweep comes anyway.
                    result.gave_way = True
                    result.backpressure = True
                    logger.info(
                        "sweep gave way near the cap: another shard's oldest due hold is older",
                        extra={
                            "shard": shard,
                            "queue_depth": depth,
                            "room": room,
                            "trace_id": result.trace_id,
                            **turn.as_log(),
                        },
                    )
                    break
                take = min(take, fair_share(turn.behind, batch_size, max_queue_depth))
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
                messages, sizes, sizing = _messages_for(
                    to_publish,
                    shard,
                    result.trace_id,
                    depth=depth,
                    rate=rate,
                    # after a full batch, the run's later (partial) batches are sized from
                    # the same count: a partial batch empties its shard, not the others
                    due_behind=due_backlog if len(claimed) >= take or due_backlog.counted else None,
                )
                # Published before the claim commits: a sweep that fails or dies before the
                # commit leaves its holds due at once (the claim rolls back) rather than leased
                # for CLEANUP_LEASE_SECONDS with no message. A message whose claim rolled back
                # is harmless: the release decides on the hold itself, and a later copy ends
                # already_handled. (A release that starts first waits on the claim's row lock
                # for the few milliseconds until the commit.)
                publish_release_messages(messages)
        finally:
            if publish_locked:
                _let_go(_release_publish_lock, "publish")
            if reserved:  # the batch's messages are in the queue (or it failed): room back
                _let_go(lambda: locks.clear_room(shard_key), "room")
        result.batches += 1
        result.claimed += len(claimed)
        result.published += len(to_publish)
        result.messages += len(messages)
        result.set_aside += len(claimed) - len(to_publish)
        result.published_ids.extend(c.reservation_id for c in to_publish)
        metrics.record_message_sizes(sizes)
        result.largest_message = max([result.largest_message, *sizes])
        if sizing is not None:
            _note_sizing(shard, result, sizing)
        if len(claimed) < take:
            break  # nothing more is due
        if len(messages) >= room:
            # This batch filled the queue to the cap: the same pause as finding it full.
            result.backpressure = True
            logger.info(
                "sweep paused by backpressure",
                extra={
                    "shard": shard,
                    "queue_depth": depth + len(messages),
                    "trace_id": result.trace_id,
                },
            )
            break
        if (crowded and turn is None) or (turn is not None and turn.behind > 1):
            # Its turn near the cap is over: the other shards (behind) take theirs next. (By
            # lateness, the only shard behind carries on: nobody else is owed the room, and
            # leaving it unused for a round would lower the drain.)
            result.took_share = True
            result.backpressure = True
            logger.info(
                "sweep took its share of the room near the cap",
                extra={
                    "shard": shard,
                    "queue_depth": depth,
                    "room": room,
                    "share": take,
                    "trace_id": result.trace_id,
                    **(turn.as_log() if turn is not None else {}),
                },
            )
            break


def _no_room_ahead(queue: str, shards: int, batch_size: int, max_queue_depth: int) -> int | None:
    """The queue depth, when a sweep should leave instead of waiting in line for the publish
    lock; None when it should wait.

    It leaves when the queue is at its cap, and also near the cap when the room left is
    already spoken for: the sweeps holding or waiting for the publish lock ahead of it take up
    to a fair share each before its turn comes, so ``room <= sweeps ahead × fair share`` means
    it would find the queue full, or claim only what drained during its wait. Not "room
    smaller than one fair share" alone: with nobody ahead a sweep that finds a small room still
    takes it (it is the one whose turn it is, and refilling the queue to its cap is what keeps
    the drain at the rate the cap allows, see ``fair_share``); and when the workers drain less
    than a share between two sweeps (a share is 500 holds at the defaults), that rule would let
    the room build up for rounds and then hand all of it to whichever sweep came first.
    Counting the line keeps today's order of turns: the sweeps already in line take theirs as
    before, and only a sweep that would get nothing (or the crumbs that drained while it
    waited) stops occupying a pool process for its wait.

    The readings are not under the lock, so they can be stale either way: a sweep may leave
    while a sweep ahead was about to let go with room unused (the room waits for the next
    sweep, one sweep interval later at most, with the queue near its cap meanwhile), or join
    the line and find the queue full under the lock as before. Neither affects the cap."""
    depth = broker.queue_depth(queue)
    if depth >= max_queue_depth:
        return depth
    room = max_queue_depth - depth
    if not near_the_cap(room, shards, batch_size):
        return None
    ahead = locks.sessions_in_line(locks.SWEEP_PUBLISH)
    if room <= ahead * fair_share(shards, batch_size, max_queue_depth):
        return depth
    return None


@dataclass(frozen=True)
class Turn:
    """Whose turn it is near the cap, from the age of each shard's oldest due hold."""

    shard: int
    own_age: float | None  # None: the shard has no due hold
    furthest: int  # the shard furthest behind (its oldest due hold the oldest)
    furthest_age: float
    behind: int  # shards within TURN_SLACK_S of the furthest behind: they share the room
    query_ms: float = 0.0  # what reading the shards' oldest due holds took

    @property
    def gives_way(self) -> bool:
        return self.own_age is None or self.furthest_age - self.own_age > TURN_SLACK_S

    def as_log(self) -> dict[str, Any]:
        return {
            "oldest_due_s": None if self.own_age is None else round(self.own_age, 2),
            "furthest_behind": self.furthest,
            "furthest_behind_s": round(self.furthest_age, 2),
            "shards_behind": self.behind,
            "turn_query_ms": round(self.query_ms, 2),
        }


def whose_turn(shard: int, ages: dict[int, float], query_ms: float = 0.0) -> Turn:
    """Near the cap the room goes to the shards furthest behind. Each shard's claim already
    takes its oldest due holds first, but the sweeps reach the publish lock in the order they
    are sent, so with shares of the cap the first shards in that order took the room round
    after round and the last one's backlog grew older (docs/PERFORMANCE.md). The SLO is the
    oldest eligible hold of all shards: so a shard whose oldest due hold is younger than the
    oldest of all by more than ``TURN_SLACK_S`` gives way, and the shards within the slack of
    the oldest split the cap between them (``fair_share`` of their number). A shard that got
    ahead falls back within the slack as the others catch up, so the shards' oldest holds stay
    within about the slack and a share of each other, whatever order the sweeps come in."""
    if not ages:
        return Turn(shard, None, shard, 0.0, 0, query_ms)
    furthest = max(ages, key=lambda s: (ages[s], -s))
    oldest = ages[furthest]
    behind = sum(1 for age in ages.values() if oldest - age <= TURN_SLACK_S)
    return Turn(shard, ages.get(shard), furthest, oldest, behind, query_ms)


def near_the_cap(room: int, shards: int, batch_size: int) -> bool:
    """True when ``room`` (messages left under the cap) is narrower than every shard's full
    batch together: one sweep's batches could then take the room the other shards need."""
    return shards > 1 and room < shards * batch_size


def fair_share(shards: int, batch_size: int, cap: int) -> int:
    """The most one shard's sweep takes in its turn near the cap: an equal share of the whole
    cap, ceil(cap ÷ shards), never more than a batch. A share of the cap, not of the room left:
    the sweeps take their turns one after another, and shares of a shrinking room add up to
    only 1 - (1 - 1/shards)^shards of it (about two thirds with 4 shards), so the queue would
    never reach its cap and the drain would run below the rate the cap allows."""
    return max(1, min(batch_size, ceil_whole(cap / shards)))


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
        message=ReleaseMessage.for_hold(
            hold.reservation_id, hold.version, hold.expires_at, shard, trace_id
        ).as_dict(),
    )


# --- Release message sizing ------------------------------------------------------------------

# Messages the fleet handled over this many seconds (receipts; served by
# cleanup_receipt_created_idx) are its measured service rate.
RATE_WINDOW_S = 10.0


class ServiceRate:
    """Messages per second the fleet handles, read at most once per sweep run and only when
    the floor would not already give one hold per message.

    The floor is one consumer at the capacity plan's service time
    (``CLEANUP_CAPACITY_PER_CONSUMER_PER_S``, else 1 ÷ ``CLEANUP_AUTOSCALE_SERVICE_TIME``): a
    running fleet has at least that. The measurement counts the messages that wrote receipts
    in the last ``RATE_WINDOW_S`` seconds; while the fleet was idle for part of that window it
    reads low, which errs towards more holds per message, never fewer."""

    def __init__(self, read: Callable[[], float] | None = None) -> None:
        self._read = read or _messages_per_second
        self._measured: float | None = None

    @staticmethod
    def floor() -> float:
        conf = cleanup_settings()
        per_consumer = conf.capacity_per_consumer_per_s
        if per_consumer > 0:
            return per_consumer
        return 1.0 / conf.autoscale_service_time

    def measured(self) -> float:
        if self._measured is None:
            self._measured = self._read()
        return self._measured


def _messages_per_second() -> float:
    return int(scalar(sql.MESSAGES_HANDLED_IN_LAST, [RATE_WINDOW_S])) / RATE_WINDOW_S


def size_batch(
    holds: list[ClaimedHold],
    depth: int,
    rate: ServiceRate,
    now: Any = None,
    *,
    due_behind: Callable[[int], int] | None = None,
) -> ReleaseSize:
    """The adaptive mode's decision for one claimed batch (``holds`` in due order).
    ``due_behind(bound)``, given when the batch was a full one, counts the holds due in all
    shards (at most ``bound``); it is read only when the batch alone would not already give the
    largest messages."""
    now = now or timezone.now()
    oldest_age = max(0.0, (now - holds[0].expires_at).total_seconds()) if holds else 0.0
    due = len(holds)

    def at(rate_per_s: float, source: str) -> ReleaseSize:
        return choose_release_size(
            claimed=len(holds),
            queue_depth=depth,
            oldest_age_s=oldest_age,
            target_s=cleanup_settings().release_target_seconds,
            cap=cleanup_settings().release_batch_size,
            rate_per_s=rate_per_s,
            rate_source=source,
            due=due,
        )

    if due_behind is not None and len(holds) > 1:
        # Due in PostgreSQL and not yet in the queue: the eligible holds (the batch's included:
        # claimed, not yet published) less the queue's messages (each carries at least one
        # eligible hold; counting each as one errs towards larger messages). Counted only up
        # to where the size would be the cap anyway: cap × the messages the fleet starts
        # within the target, plus the queue.
        conf = cleanup_settings()
        fleet_rate = max(rate.floor(), rate.measured())
        bound = depth + conf.release_batch_size * max(
            1, ceil_whole(fleet_rate * conf.release_target_seconds)
        )
        due = max(due, due_behind(bound) - depth)
    floor = rate.floor()
    at_floor = at(floor, "floor")
    if at_floor.size == 1:
        return at_floor  # the fleet keeps up even at its floor: no need to measure it
    measured = rate.measured()
    if measured <= floor:
        return at_floor
    return at(measured, "measured")


class DueBacklog:
    """The holds eligible in all shards (up to a bound), counted at most once per sweep run: at
    its first full batch. The count costs about 1 ms per 1,000 eligible holds (a bitmap scan
    of the SLO's index); the run's later batches take seconds at most, and what changes
    meanwhile that matters for the sizing, the queue ahead, is read again for each batch."""

    def __init__(self, read: Callable[[int], int] | None = None) -> None:
        self._read = read or _eligible_in_all_shards
        self._counted: int | None = None

    @property
    def counted(self) -> bool:
        return self._counted is not None

    def __call__(self, bound: int) -> int:
        if self._counted is None:
            self._counted = self._read(bound)
        return self._counted


def _eligible_in_all_shards(bound: int) -> int:
    """Eligible holds in every bucket, counted up to ``bound``."""
    return eligible_count(range(BUCKETS), bound)


def _messages_for(
    holds: list[ClaimedHold],
    shard: int,
    trace_id: str,
    *,
    depth: int,
    rate: ServiceRate,
    due_behind: Callable[[int], int] | None = None,
) -> tuple[list[ReleaseMessage | BatchMessage], list[int], ReleaseSize | None]:
    """The batch's release messages and the holds each carries: one per hold ("single"),
    CLEANUP_RELEASE_BATCH_SIZE each ("batch"), or the size the adaptive sizing chose, in even
    chunks. In the adaptive mode a message of one hold is the per-reservation message."""
    conf = cleanup_settings()
    mode = conf.release_mode
    sizing: ReleaseSize | None = None
    if mode == "batch":
        size = conf.release_batch_size
        chunks = [holds[i : i + size] for i in range(0, len(holds), size)]
    elif mode == "single" or not holds:
        chunks = [[c] for c in holds]
    else:
        # A full batch has more due behind it: size for those too (cleanup.pipeline.sizing).
        sizing = size_batch(holds, depth, rate, due_behind=due_behind)
        chunks = split_evenly(holds, sizing.size)
    messages: list[ReleaseMessage | BatchMessage] = [
        ReleaseMessage.for_hold(
            chunk[0].reservation_id, chunk[0].version, chunk[0].expires_at, shard, trace_id
        )
        if len(chunk) == 1 and mode != "batch"
        else BatchMessage.for_holds(
            [(c.reservation_id, c.version, c.expires_at) for c in chunk], shard, trace_id
        )
        for chunk in chunks
    ]
    return messages, [len(chunk) for chunk in chunks], sizing


# The last decision logged per shard in this process: a repeat of "one hold per message" is
# logged at DEBUG, anything else at INFO (as the autoscaler logs its decisions).
_last_sizing: dict[int, tuple[int, str]] = {}


def _note_sizing(shard: int, result: SweepResult, sizing: ReleaseSize) -> None:
    metrics.record_sizing(sizing.reason, sizing.size)
    if sizing.size >= result.largest_message:
        result.sizing_reason = sizing.reason
    key = (sizing.size, sizing.reason)
    repeat = _last_sizing.get(shard) == key and sizing.size == 1
    _last_sizing[shard] = key
    logger.log(
        logging.DEBUG if repeat else logging.INFO,
        "release size chosen",
        extra={"shard": shard, "trace_id": result.trace_id, **sizing.as_log()},
    )
