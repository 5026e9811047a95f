"""What "eligible for release" means: held, and past ``expires_at`` by the database clock.

Written by hand in two places only: here in SQL (``eligible_sql``) and in the ORM
(``reservations.models.ELIGIBLE``, behind ``Reservation.objects.eligible()``). The claim, the
reclaim of ``hold_seat``, the release statement, ``availability``, the backlog reads below (the
web process's gauges, the admin health page, the pool autoscaler), the burst drill and the bench
all build on ``eligible_sql``; ``tests/unit/test_eligibility.py`` seeds a table and checks that they
agree. The partial indexes (``status = 'held'``) serve it but do not define it.
"""

from __future__ import annotations

RESERVATION_TABLE = "reservations_reservation"


def eligible_sql(alias: str = "", now: str = "now()", *, off_the_held_index: bool = False) -> str:
    """The SQL condition on a reservation row (``alias.`` before each column when given),
    ``now`` the clock's expression. ``off_the_held_index`` writes the status test as
    ``(status = 'held') IS TRUE``, which the planner cannot match to the partial held-index: the
    release statement uses it to stay on the primary key (reservations/services.py)."""
    column = f"{alias}." if alias else ""
    held = f"{column}status = 'held'"
    if off_the_held_index:
        held = f"({held}) IS TRUE"
    return f"{held} AND {column}expires_at <= {now}"


# Index-ordered, per bucket of the shard (reservations_held_bucket_idx: bucket, expires_at
# WHERE status='held'): one probe per bucket, the minimum of those. Never an aggregate over the
# backlog, and an empty shard beside a large backlog elsewhere stays cheap.
OLDEST_ELIGIBLE_SQL = (
    f"SELECT EXTRACT(EPOCH FROM (now() - min(o.expires_at)))::float8 "
    f"FROM unnest(%s::smallint[]) AS b(bucket) CROSS JOIN LATERAL ("
    f"SELECT expires_at FROM {RESERVATION_TABLE} WHERE bucket = b.bucket AND {eligible_sql()} "
    f"ORDER BY expires_at LIMIT 1) o"
)
# Counts at most cap + 1 rows: the answer is exact below the cap and "capped" above it.
ELIGIBLE_COUNT_SQL = (
    f"SELECT count(*) FROM (SELECT 1 FROM {RESERVATION_TABLE} "
    f"WHERE bucket = ANY(%s::smallint[]) AND {eligible_sql()} "
    f"LIMIT %s) AS capped"
)
