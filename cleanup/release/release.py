"""Handle release messages: the hold's conditional transition and the message's receipt in one
statement; acknowledgment (acks_late) follows the commit.

Order of decisions (docs/PIPELINE.md, "Outcome order"): malformed → receipt exists → the
domain's answer (not_found, already_handled, renewed, no_longer_held, not_expired, released).

The release and its receipt are one statement (autocommit: one round trip, no BEGIN/COMMIT).
That keeps the order above: duplicates of one key serialize on the hold's row lock, the later
one finds the hold released at this version, and for any outcome other than ``released`` a
receipt conflict overrides what the domain said (it changed nothing). The per-reservation and
the batched modes run the same code: a message is a batch of one, and a batch is released
``STATEMENT_HOLDS`` holds per statement. ``run_attempt`` is both
release tasks' body around it (tally, metrics, the attempt's log line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connection

from cleanup import metrics, sql, tracing
from cleanup.release import delivery_cap
from cleanup.release.messages import BatchMessage, ReleaseMessage
from reservations.services import AttachedWrite, ReleaseOutcome, release_holds

logger = logging.getLogger("cleanup.release")
# The one line per attempt keeps the tasks' logger: operators' filters and alerts name it.
attempt_logger = logging.getLogger("cleanup.tasks")

ALREADY_HANDLED = ReleaseOutcome.ALREADY_HANDLED.value
# Holds per release statement (``release_batch``): each statement locks its holds' offerings
# until it commits.
STATEMENT_HOLDS = 100
RELEASED = ReleaseOutcome.RELEASED.value
# Outcomes that record no receipt, because the same key may legitimately be released later:
# not_expired (the hold expires later at the same version) and not_found (a message may name
# an id before its hold exists; a receipt would then block that hold's release for good).
# unknown_version records none either: the hold never had that version, so no sweep sent it,
# and a receipt per forged version would let anyone write rows without bound (and count them
# in the service rate the sizing and the autoscaler read).
NO_RECEIPT = {
    ReleaseOutcome.NOT_EXPIRED.value,
    ReleaseOutcome.NOT_FOUND.value,
    ReleaseOutcome.UNKNOWN_VERSION.value,
}


@dataclass(frozen=True)
class Attempt:
    attempt: int
    worker: str
    task_id: str
    queue_age_seconds: float | None


def release_batch(
    messages: Sequence[ReleaseMessage],
    attempt: Attempt,
    request_spans: dict[int, str] | None = None,
) -> dict[int, str]:
    """Apply the release for each message; return each hold's outcome by id. Transient
    database errors propagate to the task (which retries); each hold's release is whole or
    not done. ``request_spans`` receives the released holds' request traceparents
    (``release_holds``).

    The holds go ``STATEMENT_HOLDS`` at a time, in the message's order, each group in
    ``_release_group``'s statements. A release statement locks the offering of every hold it
    releases until it commits (the seats go back under that lock, offerings first), so a
    statement over a whole message of 500 holds, spread over every offering of a sale, held
    them all for its whole run and the fleet's releases took turns (two fifths of their time
    on the processor, the rest waiting for each other's locks). The sweep orders a message's
    holds by offering (``cleanup.release.sizing.by_offering``), so each group names a few
    offerings and the groups of concurrent messages mostly miss each other. Each hold's
    release, seats, event and receipt still commit together: a delivery that dies between
    groups leaves the first groups released, and its redelivery finds them handled.
    """
    started = time.perf_counter()
    by_id: dict[int, ReleaseMessage] = {}
    for message in messages:
        by_id.setdefault(message.reservation_id, message)
    unique = list(by_id.values())
    outcomes: dict[int, str] = {}
    for at in range(0, len(unique), STATEMENT_HOLDS):
        group = unique[at : at + STATEMENT_HOLDS]
        outcomes.update(_release_group(group, attempt, request_spans, started))
    return outcomes


def _release_group(
    group: list[ReleaseMessage],
    attempt: Attempt,
    request_spans: dict[int, str] | None,
    started: float,
) -> dict[int, str]:
    """1. One statement (autocommit, one round trip): release every hold of ``group`` that is
       still held at its message's version and has expired, give the seats back, write the
       outbox events and the released holds' receipts.
    2. Only when some hold was not released: a receipt per other outcome says why (unless one
       exists already → ``already_handled``); not_expired and not_found record none.
    """
    by_id = {message.reservation_id: message for message in group}
    common: dict[str, Any] = {
        "attempt": attempt.attempt,
        "worker": attempt.worker[:200],
        "task": attempt.task_id[:64],
        "age": attempt.queue_age_seconds,
    }
    receipts = AttachedWrite(
        sql.RELEASED_RECEIPTS,
        {
            **common,
            "r_ids": list(by_id),
            "r_keys": [m.idempotency_key for m in by_id.values()],
            "r_traces": [m.trace_id for m in by_id.values()],
            # The receipt records the version its message carried (as every other outcome's
            # receipt does), not the row's: the invariant check compares the two.
            "r_versions": [m.version for m in by_id.values()],
            "pre_ms": (time.perf_counter() - started) * 1000,
        },
    )
    decided = release_holds(
        [(m.reservation_id, m.version) for m in by_id.values()],
        attach=receipts,
        request_spans=request_spans,
    )
    outcomes = {rid: outcome.value for rid, outcome in decided.items()}
    recorded = [
        m for m in by_id.values() if outcomes[m.reservation_id] not in NO_RECEIPT | {RELEASED}
    ]
    if recorded:
        with connection.cursor() as cur:
            cur.execute(
                sql.OTHER_RECEIPTS,
                {
                    **common,
                    "ms": (time.perf_counter() - started) * 1000,
                    "keys": [m.idempotency_key for m in recorded],
                    "ids": [m.reservation_id for m in recorded],
                    "versions": [m.version for m in recorded],
                    "outcomes": [outcomes[m.reservation_id] for m in recorded],
                    "traces": [m.trace_id for m in recorded],
                },
            )
            inserted = {row[0] for row in cur.fetchall()}
        for m in recorded:
            if m.reservation_id not in inserted:
                outcomes[m.reservation_id] = ALREADY_HANDLED
    return outcomes


def release(message: ReleaseMessage, attempt: Attempt) -> str:
    """The per-reservation path: ``release_batch`` of one message."""
    return release_batch([message], attempt)[message.reservation_id]


def run_attempt(
    message: ReleaseMessage | BatchMessage, attempt: Attempt, started: float
) -> dict[str, Any]:
    """One delivery of a validated message, one hold or a batch's valid holds alike: tally an
    attempt per hold, release them (``release_batch``), record each outcome's holds in the
    metrics and log one line; return the task's result. ``started`` is the
    ``time.perf_counter()`` at which the task began (the duration includes validation).

    Transient errors propagate to Celery's autoretry (backoff with full jitter); the tally
    counts the attempt whatever comes of it.
    """
    holds = (message,) if isinstance(message, ReleaseMessage) else message.items
    delivery_cap.tally(len(holds))
    with tracing.span("cleanup.release", _span_attributes(holds, attempt)) as span:
        request_spans: dict[int, str] | None = {} if span is not None else None
        outcomes = release_batch(holds, attempt, request_spans)
        tracing.set_attributes(span, _outcome_attributes(holds, outcomes))
        tracing.link_requests(span, request_spans or {})
    duration = time.perf_counter() - started
    age = attempt.queue_age_seconds
    # Which hold ended how, by id (a batch is at most MAX_BATCH_ITEMS holds): "what happened
    # to hold N" is then one grep of the logs, for a batch as for a one-hold message.
    holds_by_outcome: dict[str, list[int]] = {}
    for hold in holds:
        holds_by_outcome.setdefault(outcomes[hold.reservation_id], []).append(hold.reservation_id)
    # The holds that ended alike share the message's per-hold duration: one write per outcome.
    per_hold = duration / len(holds)
    for outcome, ids in holds_by_outcome.items():
        metrics.record_outcome(outcome, per_hold, age, holds=len(ids))
    if isinstance(message, ReleaseMessage):
        outcome = outcomes[message.reservation_id]
        _log_attempt(message, attempt, outcome, duration)
        return {"outcome": outcome, "reservation_id": message.reservation_id}
    counts = {outcome: len(ids) for outcome, ids in holds_by_outcome.items()}
    attempt_logger.info(
        "release batch attempt",
        extra={
            "holds": len(holds),
            "rejected": len(message.rejected),
            "attempt": attempt.attempt,
            "queue_age_s": _rounded(age),
            "duration_ms": round(duration * 1000, 2),
            "outcomes": counts,
            "holds_by_outcome": holds_by_outcome,
            "trace_id": message.trace_id,
            "task_id": attempt.task_id,
        },
    )
    return {"outcomes": counts, "rejected": len(message.rejected)}


def _span_attributes(holds: Sequence[ReleaseMessage], attempt: Attempt) -> dict[str, Any]:
    """The ``cleanup.release`` span names its hold (``reservation.id``, ``reservation.version``)
    or, for a batch, its holds in order (``reservation.ids``, ``reservation.versions``)."""
    common = {"cleanup.attempt": attempt.attempt, "cleanup.holds": len(holds)}
    if len(holds) == 1:
        return {
            **common,
            "reservation.id": holds[0].reservation_id,
            "reservation.version": holds[0].version,
        }
    return {
        **common,
        "reservation.ids": [hold.reservation_id for hold in holds],
        "reservation.versions": [hold.version for hold in holds],
    }


def _outcome_attributes(
    holds: Sequence[ReleaseMessage], outcomes: dict[int, str]
) -> dict[str, Any]:
    if len(holds) == 1:
        return {"release.outcome": outcomes[holds[0].reservation_id]}
    return {"release.outcomes": [outcomes[hold.reservation_id] for hold in holds]}


def _log_attempt(message: ReleaseMessage, attempt: Attempt, outcome: str, duration: float) -> None:
    attempt_logger.info(
        "release attempt",
        extra={
            "reservation_id": message.reservation_id,
            "version": message.version,
            "expires_at": message.expires_at.isoformat(),
            "attempt": attempt.attempt,
            "queue_age_s": _rounded(attempt.queue_age_seconds),
            "duration_ms": round(duration * 1000, 2),
            "outcome": outcome,
            "trace_id": message.trace_id,
            "task_id": attempt.task_id,
        },
    )


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)
