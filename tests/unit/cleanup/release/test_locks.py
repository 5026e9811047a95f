"""Behind a transaction pooler the session state lives on the direct connection
(``DATABASE_DIRECT_URL``'s alias, ``reservations.db.session_connection``): every session lock of
``cleanup.release.locks``, the sweep's wait in line for the publish lock, and beat's lease.

In process and without a pooler: the session alias is made a connection of its own to the
same test database through a second address (a relay, standing in for the direct URL beside
the pooled one), so PostgreSQL's ``pg_locks`` tells which backend holds or waits for a lock,
and beat's lease connection says which address it was opened to. Behind a real PgBouncer a
lock taken on the pooled connection can go unnoticed (a test there only gets slower), so these
tests name the backend or the address instead, in seconds and without a pooler.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.conf import settings as django_settings
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from cleanup import sql
from cleanup.release import locks
from cleanup.release.schedule import BEAT_LOCK_APP_PREFIX, LeaderDatabaseScheduler
from cleanup.release.sweep import SweepResult, sweep_shard
from config.celery_app import app as celery_app
from config.env import SESSION_ALIAS
from reservations.db import psycopg_params, rows, scalar, session_alias
from tests.support.holds import claim_counts, expired_holds

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", SESSION_ALIAS]),
    pytest.mark.usefixtures("broker"),
]

BACKEND_PID = "SELECT pg_backend_pid()"


# --- a second address for the tests' database ------------------------------------------------


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    # One side ended: the other end is told, so the session ends as over a direct connection.
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_RDWR)


class Relay:
    """A TCP port on 127.0.0.1 whose every connection is carried byte for byte to the tests'
    PostgreSQL: the same server and database under another address, as ``DATABASE_DIRECT_URL``
    and a pooled ``DATABASE_URL`` are in production."""

    def __init__(self, upstream: Callable[[], socket.socket]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = "127.0.0.1", int(self._listener.getsockname()[1])
        self._open: list[socket.socket] = []
        self._guard = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed by close()
                return
            try:
                server = self._upstream()
            except OSError:
                client.close()
                continue
            with self._guard:
                self._open += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        # shutdown() wakes the acceptor's accept(); close() alone does not on Linux.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join(10)
        with self._guard:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def _server_of(database: dict[str, Any]) -> Callable[[], socket.socket]:
    """How to reach the server of a DATABASES entry: the host and port libpq takes (of a
    multi-host URL, the one it connects to), over TCP or the socket directory's Unix socket."""
    with psycopg.connect(**psycopg_params(database)) as probe:
        host, hostaddr, port = probe.info.host, probe.info.hostaddr, int(probe.info.port)
    if host.startswith("/"):

        def unix() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(f"{host}/.s.PGSQL.{port}")
            return sock

        return unix
    return lambda: socket.create_connection((hostaddr or host, port), timeout=10)


@pytest.fixture(scope="module", autouse=True)
def direct_alias(django_db_setup: None) -> Iterator[Relay]:
    """The two aliases of ``DATABASE_POOLING=transaction`` (config.env.database_aliases):
    "default" as it is, and ``SESSION_ALIAS`` a copy of it (the same test database, as its
    ``TEST: {"MIRROR": "default"}`` makes it) reached through the relay. Its connections are
    backends of their own, and the relay's port tells its address from the default one's.

    Module-scoped so the alias exists before each test's database setup, which allows a test
    only the aliases it names (the module's ``django_db`` mark) and refuses any other."""
    default = connections.settings["default"]
    relay = Relay(_server_of(default))
    entry = copy.deepcopy(default)
    entry.update(HOST=relay.host, PORT=str(relay.port))
    entry["TEST"] = {**entry.get("TEST", {}), "MIRROR": "default"}
    # Django's connections read this dict; settings.DATABASES is normally the same one (beat's
    # lease reads that).
    databases = [connections.settings]
    if django_settings.DATABASES is not connections.settings:
        databases.append(django_settings.DATABASES)
    for aliases in databases:
        aliases[SESSION_ALIAS] = entry
    try:
        yield relay
    finally:
        for wrapper in connections.all(initialized_only=True):
            if wrapper.alias == SESSION_ALIAS:
                wrapper.close()
                del connections[SESSION_ALIAS]
        for aliases in databases:
            del aliases[SESSION_ALIAS]
        relay.close()


@pytest.fixture(autouse=True)
def session_on_the_direct_alias(settings: Any) -> None:
    """The session's connection is the direct alias's, as behind a transaction pooler."""
    settings.DATABASE_SESSION_ALIAS = SESSION_ALIAS


def _backends(key: tuple[int, int], *, granted: bool = True) -> list[int]:
    """The backends (pids) of this database that hold the session lock ``key``, or with
    ``granted=False`` wait in line for it, as PostgreSQL lists them."""
    found = rows(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted = %s "
        "AND classid = %s AND objid = %s AND objsubid = 2 "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "ORDER BY pid",
        [granted, *key],
    )
    return [pid for (pid,) in found]


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.02)


SESSION = "the session connection"
DEFAULT = "the default (pooled) connection"


# --- the session locks -----------------------------------------------------------------------


def test_every_session_lock_is_taken_and_let_go_on_the_session_connection(
    other_session: BaseDatabaseWrapper,
) -> None:
    # given: the session's connection and the default one, two backends of the same database
    assert session_alias() == SESSION_ALIAS
    names = {scalar(BACKEND_PID, using=SESSION_ALIAS): SESSION, scalar(BACKEND_PID): DEFAULT}
    assert len(names) == 2

    def held_by(key: tuple[int, int]) -> list[str]:
        return [names.get(pid, f"backend {pid}") for pid in _backends(key)]

    def room_claims() -> list[tuple[int, str, int]]:
        found = rows("SELECT lock_key, pid, holds FROM cleanup_roomclaim")
        return [(key, names.get(pid, f"backend {pid}"), holds) for key, pid, holds in found]

    shard = locks.sweep_shard(0, 1)
    # when/then: the shard lock is held by the session's backend
    assert locks.try_lock(shard) is True
    assert held_by(shard) == [SESSION]
    # the line for the publish lock counts the other sessions (here one holding it)
    with other_session.cursor() as cur:
        cur.execute(sql.ADVISORY_LOCK, list(locks.SWEEP_PUBLISH))
    assert locks.sessions_in_line(locks.SWEEP_PUBLISH) == 1
    with other_session.cursor() as cur:
        cur.execute(sql.ADVISORY_UNLOCK, list(locks.SWEEP_PUBLISH))
    # the publish lock, once waited for, is held by the session's backend
    assert locks.wait_for_lock(locks.SWEEP_PUBLISH, 1.0) is True
    assert held_by(locks.SWEEP_PUBLISH) == [SESSION]
    # and its holder is not in line ahead of itself
    assert locks.sessions_in_line(locks.SWEEP_PUBLISH) == 0
    # the room reserved under the shard lock is the session's (keyed by its pid): it counts
    # for the other sweeps and not for its own
    locks.reserve_room(shard, 7)
    assert room_claims() == [(shard[1], SESSION, 7)]
    assert locks.room_reserved_by_others() == 0
    with other_session.cursor() as cur:
        cur.execute(sql.ROOM_RESERVED_BY_OTHERS, [locks.NAMESPACE])
        assert cur.fetchone() == (7,)
    # and is given back by the same session
    locks.clear_room(shard)
    assert room_claims() == [(shard[1], SESSION, 0)]
    # letting go: unlock and unlock_all drop the session's locks
    locks.unlock(locks.SWEEP_PUBLISH)
    assert held_by(locks.SWEEP_PUBLISH) == []
    locks.unlock_all()
    assert held_by(shard) == []
    # and closing the session ends a lock it still held (once its backend has gone)
    assert locks.try_lock(shard) is True
    locks.close_session()
    _wait_until(lambda: held_by(shard) == [], "the closed session's lock to go")


def _sweep_in_a_thread(
    pids: dict[str, int], results: list[SweepResult], errors: list[BaseException]
) -> threading.Thread:
    """A sweep of shard 0 of 1 in a thread of its own (another worker's sweep: its own
    connections, closed when it ends); first the pids of its session's and its default
    connection's backends go to ``pids``."""

    def run() -> None:
        try:
            pids["session"] = scalar(BACKEND_PID, using=session_alias())
            pids["default"] = scalar(BACKEND_PID)
            results.append(sweep_shard(0, 1))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            for wrapper in connections.all(initialized_only=True):
                wrapper.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_sweep_waits_in_line_for_the_publish_lock_on_its_session_connection(
    other_session: BaseDatabaseWrapper, settings: Any
) -> None:
    # given: due holds, and another worker's sweep holding the publish lock for longer than it
    # takes to look (the sweep would wait 30 s in line)
    settings.CLEANUP_SWEEP_LOCK_WAIT = 30.0
    settings.CLEANUP_SWEEP_TIME_BUDGET = 60
    ids = expired_holds(3)
    with other_session.cursor() as cur:
        cur.execute(sql.ADVISORY_LOCK, list(locks.SWEEP_PUBLISH))
    pids: dict[str, int] = {}
    results: list[SweepResult] = []
    errors: list[BaseException] = []
    # when: a sweep runs
    thread = _sweep_in_a_thread(pids, results, errors)
    try:
        deadline = time.monotonic() + 30
        while not (waiting := _backends(locks.SWEEP_PUBLISH, granted=False)):
            assert thread.is_alive(), f"the sweep ended without waiting in line: {errors}"
            assert time.monotonic() < deadline, "the sweep never got in line for the publish lock"
            thread.join(0.02)
        # then: the backend in line is its session's, as is the one holding its shard lock
        names = {pids["session"]: SESSION, pids["default"]: DEFAULT}
        assert [names.get(pid, f"backend {pid}") for pid in waiting] == [SESSION], (
            "the sweep waited in line for the publish lock on another connection than its session's"
        )
        held = _backends(locks.sweep_shard(0, 1))
        assert [names.get(pid, f"backend {pid}") for pid in held] == [SESSION]
    finally:
        with other_session.cursor() as cur:
            cur.execute(sql.ADVISORY_UNLOCK, list(locks.SWEEP_PUBLISH))
        thread.join(60)
    # and once the lock is let go, the sweep takes its turn and does the work
    assert errors == []
    assert [(r.claimed, r.published) for r in results] == [(3, 3)]
    assert claim_counts(ids) == {1}


# --- beat's lease ----------------------------------------------------------------------------


def test_beats_lease_is_held_by_a_session_opened_to_the_direct_address(
    direct_alias: Relay, settings: Any
) -> None:
    # given: a lease key no other beat of this database takes
    settings.CLEANUP_BEAT_LOCK_ID = 900_000 + os.getpid() % 100_000
    key = locks.beat_lock(settings.CLEANUP_BEAT_LOCK_ID)
    scheduler = LeaderDatabaseScheduler(app=celery_app)
    try:
        # when: beat takes its lease
        assert scheduler._hold_lock() is True
        lease = scheduler._lock_conn
        assert lease is not None
        # then: the session holding it was opened to the direct address (the relay's port),
        # not the default one's, and to the tests' database
        opened_to = (lease.info.host, lease.info.port, lease.info.dbname)
        assert opened_to == (
            direct_alias.host,
            direct_alias.port,
            connections.settings["default"]["NAME"],
        ), f"beat's lease connected to {opened_to}, not DATABASE_DIRECT_URL's address"
        # and it is that session PostgreSQL lists as the lease's holder
        assert _backends(key) == [lease.info.backend_pid]
        assert str(
            scalar(
                "SELECT application_name FROM pg_stat_activity WHERE pid = %s",
                [lease.info.backend_pid],
            )
        ).startswith(BEAT_LOCK_APP_PREFIX)
    finally:
        scheduler.close()
