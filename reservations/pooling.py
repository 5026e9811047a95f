"""Is a database URL transaction pooled? The start-up probe, and the refusal naming what to set.

The sweep's session locks, the room claims keyed by ``pg_backend_pid()`` and the beat's lease
live in a PostgreSQL session. Behind a transaction pooler (PgBouncer's ``pool_mode =
transaction`` or ``statement``) a client's next transaction may run on another server
connection, and a session lock taken in one is neither held nor released by the next: two
sweeps of one shard, or two leading beats. So the processes that hold session state (worker,
beat, ``manage.py check --database default``) probe the URLs before they start, and refuse a
transaction pooler that ``DATABASE_POOLING`` does not declare, and a ``DATABASE_DIRECT_URL`` that
is not direct.

The probe, with two client connections A and B: A asks for its server process
(``pg_backend_pid()``, autocommit); B opens a transaction and asks too (a pooler hands B a free
server connection, under PgBouncer's last-in-first-out reuse the one A just gave back, and
keeps it B's while the transaction is open); A asks again. A different answer means A's
transactions move between server connections: transaction pooling. The same answer: a session
of its own (direct, or session pooling). With a pool of one server connection A's second
question waits for B's transaction: a wait longer than ``WAIT_S`` is pooling too. A pooler in
statement mode refuses B's transaction, which is pooling as well. Checked against PgBouncer
1.18 (tests/unit/reservations/test_pooling.py, through a private one started by
scripts/pgbouncer.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import psycopg
from django.conf import settings
from django.core.checks import CheckMessage, Error

from . import conf, sql
from .db import psycopg_params

logger = logging.getLogger("reservations.pooling")

SESSION = "session"
TRANSACTION = "transaction"
# How long A's second question may wait for a server connection before it counts as pooled
# (a direct connection answers in milliseconds).
WAIT_S = 2.0
# Seconds to wait for a connection: a database that is down must not hold a start-up for long
# (the probe is then skipped; the process reports the database as it always did).
CONNECT_TIMEOUT_S = 3


def probe(params: Mapping[str, Any], *, wait_s: float = WAIT_S) -> str:
    """``TRANSACTION`` when the server connection behind a client changes between its
    transactions, else ``SESSION``. ``params``: libpq parameters (reservations.db.psycopg_params).
    Raises ``psycopg.OperationalError`` when it cannot connect."""
    conninfo = {"connect_timeout": CONNECT_TIMEOUT_S, **params, "autocommit": True}
    with psycopg.connect(**conninfo) as a, psycopg.connect(**conninfo) as b:
        first = _pid(a)
        b.autocommit = False
        try:
            _pid(b)  # B's transaction is open from here until the rollback below
        except psycopg.Error:
            return TRANSACTION  # statement pooling refuses a transaction of more than one statement
        answer: list[int] = []
        asking = threading.Thread(target=lambda: answer.append(_pid(a)), daemon=True)
        asking.start()
        asking.join(wait_s)
        waited = asking.is_alive()
        b.rollback()  # frees B's server connection, for A if it is waiting on it
        asking.join(wait_s)
        if waited or not answer:
            return TRANSACTION
        return SESSION if answer[0] == first else TRANSACTION


def _pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(sql.BACKEND_PID).fetchone()
    assert row is not None
    return int(row[0])


def _probe_or_none(name: str, db: Mapping[str, Any]) -> str | None:
    try:
        return probe(psycopg_params(db))
    except psycopg.Error as exc:
        logger.warning(
            "connection pooling not probed: cannot reach the database",
            extra={"variable": name, "error": repr(exc)[:300]},
        )
        return None


def refusals(
    pooling: str, default: Mapping[str, Any], direct: Mapping[str, Any] | None
) -> list[str]:
    """Why this process must not start (empty: it may): a transaction pooler behind
    ``DATABASE_URL`` (``default``, a DATABASES entry) with ``DATABASE_POOLING`` (``pooling``)
    none, or behind ``DATABASE_DIRECT_URL`` (``direct``, when given). A database that cannot be
    reached is not probed."""
    problems = []
    if pooling != TRANSACTION and _probe_or_none("DATABASE_URL", default) == TRANSACTION:
        problems.append(
            "DATABASE_URL reaches PostgreSQL through a transaction pooler (its transactions "
            "run on different server connections) but DATABASE_POOLING is none: set "
            "DATABASE_POOLING=transaction and DATABASE_DIRECT_URL to a direct connection "
            'to the same database (docs/TOPOLOGIES.md, "PgBouncer")'
        )
    if direct is not None and _probe_or_none("DATABASE_DIRECT_URL", direct) == TRANSACTION:
        problems.append(
            "DATABASE_DIRECT_URL goes through a transaction pooler: it must be a direct (or "
            "session-pooled) connection, where the advisory locks and the beat's lease can live"
        )
    return problems


def configured_refusals() -> list[str]:
    """``refusals`` for this process's settings."""
    return refusals(
        conf.value("DATABASE_POOLING"), settings.DATABASES["default"], conf.value("DATABASE_DIRECT")
    )


def check(app_configs: Any = None, databases: Any = None, **_: Any) -> list[CheckMessage]:
    """The system check (``Tags.database``: ``manage.py check --database default``, and
    ``migrate``)."""
    if not databases or "default" not in databases:
        return []
    return [Error(problem, id="reservations.E001") for problem in configured_refusals()]
