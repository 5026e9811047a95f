"""Every raw SQL statement of the cleanup, by name (the domain's are in reservations/sql.py).

Grouped by the module that runs them: the release core (the claim, receipts, advisory locks,
retention, dead letters, the delivery cap), the operator console and the autoscaler (reads).
The drills' checks live beside them, in tools/drills/sql.py. Callers use the names; the text
lives here only. Tables are named as Django names them (``<app>_<model>``).

The receipts of released holds are written by the domain's release statement itself: this
module's ``RELEASED_RECEIPTS`` is the cleanup's side of that contract, reading the CTE named
``reservations.sql.RELEASED_ROWS`` (columns ``RELEASED_COLUMNS``) with placeholders of its own,
none of ``RELEASE_PARAMS`` (tests/unit/project/test_release_contract.py).
"""

from __future__ import annotations

from reservations.sql import RELEASED_ROWS, SCAN_CLOCK, eligible_sql

# --- The sweep's claim (release.claim) ------------------------------------------------------

# Candidates come from each bucket of the shard, oldest expiry first (index
# reservations_held_bucket_idx, the SLO's: a few rows per bucket, leased rows skipped), then the
# oldest of them are locked, skipping locked rows, and leased. The cost follows the batch and the
# number of buckets, never the table or other shards' backlogs. Buckets are uniform (id % 1024),
# so a few rows per bucket fill a batch.
#
# The lease (next_attempt_at) is in no index, so a claim changes no indexed column and
# PostgreSQL can write it as a heap-only (HOT) update: a new row version on the same page and no
# index entry, where a lease in an index cost one entry in each of the table's indexes per claimed
# hold (the claim then cost about as much as the release; docs/PERFORMANCE.md). The table keeps
# free room on each page for it (fillfactor, migration 0003). A leased hold is skipped by reading
# its row: at most the holds in flight (the queue is capped) and the set-aside ones.
# The UPDATE finds the locked rows by primary key (= ANY of the locked ids): a join with the CTE
# let the planner hash the whole table (10 of 46 ms for 500 holds among 20,000).
CLAIM_EXPIRED = f"""
WITH candidates AS (
    SELECT candidate.id, candidate.expires_at
    FROM unnest(%(buckets)s::smallint[]) AS shard_bucket(bucket)
    CROSS JOIN LATERAL (
        SELECT id, expires_at FROM reservations_reservation
        WHERE bucket = shard_bucket.bucket AND {eligible_sql(now=SCAN_CLOCK)}
          AND next_attempt_at <= {SCAN_CLOCK}
        ORDER BY expires_at
        LIMIT %(per_bucket)s
    ) candidate
), due AS (
    SELECT hold.id FROM reservations_reservation hold JOIN candidates ON candidates.id = hold.id
    WHERE {eligible_sql("hold", SCAN_CLOCK)} AND hold.next_attempt_at <= {SCAN_CLOCK}
    ORDER BY candidates.expires_at, hold.id
    LIMIT %(batch)s
    FOR UPDATE OF hold SKIP LOCKED
)
UPDATE reservations_reservation hold
SET claim_count = hold.claim_count + 1,
    last_claimed_at = now(),
    last_trace_id = %(trace)s,
    next_attempt_at = CASE WHEN hold.claim_count + 1 > %(max_claims)s
                           THEN 'infinity'::timestamptz
                           ELSE {SCAN_CLOCK} + make_interval(secs => %(lease)s) END
WHERE hold.id = ANY(ARRAY(SELECT id FROM due))
RETURNING hold.id, hold.version, hold.expires_at, hold.bucket, hold.claim_count, hold.offering_id
"""

# The oldest due hold of every shard (eligible and not leased: what a claim would take next),
# as its age in seconds, for the sweeps' turns near the queue's cap (cleanup/release/admission.py,
# docs/PIPELINE.md "Turns"). One index-ordered probe per bucket (reservations_held_bucket_idx:
# bucket, expires_at WHERE status='held'), then the minimum per shard (bucket %% shards). A
# probe reads past the leased holds at the head of its bucket (the lease is in no index), at
# most the holds in flight, which the queue's cap bounds. Never an aggregate over the backlog.
OLDEST_DUE_BY_SHARD = (
    f"SELECT shard_bucket.bucket %% %(shards)s, "
    f"EXTRACT(EPOCH FROM ({SCAN_CLOCK} - min(oldest.expires_at)))::float8 "
    f"FROM generate_series(0, %(buckets)s - 1) AS shard_bucket(bucket) CROSS JOIN LATERAL ("
    f"SELECT expires_at FROM reservations_reservation "
    f"WHERE bucket = shard_bucket.bucket::smallint AND {eligible_sql(now=SCAN_CLOCK)} "
    f"AND next_attempt_at <= {SCAN_CLOCK} "
    f"ORDER BY expires_at LIMIT 1) oldest GROUP BY 1"
)

# --- Advisory locks (keys: cleanup.release.locks) -------------------------------------------

TRY_ADVISORY_LOCK = "SELECT pg_try_advisory_lock(%s, %s)"
ADVISORY_UNLOCK = "SELECT pg_advisory_unlock(%s, %s)"
ADVISORY_UNLOCK_ALL = "SELECT pg_advisory_unlock_all()"
TRY_TRANSACTION_ADVISORY_LOCK = "SELECT pg_try_advisory_xact_lock(%s, %s)"
# Waiting in line for a session lock, for at most the session's lock_timeout (milliseconds).
ADVISORY_LOCK = "SELECT pg_advisory_lock(%s, %s)"
SET_LOCK_TIMEOUT_MS = "SELECT set_config('lock_timeout', %s, false)"
RESET_LOCK_TIMEOUT = "RESET lock_timeout"

# Who holds an advisory lock of this database (classid, objid = the lock's two keys; objsubid 2
# marks a two-key lock). Advisory locks are per database: another database's beat on the same
# server is not ours.
ADVISORY_LOCK_HOLDERS = (
    "SELECT activity.application_name, host(activity.client_addr), activity.pid, "
    "activity.backend_start "
    "FROM pg_locks lock JOIN pg_stat_activity activity ON activity.pid = lock.pid "
    "WHERE lock.locktype = 'advisory' AND lock.granted "
    "AND lock.classid = %s::bigint::oid AND lock.objid = %s::bigint::oid "
    "AND lock.objsubid = 2 "
    "AND lock.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)

# How many other sessions of this database hold or wait in line for an advisory lock (a sweep
# asks before it joins the line for the publish lock: cleanup.release.admission).
ADVISORY_LOCK_QUEUE = (
    "SELECT count(*) FROM pg_locks "
    "WHERE locktype = 'advisory' "
    "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 2 "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND pid <> pg_backend_pid()"
)

# Room under the release queue's cap claimed by sweeps that claim and publish without the
# publish lock (cleanup.models.QueueRoom; written by cleanup.release.sweep, counted by
# cleanup.release.admission). Written under the publish lock; a row counts while the session
# that wrote it holds its shard lock, so a sweep that died reserves nothing.
RESERVE_ROOM = (
    "INSERT INTO cleanup_roomclaim (lock_key, pid, holds) "
    "VALUES (%s, pg_backend_pid(), %s) "
    "ON CONFLICT (lock_key) DO UPDATE SET pid = EXCLUDED.pid, holds = EXCLUDED.holds"
)
CLEAR_ROOM = "UPDATE cleanup_roomclaim SET holds = 0 WHERE lock_key = %s AND pid = pg_backend_pid()"
ROOM_RESERVED_BY_OTHERS = (
    "SELECT COALESCE(sum(claim.holds), 0) FROM cleanup_roomclaim claim "
    "JOIN pg_locks lock ON lock.locktype = 'advisory' AND lock.granted "
    "AND lock.classid = %s::bigint::oid AND lock.objid = claim.lock_key::oid "
    "AND lock.objsubid = 2 AND lock.pid = claim.pid "
    "AND lock.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "WHERE claim.holds > 0 AND claim.pid <> pg_backend_pid()"
)

PING = "SELECT 1"
DATABASE_NOW = "SELECT now()"

# --- Receipts (release.release) -------------------------------------------------------------

RECEIPT_COLUMNS = (
    "idempotency_key, reservation_id, version, outcome, attempt, worker, task_id, trace_id, "
    "queue_age_seconds, duration_ms, created_at"
)
# Receipts of the released holds, written by the release statement itself (an attached write):
# one per released row, its message's key, trace and version joined by hold id. The duration
# is the Python time before the statement plus the statement's own, as the database measures
# it.
# A released hold's receipt replaces a non-released receipt for the same key (one written by an
# older version of this code, say): exactly one 'released' receipt per hold, and never an
# integrity error that would leave an expired hold held.
RELEASED_RECEIPTS = (
    f"INSERT INTO cleanup_cleanupreceipt ({RECEIPT_COLUMNS}) "
    f"SELECT message.key, released.id, message.version, 'released', %(attempt)s, %(worker)s, "
    f"%(task)s, message.trace, %(age)s, %(pre_ms)s "
    f"+ EXTRACT(EPOCH FROM clock_timestamp() - statement_timestamp()) * 1000, now() "
    f"FROM {RELEASED_ROWS} released "
    f"JOIN unnest(%(r_ids)s::bigint[], %(r_keys)s::text[], %(r_traces)s::text[], "
    f"%(r_versions)s::int[]) AS message(id, key, trace, version) ON message.id = released.id "
    f"ON CONFLICT (idempotency_key) DO UPDATE SET outcome = EXCLUDED.outcome, "
    f"attempt = EXCLUDED.attempt, worker = EXCLUDED.worker, task_id = EXCLUDED.task_id, "
    f"trace_id = EXCLUDED.trace_id, queue_age_seconds = EXCLUDED.queue_age_seconds, "
    f"duration_ms = EXCLUDED.duration_ms, created_at = EXCLUDED.created_at "
    f"WHERE cleanup_cleanupreceipt.outcome <> 'released' "
    f"RETURNING reservation_id"
)
# Receipts of the other outcomes: a receipt that already exists for a key means the message
# was handled before (→ already_handled).
OTHER_RECEIPTS = (
    f"INSERT INTO cleanup_cleanupreceipt ({RECEIPT_COLUMNS}) "
    f"SELECT message.key, message.id, message.version, message.outcome, %(attempt)s, "
    f"%(worker)s, %(task)s, message.trace, %(age)s, %(ms)s, now() "
    f"FROM unnest(%(keys)s::text[], %(ids)s::bigint[], %(versions)s::int[], "
    f"%(outcomes)s::text[], %(traces)s::text[]) AS message(key, id, version, outcome, trace) "
    f"ON CONFLICT (idempotency_key) DO NOTHING RETURNING reservation_id"
)

# --- Retention (release.outbox.prune): bounded batches of finished rows ---------------------


def _delete_batch(table: str, condition: str) -> str:
    return (
        f"DELETE FROM {table} WHERE id IN "
        f"(SELECT id FROM {table} WHERE {condition} LIMIT %(batch)s)"
    )


PRUNE_PUBLISHED_EVENTS = _delete_batch(
    "reservations_outboxevent", "published_at IS NOT NULL AND published_at < %(before)s"
)
# Events never relayed (the events queue full for the whole retention, or the relay stopped):
# the outbox does not grow without end either.
PRUNE_UNPUBLISHED_EVENTS = _delete_batch(
    "reservations_outboxevent", "published_at IS NULL AND created_at < %(before)s"
)
PRUNE_RECEIPTS = _delete_batch("cleanup_cleanupreceipt", "created_at < %(before)s")
# Delivery counts (release.delivery_cap), a day after their last change.
PRUNE_DELIVERY_COUNTS = (
    "DELETE FROM cleanup_deliverycount WHERE idempotency_key IN "
    "(SELECT idempotency_key FROM cleanup_deliverycount WHERE updated_at < %(before)s "
    "LIMIT %(batch)s)"
)
PRUNE_RESOLVED_DEAD_LETTERS = _delete_batch(
    "cleanup_deadletter", "resolved_at IS NOT NULL AND resolved_at < %(before)s"
)

# --- Dead letters (release.dead_letters) -----------------------------------------------------

# Resolve open letters as discarded; the ids actually resolved (not resolved meanwhile).
DISCARD_DEAD_LETTERS = (
    "UPDATE cleanup_deadletter SET resolved_at = %(at)s, resolution = %(resolution)s, "
    "resolved_by = %(by)s, resolution_note = %(note)s "
    "WHERE id = ANY(%(ids)s) AND resolved_at IS NULL RETURNING id"
)
# Letters the open-letter cap may summarise: open, not a summary, not of an excluded reason.
_SUMMARISABLE = "resolved_at IS NULL AND summarised_count = 0 AND NOT (reason = ANY(%(excluded)s))"
# The newest letter beyond the cap: it and every older summarisable letter are summarised.
NEWEST_LETTER_BEYOND_CAP = (
    f"SELECT id FROM cleanup_deadletter WHERE {_SUMMARISABLE} "
    f"ORDER BY id DESC OFFSET %(cap)s LIMIT 1"
)
LETTERS_TO_SUMMARISE = (
    f"SELECT id, reason, task_name, created_at FROM cleanup_deadletter WHERE {_SUMMARISABLE} "
    f"AND id <= %(newest)s ORDER BY id LIMIT %(batch)s FOR UPDATE SKIP LOCKED"
)
SUMMARISE_LETTERS = (
    "UPDATE cleanup_deadletter SET resolved_at = %(at)s, resolution = %(resolution)s, "
    "resolved_by = %(by)s, resolution_note = %(note)s, payload = '', message = NULL, "
    "error = left(error, %(error_limit)s) WHERE id = ANY(%(ids)s)"
)

# --- Telemetry -------------------------------------------------------------------------------

# The delivery counter without Redis: one upsert, the count so far.
COUNT_DELIVERY = (
    "INSERT INTO cleanup_deliverycount (idempotency_key, count, updated_at) "
    "VALUES (%s, 1, now()) "
    "ON CONFLICT (idempotency_key) DO UPDATE SET count = cleanup_deliverycount.count + 1, "
    "updated_at = now() RETURNING count"
)

# --- The operator console and the autoscaler (reads) -----------------------------------------

OLDEST_UNPUBLISHED_EVENT_AGE = (
    "SELECT EXTRACT(EPOCH FROM (now() - created_at))::float8 FROM reservations_outboxevent "
    "WHERE published_at IS NULL ORDER BY id LIMIT 1"
)
# The "pause releases" switch (one row) and how long it has been on, by PostgreSQL's clock.
RELEASE_PAUSE_AGE = (
    "SELECT paused, EXTRACT(EPOCH FROM (now() - since))::float8 FROM cleanup_releasepause "
    "WHERE id = 1"
)
# Served by the partial index cleanup_dl_open_idx (open letters only).
OPEN_DEAD_LETTERS_BY_REASON = (
    "SELECT reason, count(*) FROM cleanup_deadletter WHERE resolved_at IS NULL GROUP BY reason"
)
# Receipts written in the last %s seconds, and their mean duration (desired consumers).
RECENT_RECEIPTS = (
    "SELECT count(*), avg(duration_ms) FROM cleanup_cleanupreceipt "
    "WHERE created_at > now() - make_interval(secs => %s)"
)
RECEIPT_OUTCOMES_SINCE = (
    "SELECT outcome, count(*) FROM cleanup_cleanupreceipt WHERE created_at >= %s "
    "GROUP BY outcome ORDER BY outcome"
)
RETRIES_SINCE = (
    "SELECT coalesce(sum(attempt - 1), 0) FROM cleanup_cleanupreceipt WHERE created_at >= %s"
)
# The autoscaler's window (served by cleanup_receipt_created_idx): receipts in the window, in
# its second half, and how many other workers wrote them.
AUTOSCALE_WINDOW_RECEIPTS = (
    "SELECT count(*), "
    "count(*) FILTER (WHERE created_at > now() - make_interval(secs => %(half)s)), "
    "count(DISTINCT worker) FILTER (WHERE worker <> %(hostname)s) "
    "FROM cleanup_cleanupreceipt "
    "WHERE created_at > now() - make_interval(secs => %(window)s)"
)
# The last sweep of each shard: one upsert per sweep.
RECORD_SWEEP = (
    "INSERT INTO cleanup_sweeprecord (shard, shards, finished_at, claimed, published, "
    "messages, largest_message, sizing_reason, "
    "set_aside, backpressure, skipped_locked, duration_ms, trace_id) "
    "VALUES (%s, %s, now(), %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
    "ON CONFLICT (shard) DO UPDATE SET shards = EXCLUDED.shards, "
    "finished_at = EXCLUDED.finished_at, claimed = EXCLUDED.claimed, "
    "published = EXCLUDED.published, messages = EXCLUDED.messages, "
    "largest_message = EXCLUDED.largest_message, sizing_reason = EXCLUDED.sizing_reason, "
    "set_aside = EXCLUDED.set_aside, "
    "backpressure = EXCLUDED.backpressure, skipped_locked = EXCLUDED.skipped_locked, "
    "duration_ms = EXCLUDED.duration_ms, trace_id = EXCLUDED.trace_id"
)
# How long ago each shard of N last finished a sweep, and the Cleanup schedule was last saved
# (a shard of a new N has no sweep yet), by the database clock: the gauges' sweep section.
LAST_SWEEP_AGES = (
    "SELECT shard, EXTRACT(EPOCH FROM now() - finished_at)::float8 FROM cleanup_sweeprecord "
    "WHERE shards = %s"
)
SCHEDULE_SAVED_AGE = (
    "SELECT EXTRACT(EPOCH FROM now() - updated_at)::float8 FROM cleanup_cleanupschedule "
    "ORDER BY id LIMIT 1"
)
# Release messages that wrote receipts (a batch message is one task id): since a time (the
# health page's windows), and in the last %s seconds (the adaptive sizing's service rate;
# served by cleanup_receipt_created_idx).
MESSAGES_HANDLED_SINCE = (
    "SELECT count(DISTINCT task_id) FROM cleanup_cleanupreceipt WHERE created_at >= %s"
)
MESSAGES_HANDLED_IN_LAST = (
    "SELECT count(DISTINCT task_id) FROM cleanup_cleanupreceipt "
    "WHERE created_at > now() - make_interval(secs => %s)"
)


# --- The unacked restore's lease (cleanup.worker.redis_transport, cleanup.models.RestoreLease) --
# Taken when nobody holds a live lease (or the taker already holds it): the row comes back.
TAKE_RESTORE_LEASE = """
INSERT INTO cleanup_restorelease (id, holder, until)
VALUES (1, %(holder)s, clock_timestamp() + make_interval(secs => %(seconds)s))
ON CONFLICT (id) DO UPDATE SET holder = EXCLUDED.holder, until = EXCLUDED.until
WHERE cleanup_restorelease.until <= clock_timestamp()
   OR cleanup_restorelease.holder = EXCLUDED.holder
RETURNING holder
"""
END_RESTORE_LEASE = (
    "UPDATE cleanup_restorelease SET until = clock_timestamp() WHERE id = 1 AND holder = %(holder)s"
)


# --- The fleet's backlog reading (cleanup.operations.console.backlog_reading) ------------------

# The reading, with its age by the database's clock (every web process reads the same clock).
BACKLOG_READING = (
    "SELECT shards, count_cap, readings, "
    "EXTRACT(EPOCH FROM clock_timestamp() - read_at)::float8, "
    "EXTRACT(EPOCH FROM read_at)::float8 FROM cleanup_backlogreading WHERE id = 1"
)
# The lease to take the next reading: granted when no lease runs and the reading is older than
# the interval or was taken for another shard count or cap (the row is created on first use).
TAKE_BACKLOG_READING_LEASE = """
INSERT INTO cleanup_backlogreading (id, shards, count_cap, readings, read_at, lease_until)
VALUES (1, %(shards)s, %(cap)s, '[]'::jsonb, NULL,
        clock_timestamp() + make_interval(secs => %(lease)s))
ON CONFLICT (id) DO UPDATE SET lease_until = EXCLUDED.lease_until
WHERE (cleanup_backlogreading.lease_until IS NULL
       OR cleanup_backlogreading.lease_until <= clock_timestamp())
  AND (cleanup_backlogreading.read_at IS NULL
       OR cleanup_backlogreading.read_at
          <= clock_timestamp() - make_interval(secs => %(interval)s)
       OR cleanup_backlogreading.shards <> EXCLUDED.shards
       OR cleanup_backlogreading.count_cap <> EXCLUDED.count_cap)
RETURNING id
"""
# The reading taken, stamped as it is stored (its statements ran milliseconds before).
STORE_BACKLOG_READING = (
    "UPDATE cleanup_backlogreading SET shards = %(shards)s, count_cap = %(cap)s, "
    "readings = %(readings)s::jsonb, read_at = clock_timestamp(), lease_until = NULL "
    "WHERE id = 1 "
    "RETURNING EXTRACT(EPOCH FROM read_at)::float8"
)
END_BACKLOG_READING_LEASE = "UPDATE cleanup_backlogreading SET lease_until = NULL WHERE id = 1"
