"""Chaos drills with real services: a lost worker node at the *default* recovery settings, a
Redis broker restarted mid-burst (with and without persistence), every worker's PostgreSQL
connection terminated at once. Invariants are asserted from SQL afterwards: every eligible hold
released exactly once, nothing renewed released, seats conserved, nothing stuck.

They take minutes (the node-loss drill waits out the default 75 s visibility timeout), so they
run with RESERVATIONS_CHAOS=1: ``make test-full`` (session ``chaos`` of
``noxfile.py``, which CI runs) and ``make chaos``; a person's ``bash scripts/test.sh``
leaves them out and says so at its end. The Redis
drills start a private ``redis-server`` on a free port the kernel hands out, in the test's
temporary directory; the machine's shared servers are never stopped or
reconfigured, and only the test database's own backends are terminated.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cleanup.broker.readers import queue_depth
from cleanup.conf import CleanupSettings, cleanup_settings
from cleanup.release.schedule import install_schedule
from tests.support.fleet import (
    Worker,
    beats,
    blocked_backends,
    broker_is_redis,
    create_eligible_holds,
    delivery_totals,
    free_port,
    invariant_violations,
    log_fields,
    log_lines,
    offering_locked,
    outcome_counts,
    released_count,
    run_sweeps,
    scalar,
    service_env,
    sql,
    sweep_until,
    wait_until,
)
from tests.support.missing_tools import skip_for_missing

pytestmark = [
    pytest.mark.workers,
    pytest.mark.slow,
    pytest.mark.drill(
        env="RESERVATIONS_CHAOS",
        reason="chaos drills take minutes: CI and make test-full run them; alone: make chaos",
    ),
]

# The recovery settings at their defaults (an empty value means "the default" to config.env),
# whatever config.settings.test sets for the fast tests.
DEFAULT_RECOVERY = {
    name: ""
    for name in (
        "CLEANUP_VISIBILITY_TIMEOUT",
        "CLEANUP_TASK_TIME_LIMIT",
        "CLEANUP_TASK_SOFT_TIME_LIMIT",
        "CLEANUP_RETRY_BACKOFF_MAX",
        "CLEANUP_LEASE_SECONDS",
    )
}
# ... and the tuning one (a Django setting, not a variable) at the product's default.
DEFAULT_RESTORE = {
    "CLEANUP_UNACKED_RESTORE_INTERVAL": CleanupSettings().unacked_restore_interval,
}


def _worker(
    tmp_path: Path,
    name: str,
    concurrency: int,
    tuned: Mapping[str, object] | None = None,
    /,
    **env: str,
) -> Worker:
    return Worker(
        f"{name}-{uuid.uuid4().hex[:6]}",
        concurrency,
        tmp_path / f"{name}.log",
        env_overrides=env,
        django_settings=tuned,
    )


@pytest.mark.usefixtures("exclusive_workers", "clean")
@pytest.mark.timeout(400)
def test_a_lost_worker_node_is_recovered_by_redelivery_at_default_settings(tmp_path: Path) -> None:
    # given: 400 holds on 4 offerings; worker A (2 processes, default recovery settings) has
    # two releases parked inside their statements (the test holds offering 1's row lock)
    ids = create_eligible_holds(400, offerings=4)
    first_offering = scalar("SELECT min(offering_id) FROM reservations_reservation")
    queue = cleanup_settings().release_queue
    node_a = _worker(tmp_path, "node-a", 2, DEFAULT_RESTORE, **DEFAULT_RECOVERY).start()
    node_b = _worker(tmp_path, "node-b", 2, DEFAULT_RESTORE, **DEFAULT_RECOVERY)
    try:
        node_a.wait_ready()
        with offering_locked(first_offering):
            run_sweeps(1)
            backends = wait_until(
                lambda: len(blocked_backends()) >= 2 and blocked_backends(),
                timeout=60,
                what="both of node A's processes parked",
            )
            # node A's processes are both parked: it acks nothing until it is killed
            queued_before = queue_depth(queue)
            # when: node A is lost (SIGKILL of the main process and its children); the
            # orphaned statements are aborted, so only a redelivery can release those holds
            killed_at = time.monotonic()
            node_a.kill()
            for pid in backends:
                sql("SELECT pg_terminate_backend(%s)", [pid])
        # then, before any other worker runs: the messages node A had taken are not lost. On
        # Redis they wait in kombu's unacked hash (only a worker's visibility-timeout scan
        # brings them back); RabbitMQ puts them back in the queue when the dead connection
        # closes
        if broker_is_redis():
            in_flight = _unacked_delivery_keys()
            assert len(in_flight) >= 2, in_flight  # at least the two parked releases
        else:
            wait_until(
                lambda: queue_depth(queue) >= queued_before + 2,
                timeout=60,
                what="RabbitMQ to requeue node A's deliveries",
            )
        node_b.start().wait_ready()
        # then: node B releases everything, the two in-flight holds after the redelivery
        wait_until(
            lambda: released_count(ids) == len(ids), timeout=300, interval=0.5, what="all released"
        )
        recovery = time.monotonic() - killed_at
    finally:
        node_a.kill()
        node_b.stop(timeout=30)

    print(  # the measurement, shown with -s
        f"\nnode loss at default settings ({'Redis' if broker_is_redis() else 'RabbitMQ'}): "
        f"last in-flight hold released {recovery:.1f}s after the SIGKILL"
    )
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts() == {"released": len(ids)}
    if broker_is_redis():
        # node A's messages came back through node B's visibility-timeout scan, which counts
        # each message it restores as a redelivery (how long after the SIGKILL is printed
        # above, not asserted: docs/TESTING.md)
        assert all(n >= 1 for n in delivery_totals(in_flight)), in_flight


def _unacked_delivery_keys() -> list[str]:
    """The delivery-counter key of every message in kombu's unacked hash (Redis): the messages
    delivered to a worker and not acknowledged."""
    from cleanup.broker.readers import redis_client
    from cleanup.broker.screening import parse_unacked
    from cleanup.release.delivery_cap import envelope_key

    found = []
    for raw in redis_client().hvals("unacked"):
        entry, problem = parse_unacked(raw)
        assert entry is not None, problem
        key = envelope_key(entry[0])
        assert key is not None, entry
        found.append(key)
    return found


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
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                *persistence,
            ],  # fmt: skip
            stdout=(self.directory / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.wait_up()
        return self

    def wait_up(self) -> None:
        """Until this server listens; its own exit (a port taken meanwhile) fails at once."""
        proc, log = self.proc, self.directory / "redis.log"

        def listening() -> bool:
            assert proc is not None and proc.poll() is None, log.read_text()[-2000:]
            return not _free(self.port)

        wait_until(listening, timeout=20, what="private redis up")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)


@contextmanager
def private_redis(tmp_path: Path, persistent: bool) -> Iterator[PrivateRedis]:
    # A port the kernel just handed out: the drill restarts its server on the same one.
    server = PrivateRedis(tmp_path / "redis", free_port(), persistent).start()
    try:
        yield server
    finally:
        server.kill()


def _stuck_report(ids: list[int]) -> str:
    """What the holds still held look like (for a failing drill's message)."""
    held = sql(
        "SELECT id, version, claim_count, next_attempt_at, expires_at FROM "
        "reservations_reservation WHERE id = ANY(%s) AND status = 'held' ORDER BY id LIMIT 10",
        [ids],
    )
    count = scalar(
        "SELECT count(*) FROM reservations_reservation WHERE id = ANY(%s) AND status = 'held'",
        [ids],
    )
    letters = sql("SELECT reason, error, count(*) FROM cleanup_deadletter GROUP BY 1, 2 LIMIT 10")
    receipts = sql(
        "SELECT outcome, count(*) FROM cleanup_cleanupreceipt WHERE reservation_id = ANY(%s) "
        "GROUP BY 1",
        [ids],
    )
    return f"{count} still held, e.g. {held}; dead letters {letters}; receipts {receipts}"


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
                # then: everything is released. A worker whose main process died on the lost
                # connection is restarted, as compose's `restart: unless-stopped` or Kubernetes
                # would (kombu 5.7.0 can raise AttributeError from restore_unacked while closing
                # the dead connection: "Unrecoverable error", the worker exits).
                restarts: list[str] = []

                def supervised_done() -> bool:
                    for w in workers:
                        if not w.alive():
                            restarts.append(w.name)
                            w.start()
                    return released_count(ids) == len(ids)

                try:
                    wait_until(
                        supervised_done,
                        timeout=300,
                        interval=1,
                        what="all released after the restart",
                    )
                except TimeoutError as exc:
                    raise AssertionError(f"{exc}\n{_stuck_report(ids)}") from None
                recovered = time.monotonic() - restarted_at
        finally:
            for w in workers:
                w.stop(timeout=30)
    print(
        f"\nredis restart ({'AOF always' if persistent else 'no persistence'}): "
        f"{released_before} released before; {in_queue} queued + {unacked} unacked at the kill; "
        f"the rest released {recovered:.1f}s after the restart; outcomes {outcome_counts()}; "
        f"workers restarted after exiting: {len(restarts)}"
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
    print(
        f"\npg_terminate_backend x3 mid-burst: {terminated} backends terminated; "
        f"outcomes {outcome_counts()}; dead letters (reason, task) "
        f"{sql('SELECT reason, task_name, count(*) FROM cleanup_deadletter GROUP BY 1, 2')}"
    )
    assert sum(terminated) > 0
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts().get("released") == len(ids)


# --- A partitioned worker node (network namespace) --------------------------------------------
#
# One worker runs in a network namespace of the test's own, joined to the host by a veth pair
# with link-local addresses the test assigns (169.254.211.1 host side, .2 in the namespace; the
# loopback range cannot be used: the host routes all of 127/8 to its own lo). It reaches a private
# redis-server bound to the host side address and PostgreSQL through a TCP relay the test runs
# there. A partition is an iptables DROP rule *inside the namespace* (packets vanish, as on a
# real network; the host's own firewall is never touched); healing deletes it.

NS_HOST_IP, NS_IP = "169.254.211.1", "169.254.211.2"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


class Netns:
    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.name, self.host_if, self.ns_if = f"chaos{tag}", f"chh{tag}", f"chn{tag}"

    def create(self) -> Netns:
        if os.geteuid() != 0:
            skip_for_missing("root", "network namespaces and iptables rules need root")
        for tool, package in (("ip", "iproute2"), ("iptables", "iptables")):
            if not shutil.which(tool):
                skip_for_missing(package, f"{tool} is not on PATH (Debian package {package})")
        added = _run("ip", "netns", "add", self.name)
        if added.returncode != 0:
            skip_for_missing("network namespaces", f"ip netns add failed: {added.stderr}")
        steps = [
            ("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if),
            ("ip", "link", "set", self.ns_if, "netns", self.name),
            ("ip", "addr", "add", f"{NS_HOST_IP}/30", "dev", self.host_if),
            ("ip", "link", "set", self.host_if, "up"),
            *[
                ("ip", "netns", "exec", self.name, *c)
                for c in (
                    ("ip", "addr", "add", f"{NS_IP}/30", "dev", self.ns_if),
                    ("ip", "link", "set", self.ns_if, "up"),
                    ("ip", "link", "set", "lo", "up"),
                )
            ],
        ]
        for step in steps:
            done = _run(*step)
            if done.returncode != 0:
                self.delete()
                skip_for_missing(
                    "network namespaces", f"set-up failed: {' '.join(step)}: {done.stderr}"
                )
        return self

    def _rule(self, op: str, port: int) -> None:
        # both directions: nothing from the namespace to the port, nothing back from it
        for chain, peer, side in (("OUTPUT", "-d", "--dport"), ("INPUT", "-s", "--sport")):
            done = _run(
                "ip", "netns", "exec", self.name, "iptables", op, chain, "-p", "tcp",
                peer, NS_HOST_IP, side, str(port), "-j", "DROP",
            )  # fmt: skip
            assert done.returncode == 0, done.stderr

    def cut(self, port: int) -> None:
        self._rule("-A", port)

    def heal(self, port: int) -> None:
        self._rule("-D", port)

    def delete(self) -> None:
        _run("ip", "netns", "delete", self.name)  # removes the veth pair with it
        _run("ip", "link", "delete", self.host_if)


class Relay:
    """A TCP relay (listen address → target), threads per connection; the test's own."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        import threading

        self.listen, self.target = listen, target
        self.server = socket.create_server(listen, reuse_port=False)
        self.port = int(self.server.getsockname()[1])
        self.server.settimeout(0.5)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        import threading

        while not self._stop.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
            client.settimeout(None)
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        self.server.close()
        for s in self._sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


class NetnsWorker(Worker):
    """A product worker started with ``ip netns exec <ns>``."""

    def __init__(self, netns: Netns, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.netns = netns

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns.name, *super().command()]


@contextmanager
def partition_rig(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Namespace, private Redis (host address + loopback), PostgreSQL relay, and the two
    environments: the partitioned node's and the host node's."""
    redis_port = free_port()
    netns = Netns().create()
    server: PrivateRedis | None = None
    relay: Relay | None = None
    try:
        server = PrivateRedis(tmp_path / "redis", redis_port, persistent=False)
        binary = shutil.which("redis-server")
        assert binary
        server.directory.mkdir(parents=True, exist_ok=True)
        server.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(redis_port),
                "--bind",
                "127.0.0.1",
                NS_HOST_IP,
                "--dir",
                str(server.directory),
                "--appendonly",
                "no",
                "--save",
                "",
                "--protected-mode",
                "no",
            ],  # fmt: skip
            stdout=(server.directory / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        server.wait_up()
        db = settings_db()
        # port 0: the relay listens on a port the kernel gives it on the namespace's link, so
        # it never collides with a socket an earlier drill left behind
        relay = Relay((NS_HOST_IP, 0), (db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)))
        pg_port = relay.port
        host_env = {"CELERY_BROKER_URL": f"redis://127.0.0.1:{redis_port}/0"}
        ns_db_url = service_env()["DATABASE_URL"].replace(
            f"@{db['HOST']}:{db['PORT']}/", f"@{NS_HOST_IP}:{pg_port}/"
        )
        ns_env = {
            "CELERY_BROKER_URL": f"redis://{NS_HOST_IP}:{redis_port}/0",
            "DATABASE_URL": ns_db_url,
        }
        yield {
            "netns": netns, "redis": server, "redis_port": redis_port, "pg_port": pg_port,
            "host_env": host_env, "ns_env": ns_env,
        }  # fmt: skip
    finally:
        if relay is not None:
            relay.close()
        if server is not None:
            server.kill()
        netns.delete()


def settings_db() -> dict[str, Any]:
    from django.conf import settings

    db = dict(settings.DATABASES["default"])
    if str(db.get("HOST") or "").startswith("/") or not db.get("HOST"):
        skip_for_missing("PostgreSQL over TCP", "the partition drill relays it into its namespace")
    db["PORT"] = db.get("PORT") or 5432
    return db


def _receipts_by(worker_name: str, ids: list[int]) -> int:
    return int(
        scalar(
            "SELECT count(*) FROM cleanup_cleanupreceipt WHERE worker LIKE %s "
            "AND reservation_id = ANY(%s)",
            [f"{worker_name}@%", ids],
        )
    )


def _more_work_taken_by(worker_name: str, ids: list[int]) -> int:
    """Add 100 fresh eligible holds to ``ids``; how many of ``ids`` the worker released."""
    ids.extend(create_eligible_holds(100, offerings=1, expired_seconds_ago=1))
    return _receipts_by(worker_name, ids)


@dataclass
class Parked:
    ids: list[int]  # the 400 eligible holds
    first: list[int]  # those of the first offering, whose row lock the test holds
    backends: list[int]  # P's two releases parked on that lock
    node_p: NetnsWorker
    node_h: Worker  # not started yet
    lock: psycopg.Connection[Any]  # roll back to let go of the row lock

    def h_starts_and_the_lock_goes(self, *, all_released_within: float) -> None:
        """H starts, the test lets go of the row lock, and then all 400 holds are released."""
        self.node_h.start().wait_ready()
        self.lock.rollback()
        wait_until(
            lambda: released_count(self.ids) == len(self.ids),
            timeout=all_released_within, interval=1, what="all released",
        )  # fmt: skip


@contextmanager
def p_parked(
    tmp_path: Path, rig: dict[str, Any], tuned: Mapping[str, object] | None = None, /, **env: str
) -> Iterator[Parked]:
    """Given: 400 eligible holds on 4 offerings, sweeps of 2 shards every second sent by a beat
    on the host, the partitioned-to-be node P alone with two of its releases parked
    mid-statement on the first offering's row lock, and the host's node H ready to start.
    ``env`` and the Django settings ``tuned`` go to both nodes. At the end the beat stops,
    the lock goes, P is killed and H stopped."""
    ids = create_eligible_holds(400, offerings=4)
    first_offering = scalar("SELECT min(offering_id) FROM reservations_reservation")
    first = [
        r[0]
        for r in sql(
            "SELECT id FROM reservations_reservation WHERE offering_id = %s", [first_offering]
        )
    ]
    install_schedule(shards=2, every=1)
    node_p = NetnsWorker(rig["netns"], f"np-{uuid.uuid4().hex[:6]}", 2, tmp_path / "node-p.log",
                         env_overrides={**rig["ns_env"], **env},
                         django_settings=tuned)  # fmt: skip
    node_h = _worker(tmp_path, "node-h", 2, tuned, **rig["host_env"], **env)
    try:
        node_p.start().wait_ready()
        with (
            offering_locked(first_offering) as lock,
            beats(tmp_path, 1, env_overrides=rig["host_env"]),
        ):
            backends = wait_until(
                lambda: len(blocked_backends()) >= 2 and blocked_backends(),
                timeout=60,
                what="P's releases parked",
            )
            yield Parked(ids, first, backends, node_p, node_h, lock)
    finally:
        node_p.kill()
        node_h.stop(timeout=30)


def p_rejoins(node_p: NetnsWorker, fresh: list[int]) -> int:
    """After P's link healed: wait until P releases some of ``fresh`` (100 more eligible holds
    are added to it at each look), then until all of them are released. Returns how many of
    them P released."""
    rejoined = wait_until(
        lambda: _more_work_taken_by(node_p.name, fresh),
        timeout=150, interval=5, what="P releases new work after healing",
    )  # fmt: skip
    wait_until(lambda: released_count(fresh) == len(fresh), timeout=120)
    return int(rejoined)


def every_hold_released_once() -> bool:
    every = scalar("SELECT array_agg(id) FROM reservations_reservation")
    return invariant_violations(expected_released=list(every)) == []


@pytest.mark.usefixtures("exclusive_workers", "clean")
@pytest.mark.timeout(400)
def test_a_node_that_loses_the_broker_but_not_the_database_has_its_messages_redelivered(
    tmp_path: Path,
) -> None:
    # a long lease: H sees the parked holds again only through redelivery, never a re-claim.
    # One hold per message: the drill tells P's redelivered messages by H's per-hold log lines
    # (reservation_id, outcome=already_handled); in the default adaptive mode P, parked on a
    # lock, measures a slow service rate, so the sweeps send it multi-hold messages, whose log
    # line has the outcomes' counts, not the ids (the lost-node drill runs at the defaults,
    # multi-hold messages included).
    single = {"CLEANUP_RELEASE_MODE": "single"}
    with (
        partition_rig(tmp_path) as rig,
        p_parked(tmp_path, rig, single, CLEANUP_LEASE_SECONDS="120") as given,
    ):
        # when: P loses the broker (still reaches PostgreSQL); H starts; the lock goes
        rig["netns"].cut(rig["redis_port"])
        # then: everything is released — P's parked statements commit through its database
        # link, H gets P's unacked messages back after the visibility timeout
        given.h_starts_and_the_lock_goes(all_released_within=180)
        first = set(given.first)

        def redelivered_to_h() -> list[str]:
            return [
                line
                for line in log_lines([given.node_h.log_path], "outcome=already_handled")
                if int(log_fields(line).get("reservation_id", "0")) in first
            ]

        redelivered = wait_until(redelivered_to_h, timeout=90, what="P's messages redelivered to H")
        # and when the link heals, P rejoins and takes new work
        rig["netns"].heal(rig["redis_port"])
        fresh = create_eligible_holds(300, offerings=2, expired_seconds_ago=1)
        rejoined = p_rejoins(given.node_p, fresh)
    print(
        f"\npartition (broker lost, database kept): {len(redelivered)} of P's messages "
        f"redelivered to H and found already handled; P released "
        f"{_receipts_by(given.node_p.name, given.ids)} of the first 400; after healing P "
        f"released {rejoined} of the fresh holds; outcomes {outcome_counts()}"
    )
    assert every_hold_released_once()
    assert redelivered and rejoined


@pytest.mark.usefixtures("exclusive_workers", "clean")
@pytest.mark.timeout(400)
def test_a_node_that_loses_the_database_but_not_the_broker_strands_no_hold(
    tmp_path: Path,
) -> None:
    with partition_rig(tmp_path) as rig, p_parked(tmp_path, rig) as given:
        # when: P loses PostgreSQL (still reaches the broker); its parked statements are
        # aborted server-side; H starts; the lock goes
        rig["netns"].cut(rig["pg_port"])
        cut_at = time.monotonic()
        for pid in given.backends:
            sql("SELECT pg_terminate_backend(%s)", [pid])
        # then: every hold is released, the parked ones by H (P's tasks hit their time limit;
        # the holds come back through a retry or the claim lease)
        given.h_starts_and_the_lock_goes(all_released_within=240)
        all_released = time.monotonic() - cut_at
        by_p_during_cut = _receipts_by(given.node_p.name, given.first)
        # and when the link heals, P rejoins
        rig["netns"].heal(rig["pg_port"])
        rejoined = p_rejoins(given.node_p, [])
    letters = sql("SELECT reason, count(*) FROM cleanup_deadletter GROUP BY reason")
    retried = log_lines([given.node_p.log_path], "Retry in")
    print(
        f"\npartition (database lost, broker kept): all 400 released {all_released:.1f}s after "
        f"the cut; P released {by_p_during_cut} of the parked offering's holds; dead letters "
        f"{letters}; P retry lines {len(retried)}; after healing P released {rejoined} fresh "
        f"holds; outcomes {outcome_counts()}"
    )
    assert every_hold_released_once()
    assert by_p_during_cut == 0 and rejoined
