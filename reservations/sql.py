"""Every raw SQL statement of the domain, by name.

Callers use the names (``cur.execute(sql.RENEW_HOLD, ...)``); the text lives here only. A
statement is a constant unless it is assembled from pieces: ``release_statement`` (the release
CTEs plus the caller's attached write) is the one builder. "Eligible" itself is written once,
in ``reservations.eligibility.eligible_sql``; the statements here build on it.

Placeholders are named (``%(name)s``) where a statement reads a value more than once or where
the clock is involved; ``CLOCK`` is "the test clock when given, else the database's" (see
``CLOCK`` for which database clock, and ``SCAN_CLOCK`` for the index-ordered scans).

The release statement is a contract with the cleanup, which attaches its receipts to it
(``reservations.services.AttachedWrite``): they meet in ``RELEASED_ROWS`` (the CTE the attached
write reads), ``RELEASED_COLUMNS`` (what that CTE returns) and ``RELEASE_PARAMS`` (the
placeholders the release itself uses). The statement below is built from those three names, so
they cannot drift from it; tests/unit/project/test_release_contract.py checks both sides.
"""

from __future__ import annotations

from .eligibility import eligible_sql

# ``now`` for SQL: the explicit test clock when given, else the database clock.
#
# Every expiry decision (create, renew, confirm, release, the reasons for a refusal) reads
# ``clock_timestamp()``, the time the statement reads it. Not ``now()``: that is the
# transaction's start, which can be well before the statement (a request that waited on an
# Idempotency-Key's lock, or ran other statements first), so a hold whose lease had ended could
# still be renewed or confirmed. Not ``statement_timestamp()`` either: a statement that waits on
# a row lock re-checks the row after the wait, and ``clock_timestamp()`` is read again at that
# re-check. These statements find their rows by key, so a volatile clock costs no index.
CLOCK = "COALESCE(%(now)s::timestamptz, clock_timestamp())"
# The clock of scans ordered by ``expires_at`` (the sweep's claim, the backlog reads):
# ``statement_timestamp()`` is stable within the statement, so ``expires_at <= clock`` stays an
# index condition (a volatile clock would make it a filter and read every held row of a bucket).
# It decides nothing on its own: the release re-checks expiry with ``CLOCK``.
SCAN_CLOCK = "COALESCE(%(now)s::timestamptz, statement_timestamp())"

# --- Holds: create, renew, confirm, cancel ----------------------------------------------------

# The one INSERT of holds: ``hold_seat`` writes one row through it, drills and tests many.
INSERT_HOLDS = f"""
INSERT INTO reservations_reservation (offering_id, holder, client_id, status, expires_at,
                 next_attempt_at, version, claim_count, last_trace_id, created_at, updated_at,
                 release_reason, request_traceparent)
SELECT %(offering)s, wanted.holder, %(client)s, 'held', expiry.at, expiry.at, 1, 0, '', now(),
       now(), '', %(traceparent)s
FROM unnest(%(holders)s::text[], %(secs)s::float8[]) WITH ORDINALITY
     AS wanted(holder, secs, position)
CROSS JOIN LATERAL (SELECT {CLOCK} + make_interval(secs => wanted.secs) AS at) expiry
ORDER BY wanted.position
RETURNING id, expires_at
"""

INSERT_OUTBOX_EVENT = (
    "INSERT INTO reservations_outboxevent (kind, reservation_id, version, payload, created_at) "
    "VALUES (%(kind)s, %(id)s, %(version)s, %(payload)s::jsonb, now())"
)

INSERT_OFFERING = (
    "INSERT INTO reservations_offering (name, capacity, seats_available, created_at) "
    "VALUES (%s, %s, %s, now()) RETURNING id"
)

LOCK_OFFERING_SEATS = "SELECT seats_available FROM reservations_offering WHERE id = %s FOR UPDATE"
OFFERING_SEATS = "SELECT seats_available FROM reservations_offering WHERE id = %s"
TAKE_SEAT = "UPDATE reservations_offering SET seats_available = seats_available - 1 WHERE id = %s"
GIVE_SEAT_BACK = (
    "UPDATE reservations_offering SET seats_available = seats_available + 1 WHERE id = %s"
)

# The eligible holds of a full offering that ``hold_seat`` releases first, ascending id (each
# release re-checks expiry with ``CLOCK``).
RECLAIMABLE_HOLDS = (
    f"SELECT id, version FROM reservations_reservation WHERE offering_id = %(offering)s "
    f"AND {eligible_sql(now=SCAN_CLOCK)} ORDER BY id LIMIT %(limit)s"
)

# Offerings before reservations: the hold's offering, locked.
LOCK_OFFERING_OF_HOLD = (
    "SELECT offering.id FROM reservations_offering offering WHERE offering.id = "
    "(SELECT offering_id FROM reservations_reservation WHERE id = %s) FOR UPDATE"
)

# Why a conditional update matched no row.
HOLD_STATE = (
    f"SELECT status, version, expires_at <= {CLOCK} FROM reservations_reservation WHERE id = %(id)s"
)

RENEW_HOLD = (
    f"UPDATE reservations_reservation SET expires_at = {CLOCK} + make_interval(secs => %(ttl)s), "
    f"next_attempt_at = {CLOCK} + make_interval(secs => %(ttl)s), "
    f"version = version + 1, updated_at = now(), request_traceparent = %(traceparent)s "
    f"WHERE id = %(id)s AND version = %(version)s AND status = 'held' "
    f"AND expires_at > {CLOCK} RETURNING version, expires_at"
)

CONFIRM_HOLD = (
    f"UPDATE reservations_reservation SET status = 'confirmed', version = version + 1, "
    f"updated_at = now() "
    f"WHERE id = %(id)s AND version = %(version)s AND status = 'held' "
    f"AND expires_at > {CLOCK} RETURNING version"
)

CANCEL_HOLD = (
    "UPDATE reservations_reservation SET status = 'cancelled', version = version + 1, "
    "updated_at = now() "
    "WHERE id = %(id)s AND version = %(version)s AND status = 'held' "
    "RETURNING version, offering_id"
)

# --- The release statement and its contract --------------------------------------------------

# The CTE an attached write reads, its columns, and the placeholders of the release itself.
RELEASED_ROWS = "released_rows"
RELEASED_COLUMNS = ("id", "offering_id", "version", "expires_at", "request_traceparent")
RELEASE_PARAMS = frozenset({"ids", "versions", "reason", "now"})

# The release statement, for one hold or many (``unnest`` of ids and expected versions):
# 1. ``locked_offerings`` locks the offering of every hold still held at its expected
#    version, ascending id. The UPDATE reads it through a scalar subquery, which PostgreSQL
#    evaluates once, in full, before the first hold row qualifies: all offerings are locked
#    before any hold (offerings before reservations). A hold already released, cancelled,
#    confirmed or renewed can never be released at that version again, so its offering is not
#    locked: a duplicate or stale message answers without waiting on the releases that hold it.
# 2. ``released_rows`` moves each hold that is still held at the version its caller saw and has
#    expired to released, recording that version.
# 3. ``seats`` gives the seats back, one UPDATE per offering; ``events`` writes one
#    ``reservation.released`` outbox event per hold.
# 4. An optional attached write (the caller's, e.g. a receipt) reads ``released_rows``.
# "(status = 'held') IS TRUE" keeps the planner on the primary key: a plain status = 'held' lets
# it pick the partial held-index and filter by id, which scans every held row when the table's
# statistics are stale (seen after bulk inserts: 80 ms per release).
RELEASE_CTES = f"""
WITH wanted AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(versions)s::int[]) AS wanted(id, version)
), locked_offerings AS (
    SELECT offering.id FROM reservations_offering offering
    WHERE offering.id IN (
        SELECT hold.offering_id FROM reservations_reservation hold JOIN wanted USING (id)
        WHERE hold.status = 'held' AND hold.version = wanted.version
    )
    ORDER BY offering.id
    FOR UPDATE
), {RELEASED_ROWS} AS (
    UPDATE reservations_reservation hold
    SET status = 'released', released_version = hold.version, released_at = now(),
        release_reason = %(reason)s::text, updated_at = now()
    FROM wanted
    WHERE hold.id = wanted.id AND hold.version = wanted.version
      AND hold.offering_id = ANY((SELECT array_agg(id) FROM locked_offerings)::bigint[])
      AND {eligible_sql("hold", CLOCK, off_the_held_index=True)}
    RETURNING {", ".join(f"hold.{column}" for column in RELEASED_COLUMNS)}
), seats AS (
    UPDATE reservations_offering offering
    SET seats_available = offering.seats_available + per_offering.released
    FROM (
        SELECT offering_id, count(*) AS released FROM {RELEASED_ROWS} GROUP BY offering_id
    ) per_offering
    WHERE offering.id = per_offering.offering_id
    RETURNING offering.id
), events AS (
    INSERT INTO reservations_outboxevent (kind, reservation_id, version, payload, created_at)
    SELECT 'reservation.released', released.id, released.version,
           jsonb_build_object('offering_id', released.offering_id,
                              'expires_at', released.expires_at, 'reason', %(reason)s::text),
           now()
    FROM {RELEASED_ROWS} released
    RETURNING id
)"""


def release_statement(attached_write: str | None = None) -> str:
    """The release statement: ``RELEASE_CTES``, the caller's write as one more CTE when given,
    and each released hold's id and request traceparent."""
    statement = RELEASE_CTES
    if attached_write is not None:
        statement += f", attached AS ({attached_write})"
    return statement + f"\nSELECT id, request_traceparent FROM {RELEASED_ROWS}"


# Why each hold the release did not release was not released (a new statement: a new snapshot
# under READ COMMITTED).
RELEASE_REFUSALS = (
    f"SELECT id, status, version, released_version, expires_at <= {CLOCK} "
    f"FROM reservations_reservation WHERE id = ANY(%(ids)s)"
)

# --- Reads: seats, the backlog ---------------------------------------------------------------

# Offerings where capacity != seats_available + held + confirmed.
SEAT_CONSERVATION_VIOLATIONS = (
    "SELECT offering.id, offering.capacity, offering.seats_available, "
    "count(*) FILTER (WHERE hold.status = 'held'), "
    "count(*) FILTER (WHERE hold.status = 'confirmed') "
    "FROM reservations_offering offering "
    "LEFT JOIN reservations_reservation hold ON hold.offering_id = offering.id "
    "GROUP BY offering.id "
    "HAVING offering.capacity <> offering.seats_available "
    "+ count(*) FILTER (WHERE hold.status IN ('held', 'confirmed'))"
)

AVAILABILITY = (
    f"SELECT offering.capacity, offering.seats_available, "
    f"count(hold.id) FILTER (WHERE hold.status = 'held'), "
    f"count(hold.id) FILTER (WHERE {eligible_sql('hold')}), "
    f"count(hold.id) FILTER (WHERE hold.status = 'confirmed') "
    f"FROM reservations_offering offering LEFT JOIN reservations_reservation hold "
    f"ON hold.offering_id = offering.id AND hold.status IN ('held', 'confirmed') "
    f"WHERE offering.id = %s GROUP BY offering.id"
)

# Index-ordered, per bucket of the shard (reservations_held_bucket_idx: bucket, expires_at
# WHERE status='held'): one probe per bucket, the minimum of those. Never an aggregate over the
# backlog, and an empty shard beside a large backlog elsewhere stays cheap.
OLDEST_ELIGIBLE_AGE = (
    f"SELECT EXTRACT(EPOCH FROM (statement_timestamp() - min(oldest.expires_at)))::float8 "
    f"FROM unnest(%s::smallint[]) AS shard_bucket(bucket) CROSS JOIN LATERAL ("
    f"SELECT expires_at FROM reservations_reservation "
    f"WHERE bucket = shard_bucket.bucket AND {eligible_sql()} "
    f"ORDER BY expires_at LIMIT 1) oldest"
)
# Counts at most cap + 1 rows: the answer is exact below the cap and "capped" above it.
ELIGIBLE_COUNT = (
    f"SELECT count(*) FROM (SELECT 1 FROM reservations_reservation "
    f"WHERE bucket = ANY(%s::smallint[]) AND {eligible_sql()} "
    f"LIMIT %s) AS capped"
)

# --- Maintenance -----------------------------------------------------------------------------

# Fresh statistics, as autovacuum would give a production table after a bulk load.
ANALYZE_HOLDS_AND_OFFERINGS = ("ANALYZE reservations_reservation", "ANALYZE reservations_offering")


# --- API clients and idempotency keys (reservations.clients, reservations.idempotency) --------

# Authentication is a read: the token's client, when the token is unrevoked and the client
# active (nothing otherwise), and whether the token's recorded last use is older than
# %(touch)s seconds. Rate limits are counted in Redis (reservations.ratelimit).
AUTHENTICATE_TOKEN = """
SELECT c.id, c.name, c.can_read, c.can_write, c.all_offerings, c.requests_per_minute, t.id,
       t.last_used_at IS NULL OR t.last_used_at < now() - make_interval(secs => %(touch)s)
FROM reservations_apitoken AS t
JOIN reservations_apiclient AS c ON c.id = t.client_id
WHERE t.digest = %(digest)s AND t.revoked_at IS NULL AND c.is_active
"""

# The token's last use, written at most once per %(touch)s seconds (however many processes
# see it stale at once, the condition lets one UPDATE write and the rest match no row).
TOUCH_TOKEN = """
UPDATE reservations_apitoken SET last_used_at = now()
WHERE id = %(token)s
  AND (last_used_at IS NULL OR last_used_at < now() - make_interval(secs => %(touch)s))
"""

# An expired key is as good as none: it goes before the claim, so its key can be used again.
DELETE_EXPIRED_IDEMPOTENCY_KEY = """
DELETE FROM reservations_idempotencykey
WHERE client_id IS NOT DISTINCT FROM %(client)s AND key = %(key)s
  AND expires_at <= clock_timestamp()
"""

# Claims a key for this request. A concurrent request under the same key waits here, on the
# unique index, until the first one's transaction ends: then it inserts nothing (the first
# committed) and reads what was stored, or inserts (the first rolled back) and goes ahead.
CLAIM_IDEMPOTENCY_KEY = """
INSERT INTO reservations_idempotencykey (client_id, key, request_hash, response_status,
                                        response_body, response_headers, created_at, expires_at)
VALUES (%(client)s, %(key)s, %(hash)s, 0, 'null', '{}', now(),
        now() + make_interval(secs => %(ttl)s))
ON CONFLICT (client_id, key) DO NOTHING
RETURNING id
"""

STORED_IDEMPOTENT_RESPONSE = """
SELECT request_hash, response_status, response_body, response_headers
FROM reservations_idempotencykey
WHERE client_id IS NOT DISTINCT FROM %(client)s AND key = %(key)s
"""

STORE_IDEMPOTENT_RESPONSE = """
UPDATE reservations_idempotencykey
SET response_status = %(status)s, response_body = %(body)s::jsonb,
    response_headers = %(headers)s::jsonb
WHERE id = %(id)s
"""

# The prune, a batch at a time on reservations_idem_expiry_idx.
PRUNE_IDEMPOTENCY_KEYS = """
DELETE FROM reservations_idempotencykey
WHERE id IN (SELECT id FROM reservations_idempotencykey WHERE expires_at <= statement_timestamp()
             ORDER BY expires_at LIMIT %(batch)s)
"""

# --- The connection's own statements (reservations.db, reservations.pooling) -------------------

# The statement timeout of the current transaction only (``SET LOCAL``), in milliseconds.
LOCAL_STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"
# Prepared statements of this connection planned once, generically (reservations/db.py).
FORCE_GENERIC_PLANS = "SET plan_cache_mode = force_generic_plan"
# Which server process answers this client (the pooling probe compares two answers).
BACKEND_PID = "SELECT pg_backend_pid()"
