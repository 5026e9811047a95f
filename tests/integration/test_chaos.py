"""Chaos drills with real services: a lost worker node at the *default* recovery settings, a
Redis broker restarted mid-burst (with and without persistence), every worker's PostgreSQL
connection terminated at once. Invariants are asserted from SQL afterwards: every eligible hold
released exactly once, nothing renewed released, seats conserved, nothing stuck.

They take minutes (the node-loss drill waits out the default 75 s visibility timeout), so they
run with ``make chaos`` (RESERVATIONS_CHAOS=1), not in ``make test``. The Redis drills start a
private ``redis-server`` on a port of their own (CHAOS_REDIS_PORT, default 16401) in the test's
temporary directory; the machine's shared servers are never stopped or reconfigured, and only
the test database's own backends are terminated.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cleanup.schedule import install_schedule

from .fleet import (
    Worker,
    beats,
    broker_is_redis,
    create_eligible_holds,
    invariant_violations,
    outcome_counts,
    released_count,
    run_sweeps,
    scalar,
    service_env,
    sql,
    sweep_until,
    wait_until,
)

pytestmark = [
    pytest.mark.workers,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("RESERVATIONS_CHAOS") != "1",
        reason="chaos drills take minutes: run them with `make chaos` (RESERVATIONS_CHAOS=1)",
    ),
]

# The recovery settings at their defaults (an empty value means "the default" to config.env),
# whatever config.settings.test sets for the fast tests.
DEFAULT_RECOVERY = {
    name: ""
    for name in (
        "CLEANUP_VISIBILITY_TIMEOUT",
        "CLEANUP_UNACKED_RESTORE_INTERVAL",
        "CLEANUP_TASK_TIME_LIMIT",
        "CLEANUP_TASK_SOFT_TIME_LIMIT",
        "CLEANUP_RETRY_BACKOFF_MAX",
        "CLEANUP_LEASE_SECONDS",
    )
}


def _conninfo() -> str:
    return service_env()["DATABASE_URL"].replace("postgres://", "postgresql://", 1)


def _blocked_backends() -> list[int]:
    rows = sql(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
    )
    return [r[0] for r in rows]


def _worker(tmp_path: Path, name: str, concurrency: int, **env: str) -> Worker:
    return Worker(
        f"{name}-{uuid.uuid4().hex[:6]}",
        concurrency,
        tmp_path / f"{name}.log",
        env_overrides=env,
    )


@pytest.mark.usefixtures("exclusive_workers", "clean")
@pytest.mark.timeout(400)
def test_a_lost_worker_node_is_recovered_within_90_s_at_default_settings(tmp_path: Path) -> None:
    # given: 400 holds on 4 offerings; worker A (2 processes, default recovery settings) has
    # two releases parked inside their statements (the test holds offering 1's row lock)
    ids = create_eligible_holds(400, offerings=4)
    first_offering = scalar("SELECT min(offering_id) FROM reservations_reservation")
    node_a = _worker(tmp_path, "node-a", 2, **DEFAULT_RECOVERY).start()
    node_b = _worker(tmp_path, "node-b", 2, **DEFAULT_RECOVERY)
    try:
        node_a.wait_ready()
        lock = psycopg.connect(_conninfo())
        try:
            lock.execute(
                "SELECT id FROM reservations_offering WHERE id = %s FOR UPDATE", [first_offering]
            )
            run_sweeps(1)
            backends = wait_until(
                lambda: len(_blocked_backends()) >= 2 and _blocked_backends(),
                timeout=60,
                what="both of node A's processes parked",
            )
            # when: node A is lost (SIGKILL of the main process and its children); the
            # orphaned statements are aborted, so only a redelivery can release those holds
            killed_at = time.monotonic()
            node_a.kill()
            for pid in backends:
                sql("SELECT pg_terminate_backend(%s)", [pid])
        finally:
            lock.rollback()
            lock.close()
        node_b.start().wait_ready()
        # then: node B releases everything, the two in-flight holds after the redelivery
        wait_until(
            lambda: released_count(ids) == len(ids), timeout=300, interval=0.5, what="all released"
        )
        recovery = time.monotonic() - killed_at
    finally:
        node_a.kill()
        node_b.stop(timeout=30)

    print(  # noqa: T201 - the measurement, shown with -s
        f"\nnode loss at default settings ({'Redis' if broker_is_redis() else 'RabbitMQ'}): "
        f"last in-flight hold released {recovery:.1f}s after the SIGKILL"
    )
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts() == {"released": len(ids)}
    if broker_is_redis():
        # default visibility timeout 75 s + restore scan every 5 s
        assert 70 <= recovery <= 90, recovery
    else:
        assert recovery <= 30, recovery  # requeued when the dead connection closes


# --- A private Redis broker, restarted mid-burst ----------------------------------------------


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class PrivateRedis:
    """A redis-server of the test's own, on its own port and directory."""

    def __init__(self, directory: Path, port: int, persistent: bool) -> None:
        self.directory, self.port, self.persistent = directory, port, persistent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
            if self.persistent
            else ["--appendonly", "no", "--save", ""]
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.directory), *persistence],  # fmt: skip
            stdout=(self.directory / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_until(lambda: not _free(self.port), timeout=20, what="private redis up")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)


@contextmanager
def private_redis(tmp_path: Path, persistent: bool) -> Iterator[PrivateRedis]:
    port = int(os.environ.get("CHAOS_REDIS_PORT", "16401"))
    if not _free(port):
        pytest.skip(f"port {port} is in use (set CHAOS_REDIS_PORT to a free one)")
    server = PrivateRedis(tmp_path / "redis", port, persistent).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.mark.usefixtures("exclusive_workers", "clean")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("persistent", [True, False], ids=["aof", "no-persistence"])
def test_a_redis_restart_mid_burst_loses_no_hold_and_releases_none_twice(
    tmp_path: Path, persistent: bool
) -> None:
    # given: beat (1 s sweeps of 2 shards) and two workers on a private Redis; a 3,000-hold
    # burst; a 15 s lease so holds whose messages died with a non-persistent Redis come back
    # quickly (the default 300 s would only make the drill longer)
    ids = create_eligible_holds(3000, offerings=6)
    install_schedule(shards=2, every=1)
    with private_redis(tmp_path, persistent) as server:
        env = {"CELERY_BROKER_URL": server.url, "CLEANUP_LEASE_SECONDS": "15"}
        workers = [_worker(tmp_path, f"rr{i}", 2, **env).start() for i in range(2)]
        try:
            for w in workers:
                w.wait_ready()
            with beats(tmp_path, 1, env_overrides=env):
                wait_until(lambda: released_count(ids) >= 300, timeout=120, what="burst under way")
                # when: Redis dies with messages queued and unacked, and comes back 3 s later
                in_queue = server.client().llen("cleanup")
                unacked = server.client().hlen("unacked")
                released_before = released_count(ids)
                server.kill()
                time.sleep(3)
                server.start()
                restarted_at = time.monotonic()
                # then: everything is released
                wait_until(
                    lambda: released_count(ids) == len(ids),
                    timeout=300,
                    interval=1,
                    what="all released after the restart",
                )
                recovered = time.monotonic() - restarted_at
        finally:
            for w in workers:
                w.stop(timeout=30)
    print(  # noqa: T201
        f"\nredis restart ({'AOF always' if persistent else 'no persistence'}): "
        f"{released_before} released before; {in_queue} queued + {unacked} unacked at the kill; "
        f"the rest released {recovered:.1f}s after the restart; outcomes {outcome_counts()}"
    )
    assert invariant_violations(expected_released=ids) == []
    stuck = scalar(
        "SELECT count(*) FROM reservations_reservation WHERE status = 'held' AND expires_at < now()"
    )
    assert stuck == 0


@pytest.mark.usefixtures("exclusive_workers", "clean")
@pytest.mark.timeout(400)
def test_every_worker_database_connection_terminated_mid_burst_releases_each_hold_once(
    tmp_path: Path,
) -> None:
    # given: two workers of 2 processes draining a 3,000-hold burst
    ids = create_eligible_holds(3000, offerings=6)
    workers = [_worker(tmp_path, f"pt{i}", 2).start() for i in range(2)]
    terminated: list[int] = []
    try:
        for w in workers:
            w.wait_ready()
        run_sweeps(2)
        wait_until(lambda: released_count(ids) >= 300, timeout=120, what="burst under way")
        # when: every other backend of the test database is terminated at once, three times
        for _ in range(3):
            rows = sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            terminated.append(sum(1 for (ok,) in rows if ok))
            time.sleep(1.5)
        # then: the sweeps keep going (as beat would) and every hold is released once
        sweep_until(lambda: released_count(ids) == len(ids), shards=2, timeout=240)
    finally:
        for w in workers:
            w.stop(timeout=30)
    print(  # noqa: T201
        f"\npg_terminate_backend x3 mid-burst: {terminated} backends terminated; "
        f"outcomes {outcome_counts()}; dead letters (reason, task) "
        f"{sql('SELECT reason, task_name, count(*) FROM cleanup_deadletter GROUP BY 1, 2')}"
    )
    assert sum(terminated) > 0
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts().get("released") == len(ids)
