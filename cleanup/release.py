"""Handle one release message: one transaction with the hold's conditional transition and the
message's receipt; acknowledgment (acks_late) follows the commit.

Order of decisions (DESIGN "Outcomes"): malformed → receipt exists → the domain's answer
(not_found, already_handled, renewed, no_longer_held, not_expired, released).

The domain statement runs first and the receipt insert second, so a release costs two
statements plus the commit. That keeps the order above: duplicates of one key serialize on the
hold's row lock, and a receipt conflict overrides whatever the domain said (it changed nothing,
since a hold can be released at one version only once).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from django.db import connection, transaction

from reservations.services import ReleaseOutcome, release_if_expired

from .messages import ReleaseMessage
from .models import CleanupReceipt

logger = logging.getLogger("cleanup.release")

ALREADY_HANDLED = ReleaseOutcome.ALREADY_HANDLED.value
RECEIPT_TABLE = CleanupReceipt._meta.db_table
# not_expired records no receipt: the same key may legitimately be released later.
NO_RECEIPT = {ReleaseOutcome.NOT_EXPIRED.value}


@dataclass(frozen=True)
class Attempt:
    attempt: int
    worker: str
    task_id: str
    queue_age_seconds: float | None


class ReceiptConflictAfterRelease(Exception):
    """Should be impossible: a receipt existed for a key whose hold was just released."""


def release(message: ReleaseMessage, attempt: Attempt) -> str:
    """Apply the release; return the outcome. Transient database errors propagate to the task
    (which retries); the transaction is rolled back and nothing is half-done."""
    started = time.perf_counter()
    with transaction.atomic():
        outcome = release_if_expired(message.reservation_id, message.version).value
        if outcome not in NO_RECEIPT:
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
            if not inserted:
                if outcome == ReleaseOutcome.RELEASED.value:
                    raise ReceiptConflictAfterRelease(message.idempotency_key)
                outcome = ALREADY_HANDLED
    return outcome
