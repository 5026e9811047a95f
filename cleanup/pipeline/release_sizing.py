"""A claimed batch's release messages, sized: the adaptive mode's inputs read from the fleet and
PostgreSQL (the measured service rate, the holds due in all shards), the decision
(``cleanup.pipeline.sizing``, pure arithmetic), the messages built from it, and its log line.

The sweep (``cleanup.pipeline.sweep``) calls ``messages_for`` once per batch with one
``ServiceRate`` and one ``DueBacklog`` per run, so each of them is read at most once a run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.utils import timezone

from cleanup import sql
from cleanup.conf import cleanup_settings
from cleanup.pipeline.messages import BatchMessage, ReleaseMessage
from cleanup.pipeline.sizing import ReleaseSize, ceil_whole, choose_release_size, split_evenly
from cleanup.telemetry import metrics
from common.db import scalar
from reservations.models import BUCKETS
from reservations.services import ClaimedHold, eligible_count

# The sweep's logger: operators (and the tests) read "release size chosen" beside "sweep done".
logger = logging.getLogger("cleanup.sweep")

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


def messages_for(
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


def note_sizing(shard: int, trace_id: str, sizing: ReleaseSize) -> None:
    """Count the decision and log it with its inputs."""
    metrics.record_sizing(sizing.reason, sizing.size)
    key = (sizing.size, sizing.reason)
    repeat = _last_sizing.get(shard) == key and sizing.size == 1
    _last_sizing[shard] = key
    logger.log(
        logging.DEBUG if repeat else logging.INFO,
        "release size chosen",
        extra={"shard": shard, "trace_id": trace_id, **sizing.as_log()},
    )
