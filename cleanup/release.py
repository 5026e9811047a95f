"""Handle one release message: one transaction with the hold's conditional transition and the
message's receipt; acknowledgment (acks_late) follows the commit.

Order of decisions (DESIGN "Outcomes"): malformed → receipt exists → the domain's answer
(not_found, already_handled, renewed, no_longer_held, not_expired, released).

The release and its receipt are one statement (autocommit: one round trip, no BEGIN/COMMIT).
That keeps the order above: duplicates of one key serialize on the hold's row lock, the later
one finds the hold released at this version, and for any outcome other than ``released`` a
receipt conflict overrides what the domain said (it changed nothing).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from django.db import connection, transaction

from reservations.services import ReleaseOutcome, release_if_expired_with

from .messages import ReleaseMessage
from .models import CleanupReceipt

logger = logging.getLogger("cleanup.release")

ALREADY_HANDLED = ReleaseOutcome.ALREADY_HANDLED.value
RECEIPT_TABLE = CleanupReceipt._meta.db_table
# Outcomes that record no receipt, because the same key may legitimately be released later:
# not_expired (the hold expires later at the same version) and not_found (a message may name
# an id before its hold exists; a receipt would then block that hold's release for good).
NO_RECEIPT = {ReleaseOutcome.NOT_EXPIRED.value, ReleaseOutcome.NOT_FOUND.value}
# A released hold's receipt replaces a non-released receipt for the same key (one written by an
# older version of this code, say): exactly one 'released' receipt per hold, and never an
# integrity error that would leave an expired hold held.
_UPSERT_RELEASED = (
    f"ON CONFLICT (idempotency_key) DO UPDATE SET outcome = EXCLUDED.outcome, "
    f"attempt = EXCLUDED.attempt, worker = EXCLUDED.worker, task_id = EXCLUDED.task_id, "
    f"trace_id = EXCLUDED.trace_id, queue_age_seconds = EXCLUDED.queue_age_seconds, "
    f"duration_ms = EXCLUDED.duration_ms, created_at = EXCLUDED.created_at "
    f"WHERE EXCLUDED.outcome = 'released' AND {RECEIPT_TABLE}.outcome <> 'released'"
)


@dataclass(frozen=True)
class Attempt:
    attempt: int
    worker: str
    task_id: str
    queue_age_seconds: float | None


class ReceiptConflictAfterRelease(Exception):
    """Should be impossible: a receipt existed for a key whose hold was just released."""


# Attached to the release statement: the receipt of a message that released its hold commits
# in the same statement (one round trip in autocommit).
_RECEIPT_FOR_RELEASED = (
    f"INSERT INTO {RECEIPT_TABLE} (idempotency_key, reservation_id, version, outcome, attempt, "
    f"worker, task_id, trace_id, queue_age_seconds, duration_ms, created_at) "
    f"SELECT %(key)s, rel.id, rel.version, 'released', %(attempt)s, %(worker)s, %(task)s, "
    f"%(trace)s, %(age)s, "
    f"%(pre_ms)s + EXTRACT(EPOCH FROM clock_timestamp() - statement_timestamp()) * 1000, now() "
    f"FROM rel {_UPSERT_RELEASED} RETURNING id"
)


def release(message: ReleaseMessage, attempt: Attempt) -> str:
    """Apply the release; return the outcome. Transient database errors propagate to the task
    (which retries); nothing is half-done.

    Hot path: one statement in autocommit — lock the offering, release the hold, give the seat
    back, write the outbox event and this message's receipt. Otherwise (nothing released) the
    receipt records why, unless one already exists (→ ``already_handled``)."""
    started = time.perf_counter()
    params = {
        "key": message.idempotency_key,
        "attempt": attempt.attempt,
        "worker": attempt.worker[:200],
        "task": attempt.task_id[:64],
        "trace": message.trace_id,
        "age": attempt.queue_age_seconds,
    }
    params["pre_ms"] = (time.perf_counter() - started) * 1000
    outcome = release_if_expired_with(
        message.reservation_id,
        message.version,
        attach_sql=_RECEIPT_FOR_RELEASED,
        attach_params=params,
    ).value
    if outcome == ReleaseOutcome.RELEASED.value or outcome in NO_RECEIPT:
        return outcome
    duration_ms = (time.perf_counter() - started) * 1000
    with connection.cursor() as cur:
        cur.execute(
            f"INSERT INTO {RECEIPT_TABLE} (idempotency_key, reservation_id, version, "
            f"outcome, attempt, worker, task_id, trace_id, queue_age_seconds, "
            f"duration_ms, created_at) "
            f"VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, now()) "
            f"ON CONFLICT (idempotency_key) DO NOTHING RETURNING id",
            [
                message.idempotency_key,
                message.reservation_id,
                message.version,
                outcome,
                attempt.attempt,
                attempt.worker[:200],
                attempt.task_id[:64],
                message.trace_id,
                attempt.queue_age_seconds,
                duration_ms,
            ],
        )
        inserted = cur.fetchone() is not None
    # A receipt for this key already exists: the message was handled before.
    return outcome if inserted else ALREADY_HANDLED


def release_batch(messages: list[ReleaseMessage], attempt: Attempt) -> dict[int, str]:
    """The batched mode: one transaction for many holds — the set-wise transition, then one
    receipt per hold in one statement. Each hold ends with the outcome it would get alone."""
    from reservations.bulk import release_many_if_expired

    started = time.perf_counter()
    by_id = {m.reservation_id: m for m in messages}
    with transaction.atomic():
        decided = release_many_if_expired([(m.reservation_id, m.version) for m in messages])
        outcomes = {rid: outcome.value for rid, outcome in decided.items()}
        recorded = [m for m in by_id.values() if outcomes[m.reservation_id] not in NO_RECEIPT]
        if recorded:
            duration_ms = (time.perf_counter() - started) * 1000
            with connection.cursor() as cur:
                cur.execute(
                    f"INSERT INTO {RECEIPT_TABLE} (idempotency_key, reservation_id, version, "
                    f"outcome, attempt, worker, task_id, trace_id, queue_age_seconds, "
                    f"duration_ms, created_at) "
                    f"SELECT k, r, v, o, %(attempt)s, %(worker)s, %(task)s, t, %(age)s, "
                    f"%(ms)s, now() FROM unnest(%(keys)s::text[], %(ids)s::bigint[], "
                    f"%(versions)s::int[], %(outcomes)s::text[], %(traces)s::text[]) "
                    f"AS x(k, r, v, o, t) {_UPSERT_RELEASED} RETURNING reservation_id",
                    {
                        "attempt": attempt.attempt,
                        "worker": attempt.worker[:200],
                        "task": attempt.task_id[:64],
                        "age": attempt.queue_age_seconds,
                        "ms": duration_ms,
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
                    if outcomes[m.reservation_id] == ReleaseOutcome.RELEASED.value:
                        raise ReceiptConflictAfterRelease(m.idempotency_key)
                    outcomes[m.reservation_id] = ALREADY_HANDLED
    return outcomes
