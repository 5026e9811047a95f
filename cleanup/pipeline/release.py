"""Handle release messages: the hold's conditional transition and the message's receipt in one
statement; acknowledgment (acks_late) follows the commit.

Order of decisions (docs/PIPELINE.md, "Outcome order"): malformed → receipt exists → the
domain's answer (not_found, already_handled, renewed, no_longer_held, not_expired, released).

The release and its receipt are one statement (autocommit: one round trip, no BEGIN/COMMIT).
That keeps the order above: duplicates of one key serialize on the hold's row lock, the later
one finds the hold released at this version, and for any outcome other than ``released`` a
receipt conflict overrides what the domain said (it changed nothing). The per-reservation and
the batched modes run the same code: a message is a batch of one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from django.db import connection

from cleanup.models import CleanupReceipt
from cleanup.pipeline.messages import ReleaseMessage
from reservations.services import RELEASED_ROWS, AttachedWrite, ReleaseOutcome, release_holds

logger = logging.getLogger("cleanup.release")

ALREADY_HANDLED = ReleaseOutcome.ALREADY_HANDLED.value
RELEASED = ReleaseOutcome.RELEASED.value
RECEIPT_TABLE = CleanupReceipt._meta.db_table
# Outcomes that record no receipt, because the same key may legitimately be released later:
# not_expired (the hold expires later at the same version) and not_found (a message may name
# an id before its hold exists; a receipt would then block that hold's release for good).
NO_RECEIPT = {ReleaseOutcome.NOT_EXPIRED.value, ReleaseOutcome.NOT_FOUND.value}

_RECEIPT_COLUMNS = (
    "idempotency_key, reservation_id, version, outcome, attempt, worker, task_id, trace_id, "
    "queue_age_seconds, duration_ms, created_at"
)
# Receipts of the released holds, written by the release statement itself (``AttachedWrite``):
# one per released row, its message's key, trace and version joined by hold id. The duration
# is the Python time before the statement plus the statement's own, as the database measures
# it.
# A released hold's receipt replaces a non-released receipt for the same key (one written by an
# older version of this code, say): exactly one 'released' receipt per hold, and never an
# integrity error that would leave an expired hold held.
_RELEASED_RECEIPTS = (
    f"INSERT INTO {RECEIPT_TABLE} ({_RECEIPT_COLUMNS}) "
    f"SELECT m.key, x.id, m.version, 'released', %(attempt)s, %(worker)s, %(task)s, m.trace, "
    f"%(age)s, %(pre_ms)s "
    f"+ EXTRACT(EPOCH FROM clock_timestamp() - statement_timestamp()) * 1000, now() "
    f"FROM {RELEASED_ROWS} x "
    f"JOIN unnest(%(r_ids)s::bigint[], %(r_keys)s::text[], %(r_traces)s::text[], "
    f"%(r_versions)s::int[]) AS m(id, key, trace, version) ON m.id = x.id "
    f"ON CONFLICT (idempotency_key) DO UPDATE SET outcome = EXCLUDED.outcome, "
    f"attempt = EXCLUDED.attempt, worker = EXCLUDED.worker, task_id = EXCLUDED.task_id, "
    f"trace_id = EXCLUDED.trace_id, queue_age_seconds = EXCLUDED.queue_age_seconds, "
    f"duration_ms = EXCLUDED.duration_ms, created_at = EXCLUDED.created_at "
    f"WHERE {RECEIPT_TABLE}.outcome <> 'released' "
    f"RETURNING reservation_id"
)
# Receipts of the other outcomes: a receipt that already exists for a key means the message
# was handled before (→ already_handled).
_OTHER_RECEIPTS = (
    f"INSERT INTO {RECEIPT_TABLE} ({_RECEIPT_COLUMNS}) "
    f"SELECT k, r, v, o, %(attempt)s, %(worker)s, %(task)s, t, %(age)s, %(ms)s, now() "
    f"FROM unnest(%(keys)s::text[], %(ids)s::bigint[], %(versions)s::int[], "
    f"%(outcomes)s::text[], %(traces)s::text[]) AS x(k, r, v, o, t) "
    f"ON CONFLICT (idempotency_key) DO NOTHING RETURNING reservation_id"
)


@dataclass(frozen=True)
class Attempt:
    attempt: int
    worker: str
    task_id: str
    queue_age_seconds: float | None


def release_batch(messages: list[ReleaseMessage], attempt: Attempt) -> dict[int, str]:
    """Apply the release for each message; return each hold's outcome by id. Transient
    database errors propagate to the task (which retries); nothing is half-done.

    1. One statement (autocommit, one round trip): release every hold that is still held at
       its message's version and has expired, give the seats back, write the outbox events and
       the released holds' receipts.
    2. Only when some hold was not released: a receipt per other outcome says why (unless one
       exists already → ``already_handled``); not_expired and not_found record none.
    """
    started = time.perf_counter()
    by_id: dict[int, ReleaseMessage] = {}
    for message in messages:
        by_id.setdefault(message.reservation_id, message)
    common: dict[str, Any] = {
        "attempt": attempt.attempt,
        "worker": attempt.worker[:200],
        "task": attempt.task_id[:64],
        "age": attempt.queue_age_seconds,
    }
    receipts = AttachedWrite(
        _RELEASED_RECEIPTS,
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
        [(m.reservation_id, m.version) for m in by_id.values()], attach=receipts
    )
    outcomes = {rid: outcome.value for rid, outcome in decided.items()}
    recorded = [
        m for m in by_id.values() if outcomes[m.reservation_id] not in NO_RECEIPT | {RELEASED}
    ]
    if recorded:
        with connection.cursor() as cur:
            cur.execute(
                _OTHER_RECEIPTS,
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
