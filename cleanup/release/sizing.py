"""How many holds one release message carries (the adaptive release mode), and the counting
arithmetic it shares with the capacity plan and the pool autoscaler (``cleanup.operations.scaling``,
which sits above the pipeline and imports it from here).

The sweep asks, for each batch it has just claimed: if every message carries one hold, can the
fleet start the last of them before the oldest hold of the batch is ``target_s`` old?

    budget    = target_s − age of the oldest hold in the batch, but at least target_s ÷ 2
    servable  = service rate (messages/s) × budget − messages already waiting ahead
    size      = ceil(due ÷ servable), clamped to [1, cap]

``due`` is the batch, or, when the batch was a full one (more holds are due behind it), the
holds due in all shards and not yet in the queue, whichever is larger: those are the holds the
fleet must start within the budget, and the sweeps will claim them within a round or two. Sized
from the batch alone, a burst of 1,500 holds/s claimed 500 at a time looked servable one hold
per message batch after batch while the holds behind the batches piled up in PostgreSQL, and the
oldest eligible hold peaked past the target (docs/PERFORMANCE.md).

At normal load ``servable`` is far above what a sweep claims, so every message carries one hold
(the per-reservation fan-out). When the queue ahead or the batch itself would outlast the
budget, messages carry more holds: fewer messages for the same holds, so the fleet (whose cost
is mostly per message: Celery's fetch, acknowledgment and task trace) gets through them sooner.
When the queue ahead alone outlasts the budget, the size is the cap. A batch whose oldest hold
is already past the target (held up by an outage, or claimed again after a lost message) is
sized to be started within half the target: it is late whatever the size, and a handful of
late holds that the fleet starts at once need no batching.

This is the autoscaler's drain term turned around: it asks how many consumers clear the waiting
work within the budget; here the consumers are given (their measured rate) and the message
count is what can change.

Below the arithmetic, the sweep's side: ``messages_for`` reads the inputs from the fleet and
PostgreSQL (the measured service rate, the holds due in all shards), decides, builds a claimed
batch's release messages and logs the choice. The sweep (``cleanup.release.sweep``) calls it once
per batch with one ``ServiceRate`` and one ``DueBacklog`` per run, so each of them is read at
most once a run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from django.utils import timezone

from cleanup import metrics, sql
from cleanup.conf import ASSUMED_SERVICE_TIME_S, cleanup_settings
from cleanup.release.claim import ClaimedReservation
from cleanup.release.messages import BatchMessage, ReleaseMessage
from reservations.db import scalar
from reservations.models import BUCKETS
from reservations.services import eligible_count

# Floating-point noise (2.0000000001) must not add a whole consumer or a whole hold.
_EPSILON = 1e-9

# Reasons of a sizing decision (the log line's ``reason``, the counter's label).
KEEPS_UP = "keeps_up"  # one hold per message: the fleet starts the batch within the budget
BACKLOG = "backlog"  # more than one hold per message, below the cap
AT_CAP = "at_cap"  # the arithmetic asks for more than the cap
BEHIND = "behind"  # the queue ahead alone outlasts the budget
REASONS = (KEEPS_UP, BACKLOG, AT_CAP, BEHIND)


def ceil_whole(value: float) -> int:
    """The smallest whole count covering ``value`` (never below 0)."""
    return max(0, math.ceil(value - _EPSILON))


def offered_load(arrival_rate_per_s: float, service_time_s: float) -> float:
    """Busy consumers needed on average (Little's law): λ × S, in consumers."""
    if arrival_rate_per_s < 0 or service_time_s < 0:
        raise ValueError("arrival rate and service time must be >= 0")
    return arrival_rate_per_s * service_time_s


def drain_consumers(waiting: int, service_time_s: float, budget_s: float) -> int:
    """Consumers that clear ``waiting`` messages of ``service_time_s`` each within
    ``budget_s`` (> 0): ceil(waiting × S ÷ budget). The autoscaler's drain term."""
    if budget_s <= 0:
        raise ValueError("budget_s must be > 0")
    return ceil_whole(offered_load(waiting / budget_s, service_time_s))


@dataclass(frozen=True)
class ReleaseSize:
    """One sizing decision with everything it was computed from (logged as is)."""

    size: int  # holds per message
    messages: int  # messages the batch becomes
    reason: str
    claimed: int
    due: int  # holds to serve within the budget: the batch, or the due backlog behind it
    queue_depth: int
    oldest_age_s: float
    rate_per_s: float
    rate_source: str  # "measured" (receipts of the fleet) or "floor" (one consumer assumed)
    target_s: float
    cap: int
    budget_s: float
    servable: float  # messages the fleet can still start within the budget

    def as_log(self) -> dict[str, Any]:
        fields = asdict(self)
        for name in ("oldest_age_s", "rate_per_s", "budget_s", "servable"):
            fields[name] = round(fields[name], 3)
        return fields


def choose_release_size(
    *,
    claimed: int,
    queue_depth: int,
    oldest_age_s: float,
    rate_per_s: float,
    target_s: float,
    cap: int,
    rate_source: str = "measured",
    due: int = 0,
) -> ReleaseSize:
    """Holds per message for a batch of ``claimed`` holds, with ``due`` holds (the batch
    included) to serve within the budget (see the module's docstring)."""
    if cap < 1:
        raise ValueError("cap must be >= 1")
    if target_s <= 0:
        raise ValueError("target_s must be > 0")
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be > 0")
    budget = max(target_s - max(0.0, oldest_age_s), target_s / 2)
    servable = rate_per_s * budget - max(0, queue_depth)
    due = max(claimed, due)
    if claimed <= 1:
        size, reason = 1, KEEPS_UP
    elif servable < 1:
        size, reason = cap, BEHIND
    else:
        wanted = ceil_whole(due / servable)
        if wanted <= 1:
            size, reason = 1, KEEPS_UP
        elif wanted >= cap:
            size, reason = cap, AT_CAP if wanted > cap else BACKLOG
        else:
            size, reason = wanted, BACKLOG
    return ReleaseSize(
        size=size,
        messages=ceil_whole(claimed / size) if claimed > 0 else 0,
        reason=reason,
        claimed=claimed,
        due=due,
        queue_depth=queue_depth,
        oldest_age_s=oldest_age_s,
        rate_per_s=rate_per_s,
        rate_source=rate_source,
        target_s=target_s,
        cap=cap,
        budget_s=budget,
        servable=servable,
    )


def by_offering(holds: list[ClaimedReservation]) -> list[ClaimedReservation]:
    """A claimed batch in offering order, so that each message of several holds names few
    offerings. A release locks every offering its message names (seats are given back under
    that lock): messages of holds spread over all offerings lock all of them, and the fleet's
    releases then wait on one another whatever the workers; grouped, the messages of one batch
    lock disjoint offerings and run side by side. The claim already took the batch oldest
    first, and the whole batch is published at once."""
    return sorted(holds, key=lambda c: (c.offering_id, c.expires_at, c.reservation_id))


def split_evenly(items: list[Any], size: int) -> list[list[Any]]:
    """``items`` in ceil(len ÷ size) consecutive chunks of at most ``size``, as even as
    possible (101 holds at size 50 are 34 + 34 + 33, not 50 + 50 + 1)."""
    if not items:
        return []
    count = ceil_whole(len(items) / max(1, size))
    base, extra = divmod(len(items), count)
    chunks, at = [], 0
    for i in range(count):
        step = base + (1 if i < extra else 0)
        chunks.append(items[at : at + step])
        at += step
    return chunks


# The sweep's logger: operators (and the tests) read "release size chosen" beside "sweep done".
logger = logging.getLogger("cleanup.sweep")

# Messages the fleet handled over this many seconds (receipts; served by
# cleanup_receipt_created_idx) are its measured service rate.
RATE_WINDOW_S = 10.0


class ServiceRate:
    """Messages per second the fleet handles, read at most once per sweep run and only when
    the floor would not already give one hold per message.

    The floor is one consumer at the capacity plan's service time
    (``CLEANUP_CAPACITY_PER_CONSUMER_PER_S``, else 1 ÷ ``ASSUMED_SERVICE_TIME_S``): a
    running fleet has at least that. The measurement counts the messages that wrote receipts
    in the last ``RATE_WINDOW_S`` seconds; while the fleet was idle for part of that window it
    reads low, which errs towards more holds per message, never fewer."""

    def __init__(self, read: Callable[[], float] | None = None) -> None:
        self._read = read or _messages_per_second
        self._measured: float | None = None

    @staticmethod
    def floor() -> float:
        per_consumer = cleanup_settings().capacity_per_consumer_per_s
        if per_consumer > 0:
            return per_consumer
        return 1.0 / ASSUMED_SERVICE_TIME_S

    def measured(self) -> float:
        if self._measured is None:
            self._measured = self._read()
        return self._measured

    def starts_within(self, seconds: float, depth: int) -> float:
        """Messages the fleet starts within ``seconds``: at the floor while that is more than
        ``depth`` (no reading needed), else at the measured rate if it is higher."""
        floor = self.floor()
        if depth < floor * seconds:
            return floor * seconds
        return max(floor, self.measured()) * seconds


def _messages_per_second() -> float:
    return int(scalar(sql.MESSAGES_HANDLED_IN_LAST, [RATE_WINDOW_S])) / RATE_WINDOW_S


def size_batch(
    holds: list[ClaimedReservation],
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
        alone = at(max(rate.floor(), rate.measured()), "measured")
        if alone.size < alone.cap:
            # Due in PostgreSQL and not yet in the queue: the eligible holds (the batch's
            # included: claimed, not yet published) less the queue's messages (each carries at
            # least one eligible hold; counting each as one errs towards larger messages).
            # Counted only up to where the size would be the cap anyway (due ≥ cap × servable
            # at the fleet's rate, which is at least the floor's), and not at all when the
            # batch alone already takes the cap: at a million due, a bound of cap × the
            # messages started within the target read 100,000 rows per sweep run.
            bound = depth + ceil_whole(alone.cap * alone.servable) + 1
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
    holds: list[ClaimedReservation],
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
        grouped = by_offering(holds)
        chunks = [grouped[i : i + size] for i in range(0, len(grouped), size)]
    elif mode == "single" or not holds:
        chunks = [[c] for c in holds]
    else:
        # A full batch has more due behind it: size for those too (cleanup.release.sizing).
        sizing = size_batch(holds, depth, rate, due_behind=due_behind)
        chunks = split_evenly(by_offering(holds) if sizing.size > 1 else holds, sizing.size)
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
