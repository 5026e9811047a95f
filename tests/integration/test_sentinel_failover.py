"""The Sentinel failover drill: a drain through real workers and beat on a broker made highly
available with Redis Sentinel, the master SIGKILLed mid-drain.

The test starts its own servers, on free ports and in its temporary directory (never the
machine's shared Redis): Debian's ``redis-server`` as master, one replica, and three sentinels
(``redis-server --sentinel``; Debian ships ``redis-sentinel`` as a link to the same binary).
Workers, beat and this process's own readers are given the ``sentinel://`` URL and the
master's name only, never the master's address. Redis replication is asynchronous, so what the
replica had not received when the master died is lost; the drill measures it (queued messages,
unacknowledged entries, delivery counters) and shows the sweep's lease brings back every hold
whose message was lost. It prints the recovery time (master killed to the first release through
the new master) and the worst lateness; docs/TOPOLOGIES.md records them.

It runs only in its own phase (RESERVATIONS_SENTINEL_DRILL=1: noxfile.py's session
``sentinel``, after the lanes; alone: ``make sentinel-drill``).
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from cleanup.release import delivery_cap
from cleanup.release.schedule import install_schedule
from tests.support.fleet import (
    assert_each_released_once,
    beats,
    claim_counts,
    create_eligible_holds,
    drill_workers,
    free_port,
    log_lines,
    outcome_counts,
    outcomes_logged,
    released_count,
    released_times,
    scalar,
    sql,
    wait_until,
)
from tests.support.missing_tools import skip_for_missing

pytestmark = [
    pytest.mark.workers,
    pytest.mark.slow,
    pytest.mark.drill(
        env="RESERVATIONS_SENTINEL_DRILL",
        reason="the Sentinel failover drill runs in its own phase: make sentinel-drill",
    ),
]

MASTER_NAME = "drill"
HOLDS = 500
LEASE_SECONDS = 5  # config.settings.test's lease: a hold whose message was lost comes back soon
# The sentinels call a master down after 1 s without an answer. In the lagging case the replica
# is paused until a sweep's publish has reached the master (at most REPLICA_BEHIND_S, beat
# sweeps every second): 3 s there, so that the paused replica stays a candidate.
DOWN_AFTER_MS = {False: 1000, True: 3000}
REPLICA_BEHIND_S = 2.0
# A drain the kill falls in the middle of: one message per hold, 20 holds per sweep, so the
# 2 shards' sweeps (beat, every second) release about 40 holds a second for 20 s: the
# workers' tuning settings (Django settings, not variables).
DRAIN = {
    "CLEANUP_RELEASE_MODE": "single",
    "CLEANUP_SWEEP_BATCH_SIZE": 20,
    "CLEANUP_SWEEP_MAX_BATCHES": 1,
}
RATE_LIMITED_CLIENT = 7  # an API client's id, for the rate limiter's key
QUEUE_KEYS = ("cleanup", "cleanup\x06\x163", "cleanup\x06\x166", "cleanup\x06\x169")


def _up(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@dataclass
class Cluster:
    """One master, one replica, three sentinels: processes of the test's own."""

    root: Path
    down_after_ms: int = 1000
    master_port: int = field(default_factory=free_port)
    replica_port: int = field(default_factory=free_port)
    sentinel_ports: list[int] = field(default_factory=lambda: [free_port() for _ in range(3)])
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{p}/0" for p in self.sentinel_ports)

    def _spawn(self, name: str, args: list[str]) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            skip_for_missing(
                "redis-server", "Debian's redis-server runs master, replica, sentinels"
            )
        where = self.root / name
        where.mkdir(parents=True, exist_ok=True)
        self.procs[name] = subprocess.Popen(
            [binary, *args],
            cwd=where,
            stdout=(where / "server.log").open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _server(self, name: str, port: int, *extra: str) -> None:
        self._spawn(
            name,
            ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.root / name),
             "--save", "", "--appendonly", "no", *extra],
        )  # fmt: skip

    def start(self) -> Cluster:
        self._server("master", self.master_port)
        self._server(
            "replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.master_port)
        )
        for i, port in enumerate(self.sentinel_ports):
            where = self.root / f"sentinel{i}"
            where.mkdir(parents=True, exist_ok=True)
            conf = where / "sentinel.conf"  # a sentinel rewrites its own file: one each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {where}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER_NAME} 10000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self._spawn(f"sentinel{i}", [str(conf), "--sentinel"])
        wait_until(
            lambda: (
                self.client(self.replica_port).info("replication").get("master_link_status") == "up"
            ),
            timeout=30,
            what="the replica in sync",
        )
        # Every sentinel knows the replica and the two other sentinels: a failover needs them.
        wait_until(
            lambda: all(
                len(self._ask(p, "SENTINEL", "REPLICAS", MASTER_NAME)) == 1
                and len(self._ask(p, "SENTINEL", "SENTINELS", MASTER_NAME)) == 2
                for p in self.sentinel_ports
            ),
            timeout=30,
            what="the sentinels to know the replica and each other",
        )
        return self

    def _ask(self, port: int, *command: str) -> Any:
        """A raw reply (redis-py's typed sentinel helpers parse some replies into booleans)."""
        return self.client(port).execute_command(*command)

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)

    def master_address(self) -> tuple[str, int] | None:
        for port in self.sentinel_ports:
            try:
                host, master = self._ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
                return (host.decode() if isinstance(host, bytes) else str(host)), int(master)
            except (redis.RedisError, TypeError):
                continue
        return None

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)


@contextmanager
def sentinel_cluster(root: Path, down_after_ms: int) -> Iterator[Cluster]:
    cluster = Cluster(root, down_after_ms)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@dataclass(frozen=True)
class BrokerState:
    """What one Redis server holds of the drill's broker and counter state: the task ids of
    the queued messages, the tags of the unacknowledged ones, the release attempts tallied
    (cleanup.release.delivery_cap) and the redelivery counters, and the replication offset."""

    queued: frozenset[str]
    holds_of: dict[str, frozenset[int]]  # task id -> the holds its release message carries
    unacked: frozenset[str]
    tallied: int
    counters: int
    offset: int

    @classmethod
    def of(cls, client: redis.Redis) -> BrokerState:
        """One round trip, so that the master's state is read as close to its kill as can be."""
        minute = delivery_cap.current_minute()
        tally_keys = [f"{delivery_cap.TALLY_PREFIX}{m}" for m in range(minute - 5, minute + 2)]
        pipe = client.pipeline(transaction=False)
        for key in QUEUE_KEYS:
            pipe.lrange(key, 0, -1)
        pipe.hkeys("unacked")
        pipe.mget(tally_keys)
        pipe.info("replication")
        *lists, tags, tallies, info = pipe.execute()
        # the redelivery counters live in PostgreSQL, not in the broker
        counters = scalar("SELECT count(*) FROM cleanup_deliverycount")
        envelopes = [json.loads(entry) for entries in lists for entry in entries]
        holds_of = {e["headers"]["id"]: _holds_in(e) for e in envelopes}
        return cls(
            frozenset(holds_of),
            holds_of,
            frozenset(t.decode() for t in tags),
            sum(int(v) for v in tallies if v is not None),
            int(counters),
            int(info.get("master_repl_offset", 0)),
        )


def _queued_ids(client: redis.Redis) -> set[str]:
    """The task ids of the messages waiting in the release queue (priority 0, where the
    sweeps publish)."""
    return {json.loads(entry)["headers"]["id"] for entry in client.lrange("cleanup", 0, -1)}


def _holds_in(envelope: dict[str, Any]) -> frozenset[int]:
    """The holds a release message (one hold, or a batch) carries."""
    args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
    message = args[0] if args and isinstance(args[0], dict) else {}
    items = message.get("items", [message])
    return frozenset(int(i["reservation_id"]) for i in items if "reservation_id" in i)


def _plant_broadcast(client: redis.Redis) -> int:
    """One ``PUBLISH`` of ``[]`` on the remote-control channel (it stopped every unscreened
    worker at once); how many subscribers it reached."""
    return int(client.publish("/0.celery.pidbox", b"[]"))


def _plant_entry(client: redis.Redis) -> None:
    """A queue entry that is not JSON: it stopped the unscreened worker that popped it."""
    client.lpush("cleanup", b"not json at all")


@pytest.mark.usefixtures("exclusive_workers", "clean")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("replica_behind", [False, True], ids=["in-sync", "replica-behind"])
def test_a_master_killed_mid_drain_is_followed_without_restarts_and_every_hold_released_once(
    tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch, replica_behind: bool
) -> None:
    # given: a master, a replica and three sentinels of the test's own; two workers and beat
    # (1 s sweeps of 2 shards) told only the sentinels and the master's name; 600 expired holds
    ids = create_eligible_holds(HOLDS, offerings=6)
    started_at = time.time()
    install_schedule(shards=2, every=1)
    with sentinel_cluster(tmp_path / "redis", DOWN_AFTER_MS[replica_behind]) as cluster:
        env = {
            "CELERY_BROKER_URL": cluster.url,
            "CELERY_BROKER_SENTINEL_MASTER": MASTER_NAME,
            "CLEANUP_LEASE_SECONDS": str(LEASE_SECONDS),
        }
        # This process's readers (queue depth and age, unacked count) go through the sentinels
        # too: one client, made before the failover and used after it.
        settings.CELERY_BROKER_URL = cluster.url
        settings.CELERY_BROKER_SENTINEL_MASTER = MASTER_NAME
        from cleanup.broker import readers

        reader = readers.redis_client()
        # So does the API's rate limiter (its Redis is the counter Redis, the broker's): one
        # client's requests counted before the kill and after the promotion.
        from reservations import ratelimit

        settings.RESERVATIONS_API_RATE_LIMIT_REDIS_URL = cluster.url
        monkeypatch.setattr(ratelimit, "_down_until", 0.0)
        counted_before = ratelimit.check(RATE_LIMITED_CLIENT, 1000)
        logs = [tmp_path / f"worker{i}.log" for i in range(2)]
        with drill_workers(tmp_path, "sw", env, django_settings=DRAIN) as workers:
            with beats(tmp_path, 1, env_overrides=env) as (beat,):
                wait_until(
                    lambda: released_count(ids) >= HOLDS // 5,
                    timeout=90,
                    interval=0.1,
                    what="the drain under way",
                )
                assert readers.queue_stats("cleanup").readable  # the reader reaches the master
                old_master = cluster.master_address()
                replica = cluster.client(cluster.replica_port)
                if replica_behind:
                    # Asynchronous replication, made visible on one machine: the replica stops
                    # receiving (its link is closed while it is paused, so nothing waits for it
                    # in a socket buffer) and the master takes writes without it.
                    # The kill comes as soon as a message the replica never saw is queued.
                    cluster.procs["replica"].send_signal(signal.SIGSTOP)
                    master = cluster.client(cluster.master_port)
                    master.client_kill_filter(_type="replica")
                    seen = _queued_ids(master)  # published before the replica was cut off
                    deadline = time.monotonic() + REPLICA_BEHIND_S
                    while time.monotonic() < deadline and not _queued_ids(master) - seen:
                        time.sleep(0.002)
                # when: the master is SIGKILLed mid-drain (its state read just before)
                master = cluster.client(cluster.master_port)
                master.ping()
                at_master = BrokerState.of(master)
                cluster.kill("master")
                killed_at = time.time()
                released_before = released_count(ids)
                if replica_behind:
                    cluster.procs["replica"].send_signal(signal.SIGCONT)
                wait_until(
                    lambda: replica.info("replication").get("master_link_status") == "down",
                    timeout=10,
                    what="the replica to see its master gone",
                )
                at_replica = BrokerState.of(replica)  # what the new master starts from
                promoted = wait_until(
                    lambda: (a := cluster.master_address()) != old_master and a,
                    timeout=60,
                    interval=0.1,
                    what="the sentinels to promote the replica",
                )
                promoted_at = time.time()
                # then: every hold is released, through the new master
                wait_until(
                    lambda: released_count(ids) == HOLDS,
                    timeout=150,
                    interval=0.5,
                    what="every hold released after the failover",
                )
                finished_at = time.time()
                # and the workers' new connections are screened: what stops an unscreened
                # worker is set aside (kombu switches to the next sentinel:// URL on a failed
                # connection attempt; cleanup.worker.redis_transport keeps that screened)
                _plant_entry(replica)
                wait_until(
                    lambda: scalar(
                        "SELECT count(*) FROM cleanup_deadletter WHERE error LIKE %s",
                        ["not a broker envelope: not JSON%"],
                    ),
                    timeout=30,
                    what="the planted queue entry dead-lettered",
                )
                # A subscriber that is reconnecting misses a publish (pub/sub keeps nothing),
                # so the broadcast is sent again until each worker has dropped one.
                wait_until(
                    lambda: (
                        _plant_broadcast(replica) >= 0
                        and all(log_lines([log], "broadcast dropped") for log in logs)
                    ),
                    timeout=30,
                    interval=0.5,
                    what="every worker to drop the planted broadcast",
                )
                # the limiter's client, made before the kill, counts in the new master
                counted_after = wait_until(
                    lambda: ratelimit.check(RATE_LIMITED_CLIENT, 1000),
                    timeout=30,
                    interval=0.5,
                    what="the API rate limiter to count in the new master",
                )
                limiter_key = replica.zcard(f"{ratelimit.KEY_PREFIX}{RATE_LIMITED_CLIENT}")
                beat_alive = beat.alive()
                at_end = BrokerState.of(replica)
            alive = [w.alive() for w in workers]
            # the reader client made before the kill, never rebuilt, now reads the new master
            stats_after = readers.queue_stats("cleanup")
            reader_port = reader.connection_pool.get_master_address()[1]  # type: ignore[attr-defined]
            drops = log_lines(logs, "broadcast dropped")
    attempts = outcomes_logged(logs)

    times = released_times(ids)
    first_after = next((t for t in times if t > promoted_at), None)
    claims = dict(
        sql(
            "SELECT claim_count, count(*) FROM reservations_reservation WHERE id = ANY(%s) "
            "GROUP BY 1 ORDER BY 1",
            [ids],
        )
    )
    # the longest stretch without a release: the failover's cost to every hold due in it
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))
    lost_messages = at_master.queued - at_replica.queued
    lost_holds = sorted({h for m in lost_messages for h in at_master.holds_of[m]})
    lost_claims = claim_counts(lost_holds) if lost_holds else {}
    released_at = dict(
        sql(
            "SELECT id, extract(epoch FROM released_at) FROM reservations_reservation "
            "WHERE id = ANY(%s)",
            [lost_holds],
        )
    )
    lost_late = max((float(t) - killed_at for t in released_at.values()), default=0.0)
    resurrected = at_replica.queued - at_master.queued
    print(  # the measurements, shown with -s (docs/TOPOLOGIES.md records them)
        f"\nsentinel failover ({'replica behind' if replica_behind else 'replica in sync'}):"
        f" {released_before}/{HOLDS} released before the kill; master at the kill: "
        f"{len(at_master.queued)} queued, {len(at_master.unacked)} unacked, "
        f"{at_master.tallied} attempts tallied, offset {at_master.offset}; new master from: "
        f"{len(at_replica.queued)} queued, {len(at_replica.unacked)} unacked, "
        f"{at_replica.tallied} tallied, offset {at_replica.offset}; "
        f"lost: {at_master.offset - at_replica.offset} replication bytes, "
        f"{len(lost_messages)} queued messages ({len(lost_holds)} holds, re-claimed by the lease: "
        f"{sum(1 for c in lost_claims.values() if c >= 2)}, the last released "
        f"+{lost_late:.1f}s after the kill), "
        f"{len(at_master.unacked - at_replica.unacked)} unacked entries, "
        f"{at_master.tallied - at_replica.tallied} tallied attempts; "
        f"back from the dead: {len(resurrected)} messages the old master had delivered, "
        f"{len(at_replica.unacked - at_master.unacked)} unacked entries it had acked; "
        f"promoted {promoted_at - killed_at:.1f}s after the kill; first release through the "
        f"new master +{(first_after or 0) - killed_at:.1f}s; all released "
        f"+{finished_at - killed_at:.1f}s (the drain {max(times) - started_at:.1f}s in all); the "
        f"longest stretch without a release {gap:.1f}s; claims per hold {claims}; "
        f"attempts logged {dict(attempts)} ({sum(attempts.values())}), "
        f"tallied at the end {at_end.tallied}; redelivery counters at the end {at_end.counters};"
        f" outcomes {outcome_counts()}; broadcasts dropped {len(drops)}"
    )
    # every hold released exactly once, seats conserved, none left held
    assert_each_released_once(ids)
    # releases went on through the promoted replica, reached through the sentinels only
    assert promoted[1] == cluster.replica_port
    assert first_after is not None
    if replica_behind:
        # the writes the replica never received are gone (replication is asynchronous),
        # among them release messages; the lease brought their holds back to a later sweep
        assert at_master.offset > at_replica.offset
        assert lost_holds, "no release message was lost: the drill did not test the lease"
        assert any(count >= 2 for count in lost_claims.values()), lost_claims
    # nobody was restarted: the workers and beat started before the kill are still up, their
    # new connections screened (the planted entry is a dead letter; the broadcast was dropped
    # by each worker), and this process's reader client followed the master on its own
    assert all(alive), alive
    assert beat_alive
    assert len(drops) >= len(workers)
    assert reader_port == cluster.replica_port
    assert stats_after.readable
    # the API's rate limiter decided before the kill and after the promotion, through the
    # sentinels, and its count is in the new master (the old one's may not have reached it)
    assert counted_before is not None and counted_before.remaining == 999
    assert counted_after is not None and counted_after.allowed
    assert limiter_key >= 1
