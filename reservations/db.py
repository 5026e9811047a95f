"""Three things about the PostgreSQL connection: ``'infinity'`` timestamps, prepared statements,
and the connection that holds session state.

Infinity:

A hold claimed more times than allowed is set aside with ``next_attempt_at = 'infinity'`` (never
due again until requeued). psycopg cannot turn ``infinity`` into a ``datetime`` and raises, so
any ORM read of such a row — the admin list, a service's return value — would fail. This loader
maps ``±infinity`` to ``datetime.max/min`` (UTC) and is registered on every new connection,
keeping Django's time-zone handling (it carries the same ``timezone`` attribute Django checks).

Prepared statements: Django composes every query on the client (psycopg's ``ClientCursor``), so
PostgreSQL parses and plans each one anew. The release statement is large (five CTEs) and runs
once per hold: planning it took 0.56 ms of its 1 ms on the server (EXPLAIN ANALYZE, one hold).
``fetch_prepared`` runs such a statement with server-side binding, prepared once per
connection (docs/PERFORMANCE.md). The setting ``DATABASE_PREPARED_STATEMENTS`` is false, and
the statement runs unprepared, only with ``DATABASE_POOLING=transaction``: a transaction pooler
may run it on a server connection that never prepared it (PgBouncer before 1.21).

The session's connection: advisory locks held across transactions and the rest of a session's
state live on ``session_connection()``, which is Django's default connection except behind a
transaction pooler (docs/TOPOLOGIES.md, "PgBouncer").
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from psycopg.adapt import Loader
from psycopg.types.datetime import TimestamptzLoader

from . import conf
from .sql import FORCE_GENERIC_PLANS, LOCAL_STATEMENT_TIMEOUT

INFINITY = datetime.max.replace(tzinfo=UTC)
MINUS_INFINITY = datetime.min.replace(tzinfo=UTC)


# psycopg's own loader for timestamptz text: its C implementation when psycopg-binary (or
# psycopg-c) is installed, else the Python one. The C class cannot be subclassed; a Python
# subclass of the Python class (what this loader was, and what Django's time-zone loader is)
# parses each value in Python: 13 µs per value against 0.3 µs, a twentieth of a batched drain's
# pool time in the sweep's claim of 500 holds (docs/PERFORMANCE.md). So the finite values are
# handed to psycopg's loader, held, not inherited.
_FINITE_LOADER = psycopg.adapters.get_loader(
    psycopg.adapters.types["timestamptz"].oid, psycopg.pq.Format.TEXT
)


class InfinityTimestamptzLoader(Loader):
    timezone = UTC  # what Django compares before re-registering its own loader

    def __init__(self, oid: int, context: Any = None) -> None:
        super().__init__(oid, context)
        self._finite = (_FINITE_LOADER or TimestamptzLoader)(oid, context)

    def load(self, data: Any) -> datetime:
        # A finite time starts with a digit; only 'infinity' and '-infinity' do not.
        if data[:1] in (b"i", b"-"):
            raw = bytes(data)
            if raw == b"infinity":
                return INFINITY
            if raw == b"-infinity":
                return MINUS_INFINITY
        return self._finite.load(data).replace(tzinfo=self.timezone)  # type: ignore[no-any-return]


def _register(sender: Any, connection: Any, **_: Any) -> None:
    if connection.vendor != "postgresql":
        return
    conn = connection.connection
    # settings.TIME_ZONE is UTC with USE_TZ, so Django's own loader is a UTC one too.
    conn.adapters.register_loader("timestamptz", InfinityTimestamptzLoader)
    if conf.prepared_statements():
        # Django turns psycopg's preparing off (None). A threshold no query reaches keeps the
        # automatic preparing off, while ``fetch_prepared`` prepares its statements.
        conn.prepare_threshold = NEVER_AUTOMATICALLY
        # Only ``fetch_prepared``'s statements are prepared on this connection. PostgreSQL
        # would re-plan them on every execution (a custom plan looks cheaper than the generic
        # one, which assumes 10 ids per array); the generic plan is the same index lookups
        # and halves the release statement's time (1.53 → 0.68 ms, docs/PERFORMANCE.md).
        conn.execute(FORCE_GENERIC_PLANS)


def install() -> None:
    connection_created.connect(_register, dispatch_uid="reservations.infinity_loader")


NEVER_AUTOMATICALLY = 2**31 - 1


def rows(query: str, params: Any = None, *, using: str = DEFAULT_DB_ALIAS) -> list[tuple[Any, ...]]:
    """Run ``query`` on Django's connection ``using`` (its transaction, if any); its rows, or
    ``[]`` for a statement that returns none. The one cursor helper of the project's raw SQL
    readers."""
    with connections[using].cursor() as cur:
        cur.execute(query, params)
        return list(cur.fetchall()) if cur.description else []


def scalar(query: str, params: Any = None, *, using: str = DEFAULT_DB_ALIAS) -> Any:
    """The first column of the first row of ``query``, or ``None`` when it returns no row."""
    found = rows(query, params, using=using)
    return found[0][0] if found else None


def session_alias() -> str:
    """The alias of the connection that holds session state: advisory locks held across
    transactions, a session's lock_timeout, ``pg_backend_pid()``. "default", except behind a
    transaction pooler, where the next transaction may run on another server connection: there
    it is ``DATABASE_DIRECT_URL``'s (``DATABASE_SESSION_ALIAS``, config.settings.base)."""
    return str(conf.value("DATABASE_SESSION_ALIAS"))


def session_connection() -> BaseDatabaseWrapper:
    return connections[session_alias()]


def psycopg_params(db: Mapping[str, Any]) -> dict[str, Any]:
    """libpq connection parameters of a Django DATABASES entry, for a psycopg connection of
    its own (the beat's lease, the start-up pooling probe): its name, user, password, host(s),
    port(s), and its OPTIONS (sslmode, target_session_attrs, ...)."""
    params: dict[str, Any] = {"dbname": db["NAME"]}
    for src, dst in (
        ("USER", "user"),
        ("PASSWORD", "password"),
        ("HOST", "host"),
        ("PORT", "port"),
    ):
        if db.get(src):
            params[dst] = db[src]
    for key, value in dict(db.get("OPTIONS") or {}).items():
        params.setdefault(key, value)
    return params


def set_local_statement_timeout(milliseconds: int) -> None:
    """Bound every statement of the current transaction (``SET LOCAL statement_timeout``): the
    scrape-time and request-time readers use it so that a slow read fails, not the page."""
    rows(LOCAL_STATEMENT_TIMEOUT, [str(int(milliseconds))])


def fetch_prepared(sql: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """Run ``sql`` on Django's connection (its transaction, if any) as a prepared statement and
    return its rows. Errors are Django's, as from ``connection.cursor()``. Every placeholder
    must be cast in ``sql`` where its type matters: with server-side binding PostgreSQL infers
    it, once, for every place the placeholder appears."""
    if not conf.prepared_statements():
        with connection.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())
    # What ``connection.cursor()`` does first: health check, connect on first use.
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cur:
        cur.execute(sql, params, prepare=True)
        return list(cur.fetchall())
