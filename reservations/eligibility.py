"""The backlog of holds eligible for release (held, and expired), read per bucket in SQL.

The web process's gauges, the admin health page and the pool autoscaler read the backlog with
these two statements; the parameter of both is the list of buckets of a shard.
"""

from __future__ import annotations

RESERVATION_TABLE = "reservations_reservation"

# Index-ordered, per bucket of the shard (reservations_held_bucket_idx: bucket, expires_at
# WHERE status='held'): one probe per bucket, the minimum of those. Never an aggregate over the
# backlog, and an empty shard beside a large backlog elsewhere stays cheap.
OLDEST_ELIGIBLE_SQL = (
    f"SELECT EXTRACT(EPOCH FROM (now() - min(o.expires_at)))::float8 "
    f"FROM unnest(%s::smallint[]) AS b(bucket) CROSS JOIN LATERAL ("
    f"SELECT expires_at FROM {RESERVATION_TABLE} WHERE status = 'held' AND bucket = b.bucket "
    f"AND expires_at <= now() ORDER BY expires_at LIMIT 1) o"
)
# Counts at most cap + 1 rows: the answer is exact below the cap and "capped" above it.
ELIGIBLE_COUNT_SQL = (
    f"SELECT count(*) FROM (SELECT 1 FROM {RESERVATION_TABLE} "
    f"WHERE status = 'held' AND bucket = ANY(%s::smallint[]) AND expires_at <= now() "
    f"LIMIT %s) AS capped"
)
