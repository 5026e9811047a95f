"""The eligible backlog per shard, read once per interval for the whole fleet.

Every scrape of every web process exports the oldest eligible hold, the eligible count and
whether it hit the cap, per shard. Reading them costs two index probes per shard, and a count of
up to ``CLEANUP_ELIGIBLE_COUNT_CAP`` rows each: paid by every scrape, it grows with the replicas
and the scrape rate. Instead the fleet keeps one reading in PostgreSQL (``BacklogReading``, one
row). A scrape exports it while it is younger than ``CLEANUP_ELIGIBLE_READING_SECONDS``; the first
scrape after that takes a lease on the row (one statement, so one scrape of the fleet wins), reads
the backlog and stores it; a scrape that finds the lease taken exports the reading it has, older.
The reading's age is exported beside it, so a reading nobody renews (every scrape failing, the
lease holder killed) shows as a growing age, not as a steady, stale SLO.

A lease ends when its reading is stored or fails; one whose holder died ends after the time its
statements could take at most. With the interval at 0 every scrape reads for itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from django.db import transaction

from cleanup import sql
from cleanup.operations.samples import read_shards
from reservations.db import rows, set_local_statement_timeout

# A lease outlives the slowest reading: two statements per shard, each bounded by the
# metrics statement timeout, plus the store.
STATEMENTS_PER_SHARD = 2


@dataclass(frozen=True)
class BacklogReading:
    """(oldest eligible age in seconds, eligible up to the cap, capped) per shard, the
    reading's age in seconds (0 when this scrape took it) and, for a reading the fleet shares,
    when it was taken (epoch seconds by the database's clock: the same for every scrape that
    exports it)."""

    shards: list[tuple[float, int, bool]]
    age_seconds: float
    taken_at: float | None = None


def current(shards: int, cap: int, interval: float, timeout_ms: int) -> BacklogReading:
    """The fleet's reading for ``shards`` shards counted up to ``cap``: the stored one while it is
    younger than ``interval`` seconds, else a new one if this scrape wins the lease, else the
    stored one if it was taken for the same shards and cap, else one read for this scrape alone
    (the first scrapes after a start or a change of the schedule)."""
    if interval <= 0:
        return BacklogReading(_read(shards, cap, timeout_ms), 0.0)
    stored = _stored(shards, cap)
    if stored is not None and stored.age_seconds < interval:
        return stored
    lease = STATEMENTS_PER_SHARD * shards * timeout_ms / 1000 + 1
    won = rows(
        sql.TAKE_BACKLOG_READING_LEASE,
        {"shards": shards, "cap": cap, "lease": lease, "interval": interval},
    )
    if not won:
        return stored if stored is not None else BacklogReading(_read(shards, cap, timeout_ms), 0.0)
    try:
        with transaction.atomic():
            readings = _read(shards, cap, timeout_ms)
            ((taken_at,),) = rows(
                sql.STORE_BACKLOG_READING,
                {"shards": shards, "cap": cap, "readings": json.dumps(readings)},
            )
    except Exception:
        rows(sql.END_BACKLOG_READING_LEASE)
        raise
    return BacklogReading(readings, 0.0, float(taken_at))


def _read(shards: int, cap: int, timeout_ms: int) -> list[tuple[float, int, bool]]:
    with transaction.atomic():
        set_local_statement_timeout(timeout_ms)
        return read_shards(shards, cap)


def _stored(shards: int, cap: int) -> BacklogReading | None:
    found = rows(sql.BACKLOG_READING)
    if not found:
        return None
    stored_shards, stored_cap, readings, age, taken_at = found[0]
    if stored_shards != shards or stored_cap != cap or age is None:
        return None
    if isinstance(readings, str):  # Django has psycopg hand jsonb over as text
        readings = json.loads(readings)
    return BacklogReading(
        [(float(a), int(n), bool(c)) for a, n, c in readings], float(age), float(taken_at)
    )
