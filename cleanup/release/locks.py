"""Every PostgreSQL advisory lock the cleanup takes, by name.

Advisory locks are keyed by two integers. All of ours share the first (``NAMESPACE``), so
they cannot collide with another application's locks on the same database; the second says
which lock it is. Keys never overlap: the publish lock is 0, the outbox relay 1, the
dead-letter cap 2, the restore of unacknowledged Redis messages 3, shard locks start above
4096, and the beat lock uses ``CLEANUP_BEAT_LOCK_ID`` (727001 by default).
"""

from __future__ import annotations

import contextlib
from typing import Any

from django.db import InterfaceError, OperationalError

from cleanup import sql
from reservations.db import scalar, session_alias, session_connection

LOCK_NOT_AVAILABLE = "55P03"  # SQLSTATE of a lock_timeout

NAMESPACE = 727

# Serializes "check queue depth → claim → publish" across all sweeps (backpressure).
SWEEP_PUBLISH = (NAMESPACE, 0)
# One outbox relay at a time, so events are published in order (transaction-level lock).
OUTBOX_RELAY = (NAMESPACE, 1)
# One summariser of the open dead letters beyond the cap at a time (transaction-level lock).
DEAD_LETTER_CAP = (NAMESPACE, 2)
# (NAMESPACE, 3) was the unacked restore's lock; it is a lease now (cleanup.models.RestoreLease).


def sweep_shard(shard: int, shards: int) -> tuple[int, int]:
    """The per-shard sweep lock: a second sweep of the same shard (for the same shard count)
    is a no-op while the first runs."""
    return (NAMESPACE, shards * 4096 + shard + 1)


def beat_lock(lock_id: int) -> tuple[int, int]:
    """The beat lock (``CLEANUP_BEAT_LOCK_ID``)."""
    return (NAMESPACE, lock_id)


# Taking and dropping them. A session lock lasts until unlocked (or the session ends); a
# transaction lock until the caller's transaction ends. Session locks, the session's
# lock_timeout and the room claims (keyed by pg_backend_pid()) are on the session's connection
# (reservations.db.session_connection: Django's default one, or DATABASE_DIRECT_URL's behind a
# transaction pooler); transaction locks on Django's default one, inside the caller's
# transaction.


def _session_scalar(query: str, params: Any = None) -> Any:
    return scalar(query, params, using=session_alias())


def close_session() -> None:
    """Close the session's connection: a session still alive ends, and every lock with it."""
    session_connection().close()


def try_lock(key: tuple[int, int]) -> bool:
    """Take the session lock ``key`` if nobody holds it; whether it was taken."""
    return bool(_session_scalar(sql.TRY_ADVISORY_LOCK, list(key)))


def wait_for_lock(key: tuple[int, int], wait_s: float) -> bool:
    """Wait in line for the session lock ``key`` for at most ``wait_s`` seconds; whether it
    was taken. PostgreSQL grants a lock to its waiters in the order they asked, and a newcomer
    (even ``try_lock``) does not jump the line. Runs outside a transaction (it sets the
    session's lock_timeout for the wait and resets it after)."""
    with session_connection().cursor() as cur:
        cur.execute(sql.SET_LOCK_TIMEOUT_MS, [str(max(1, int(wait_s * 1000)))])
        try:
            try:
                cur.execute(sql.ADVISORY_LOCK, list(key))
            except OperationalError as exc:
                if getattr(exc.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                    raise
                taken = False
            else:
                taken = True
        except BaseException:
            # Often the session itself ended while it waited (terminated, its server gone):
            # resetting on it would raise "the connection is closed" in place of the error
            # that explains the failure. A session still alive gets its reset.
            with contextlib.suppress(OperationalError, InterfaceError):
                cur.execute(sql.RESET_LOCK_TIMEOUT)
            raise
        cur.execute(sql.RESET_LOCK_TIMEOUT)
        return taken


def sessions_in_line(key: tuple[int, int]) -> int:
    """Other sessions of this database that hold the session lock ``key`` or wait for it."""
    return int(_session_scalar(sql.ADVISORY_LOCK_QUEUE, list(key)))


def unlock(key: tuple[int, int]) -> None:
    _session_scalar(sql.ADVISORY_UNLOCK, list(key))


def unlock_all() -> None:
    """Drop every session lock this connection holds."""
    _session_scalar(sql.ADVISORY_UNLOCK_ALL)


# Room under the release queue's cap (sql.RESERVE_ROOM, cleanup.models.QueueRoom): a sweep that
# lets go of the publish lock before it claims keeps the room it took reserved, keyed by its
# shard lock, until its messages are in the queue. On the session's connection: a claim's
# pg_backend_pid() must be the session that holds the shard lock.


def reserve_room(shard_key: tuple[int, int], holds: int) -> None:
    _session_scalar(sql.RESERVE_ROOM, [shard_key[1], holds])


def clear_room(shard_key: tuple[int, int]) -> None:
    _session_scalar(sql.CLEAR_ROOM, [shard_key[1]])


def room_reserved_by_others() -> int:
    """Holds the other sweeps still running took room for and have not published yet."""
    return int(_session_scalar(sql.ROOM_RESERVED_BY_OTHERS, [NAMESPACE]))


def try_transaction_lock(key: tuple[int, int]) -> bool:
    """Take the transaction lock ``key`` if nobody holds it; whether it was taken."""
    return bool(scalar(sql.TRY_TRANSACTION_ADVISORY_LOCK, list(key)))
