"""The drills' raw SQL, by name: the burst drill's samples of its own holds and the pipeline's
invariants, read from the database after a drain. They are checks of the product, not part of
it, so they live beside the drills that run them (cleanup/sql.py holds the product's own)."""

from __future__ import annotations

from reservations.eligibility import eligible_sql

# --- The burst drill (drills.burst): only the drill's own holds, ids lo..hi ------------------

DRILL_HOLDS_TO_RENEW = (
    "SELECT id, version FROM reservations_reservation WHERE id = ANY(%s) AND status = 'held' "
    "AND version = 1 AND expires_at > now() AND expires_at <= now() + interval '2.5 s'"
)
DRILL_HOLDS_EXPIRED = (
    "SELECT id FROM reservations_reservation WHERE id = ANY(%s) AND expires_at <= now()"
)
# Per shard (bucket % shards), the oldest eligible hold's age: one index-ordered probe per bucket
# (reservations_held_bucket_idx), a few milliseconds however large the backlog, so the drill can
# read it every second without competing with the pipeline it measures.
DRILL_OLDEST_BY_SHARD = (
    f"SELECT shard_bucket.bucket %% %(shards)s, "
    f"EXTRACT(EPOCH FROM now() - min(oldest.expires_at))::float8 "
    f"FROM generate_series(0, %(buckets)s - 1) AS shard_bucket(bucket) CROSS JOIN LATERAL ("
    f"SELECT expires_at FROM reservations_reservation "
    f"WHERE bucket = shard_bucket.bucket::smallint AND {eligible_sql()} "
    f"AND id BETWEEN %(lo)s AND %(hi)s ORDER BY expires_at LIMIT 1) oldest GROUP BY 1"
)
# The counts: a scan of the drill's holds, read every few seconds in a large drill.
DRILL_ELIGIBLE = (
    f"SELECT count(*) FROM reservations_reservation WHERE id BETWEEN %s AND %s AND {eligible_sql()}"
)
DRILL_RELEASED = (
    "SELECT count(*) FROM reservations_reservation WHERE id BETWEEN %s AND %s "
    "AND status = 'released'"
)
# Redeliveries counted for the drill's holds at their first version (the table holds only
# redelivered keys: small).
DRILL_REDELIVERIES = (
    "SELECT coalesce(sum(count), 0) FROM cleanup_deliverycount "
    "WHERE idempotency_key LIKE 'release:%%:1' "
    "AND split_part(idempotency_key, ':', 2)::bigint BETWEEN %s AND %s"
)
DRILL_EXPIRY = "SELECT expires_at, id FROM reservations_reservation WHERE id = ANY(%s)"
DRILL_RECEIPT_OUTCOMES = (
    "SELECT outcome, count(*), coalesce(sum(attempt - 1), 0) FROM cleanup_cleanupreceipt "
    "WHERE reservation_id BETWEEN %s AND %s GROUP BY outcome"
)
DEAD_LETTERS_IN_LAST = (
    "SELECT count(*) FROM cleanup_deadletter WHERE created_at > now() - make_interval(secs => %s)"
)
DRILL_RECEIPT_STATS = (
    "SELECT count(*), avg(duration_ms), percentile_cont(0.5) WITHIN GROUP (ORDER BY "
    "duration_ms), percentile_cont(0.99) WITHIN GROUP (ORDER BY queue_age_seconds), "
    "EXTRACT(EPOCH FROM max(created_at) - min(created_at))::float8 "
    "FROM cleanup_cleanupreceipt WHERE reservation_id BETWEEN %s AND %s"
)
# The release messages of the drill's holds, and how many carried one hold.
DRILL_MESSAGES = (
    "SELECT count(*), count(*) FILTER (WHERE n = 1) FROM (SELECT task_id, count(*) AS n "
    "FROM cleanup_cleanupreceipt WHERE reservation_id BETWEEN %s AND %s GROUP BY task_id) m"
)
DRILL_RELEASE_LATENESS = (
    "SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY "
    "EXTRACT(EPOCH FROM released_at - expires_at)), "
    "max(EXTRACT(EPOCH FROM released_at - expires_at))::float8 "
    "FROM reservations_reservation WHERE id BETWEEN %s AND %s AND status = 'released'"
)

# --- The pipeline's invariants (drills.invariants) -------------------------------------------

HOLDS_RELEASED_TWICE_BY_EVENTS = (
    "SELECT reservation_id, count(*) FROM reservations_outboxevent "
    "WHERE kind = 'reservation.released' GROUP BY reservation_id HAVING count(*) > 1"
)
HOLDS_RELEASED_TWICE_BY_RECEIPTS = (
    "SELECT reservation_id, count(*) FROM cleanup_cleanupreceipt "
    "WHERE outcome = 'released' GROUP BY reservation_id HAVING count(*) > 1"
)
RELEASED_HOLDS_WITHOUT_EVENT = (
    "SELECT count(*) FROM reservations_reservation hold WHERE hold.status = 'released' "
    "AND NOT EXISTS (SELECT 1 FROM reservations_outboxevent event "
    "WHERE event.reservation_id = hold.id AND event.kind = 'reservation.released')"
)
# The same, for holds released since a time (%s): older ones' events may be pruned already.
RELEASED_SINCE_WITHOUT_EVENT = (
    "SELECT count(*) FROM reservations_reservation hold WHERE hold.status = 'released' "
    "AND hold.released_at >= %s "
    "AND NOT EXISTS (SELECT 1 FROM reservations_outboxevent event "
    "WHERE event.reservation_id = hold.id AND event.kind = 'reservation.released')"
)
# A 'released' receipt records its message's version; the hold records the version it was
# released at.
RELEASED_AT_ANOTHER_VERSION = (
    "SELECT hold.id, receipt.version, hold.released_version FROM reservations_reservation hold "
    "JOIN cleanup_cleanupreceipt receipt "
    "ON receipt.reservation_id = hold.id AND receipt.outcome = 'released' "
    "WHERE hold.released_version IS DISTINCT FROM receipt.version ORDER BY hold.id"
)
HOLDS_NOT_RELEASED = (
    "SELECT count(*) FROM reservations_reservation WHERE id = ANY(%s) AND status <> 'released'"
)
HOLDS_RELEASED = (
    "SELECT count(*) FROM reservations_reservation WHERE id = ANY(%s) AND status = 'released'"
)
