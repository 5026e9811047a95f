"""The RabbitMQ cluster drill: a drain through real workers and beat on a three-node RabbitMQ
cluster, the node that leads the release queue SIGKILLed mid-drain; once with quorum queues
(``CLEANUP_RABBITMQ_QUEUE_TYPE=quorum``), once with classic queues, side by side.

The test starts its own nodes (Debian's ``rabbitmq-server``, run from /usr/lib/rabbitmq/bin as
the user running the test, with the user's Erlang cookie), each with its own node name
(``drillN-<random>@localhost``), AMQP and distribution ports, and data, log and configuration
files in the test's temporary directory, no plugins; they are joined with ``rabbitmqctl -n ...
stop_app / join_cluster / start_app``. The machine's own RabbitMQ (on 5672) is never touched.
Workers and beat get the three nodes' URLs in one ``CELERY_BROKER_URL`` (``amqp://…;amqp://…``,
kombu's failover) and are never restarted.

- Quorum queues: every queue has a replica on each node; the release queue's leader is killed
  and the two others elect a new one. Nothing the queue held is lost: the unacknowledged
  messages come back (redeliveries, counted by the broker), the workers carry on through the
  next node. A sweep's batch is confirmed by the queue (publisher confirms) before its claim
  commits, so a batch being sent through the killed node fails whole, its claim rolls back and
  the next sweep sends it again: no hold waits for its lease.
- Classic queues: a queue lives on the node it was declared on; killing that node stops
  everything that goes through the queue until the node is back (restarted at once here, as a
  supervisor would), and the messages it had not written to disk are lost with it: their holds
  come back only through the claim's lease.

It prints the recovery time (kill to the first release after it), redeliveries, the holds
released late, and what the classic queues lost; docs/TOPOLOGIES.md records them. It runs only
in its own phase (RESERVATIONS_RABBITMQ_CLUSTER_DRILL=1: noxfile.py's session
``rabbitmq-cluster``, after ``sentinel``).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Producer, Queue

from cleanup.broker.confirms import confirmed_producer
from cleanup.release.schedule import install_schedule
from tests.support.fleet import (
    ROOT,
    Worker,
    assert_each_released_once,
    beats,
    claim_counts,
    create_eligible_holds,
    log_fields,
    log_lines,
    outcomes_logged,
    released_count,
    released_times,
    service_env,
    sql,
    wait_until,
)
from tests.support.missing_tools import skip_for_missing
from tools.rabbitmq_cluster import Cluster, MissingTool, Node

pytestmark = [
    pytest.mark.workers,
    pytest.mark.slow,
    pytest.mark.drill(
        env="RESERVATIONS_RABBITMQ_CLUSTER_DRILL",
        reason="the RabbitMQ cluster drill runs in its own phase: make rabbitmq-cluster-drill",
    ),
]

HOLDS = 600
LEASE_SECONDS = 5  # a hold whose message was lost comes back after this
# One message per hold, up to 300 holds per sweep: the 2 shards' first sweeps (beat, every
# second) publish every hold at once, faster than the two workers' four pool processes
# release, so messages wait in the release queue when the kill comes (after a fifth of the
# holds are released), in the middle of the drain. The workers' tuning settings (Django
# settings, not variables):
DRAIN = {
    "CLEANUP_RELEASE_MODE": "single",
    "CLEANUP_SWEEP_BATCH_SIZE": 150,
    "CLEANUP_SWEEP_MAX_BATCHES": 2,
}
RELEASE_QUEUE = "cleanup"


@dataclass
class Drained:
    """What one case measured."""

    queue_type: str
    released_before: int
    outstanding: int
    killed: str
    first_after_s: float
    resumed_s: float
    longest_gap_s: float
    all_released_s: float
    delayed: int
    reclaimed: int
    lost: int
    attempts: dict[str, int]
    extra_attempts: int
    alive: bool
    notes: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return (
            f"{self.queue_type}: killed {self.killed} (leading {RELEASE_QUEUE!r}) after "
            f"{self.released_before}/{HOLDS} releases, {self.outstanding} holds claimed and "
            f"not released (their messages queued or being worked); first release after the kill "
            f"+{self.first_after_s:.1f}s; releases resumed after the longest stretch without "
            f"one ({self.longest_gap_s:.1f}s) +{self.resumed_s:.1f}s (recovery time); holds "
            f"released after that stretch (each late by up to it) {self.delayed}; holds "
            f"re-claimed through the lease (their message lost or not delivered within the lease) "
            f"{self.reclaimed}, of them with no delivery of their first message (lost) "
            f"{self.lost}; all released "
            f"+{self.all_released_s:.1f}s; release attempts logged {self.attempts} "
            f"({self.extra_attempts} beyond one per hold: redeliveries, messages sent twice); "
            f"workers and beat up throughout: {self.alive}; {self.notes}"
        )


def _attempts_by_hold(logs: list[Path]) -> Counter[int]:
    """Release attempts the workers logged, by hold: one per delivery of its messages (the
    drill releases one hold per message)."""
    return Counter(
        int(log_fields(line)["reservation_id"])
        for line in log_lines(logs, "release attempt reservation_id=")
    )


def _undelivered(ids: list[int], logs: list[Path]) -> int:
    """Holds claimed more often than their messages were delivered: each claim sent one release
    message, confirmed before the claim committed, and each delivery of one logs an attempt."""
    delivered = _attempts_by_hold(logs)
    return sum(1 for hold, claims in claim_counts(ids).items() if delivered[hold] < claims)


def _progress(ids: list[int]) -> tuple[int, int]:
    """(released, claimed and not released) among ``ids``: a claimed hold's message is queued
    or being worked."""
    released, outstanding = sql(
        "SELECT count(*) FILTER (WHERE status = 'released'), "
        "count(*) FILTER (WHERE status = 'held' AND claim_count > 0) "
        "FROM reservations_reservation WHERE id = ANY(%s)",
        [ids],
    )[0]
    return int(released), int(outstanding)


def _drain(
    cluster: Cluster, tmp_path: Path, queue_type: str, nodes: list[Node], restart: bool
) -> tuple[Drained, list[int]]:
    """Drain HOLDS expired holds through ``nodes`` with ``queue_type`` queues in a vhost of
    their own; kill the node that leads the release queue after a fifth of them (and start it
    again at once when ``restart``)."""
    vhost = f"drill_{queue_type}"
    cluster.add_vhost(vhost)
    ids = create_eligible_holds(HOLDS, offerings=6)
    env = {
        "CELERY_BROKER_URL": cluster.url(vhost, nodes),
        "CLEANUP_RABBITMQ_QUEUE_TYPE": queue_type,
        "CLEANUP_LEASE_SECONDS": str(LEASE_SECONDS),
    }
    where = tmp_path / queue_type
    where.mkdir()
    logs: list[Path] = []

    def worker(slot: int) -> Worker:
        logs.append(where / f"worker{slot}-{len(logs)}.log")
        return Worker(
            f"rq{slot}-{uuid.uuid4().hex[:6]}",
            2,
            logs[-1],
            env_overrides=env,
            django_settings=DRAIN,
        )

    workers = [worker(slot) for slot in range(2)]
    restarted: list[str] = []

    def released_all() -> bool:
        """Every hold released; meanwhile a worker that exited is started again, as a
        supervisor would (with classic queues a worker that reconnects while their node is
        down finds them gone and stops: NOT_FOUND is fatal to Celery's consumer)."""
        if restart:
            for slot, w in enumerate(workers):
                if not w.alive():
                    restarted.append(f"+{time.time() - killed_at:.1f}s")
                    workers[slot] = worker(slot)
                    workers[slot].start()
        return released_count(ids) == HOLDS

    for w in workers:
        w.start()
    try:
        for w in workers:
            w.wait_ready()
        # the workers declared the queues as they started: where the release queue lives
        declared = cluster.queues(vhost)[RELEASE_QUEUE]
        assert declared["type"] == queue_type, declared
        victim = cluster.node(declared["leader"])
        with beats(where, 1, env_overrides=env) as (beat,):
            wait_until(
                lambda: released_count(ids) >= HOLDS // 5,
                timeout=60,
                interval=0.05,
                what="the drain under way",
            )
            # when: the node that leads the release queue (a classic queue's only node) dies
            victim.kill()
            killed_at = time.time()
            released_before, outstanding = _progress(ids)
            notes: dict[str, Any] = {}
            if restart:
                victim.start()
                cluster.await_startup(victim)
                notes["node back"] = f"+{time.time() - killed_at:.1f}s"
            # then: every hold is released, without restarting a worker or beat
            try:
                wait_until(
                    released_all,
                    timeout=90,
                    interval=0.25,
                    what=f"every hold released after the kill ({queue_type} queues)",
                )
            except TimeoutError as exc:
                # (seen about once in ten quorum runs: the workers reconnect and then receive
                # nothing from the sweep and release queues; the listings are for its cause)
                raise TimeoutError(
                    f"{exc}; the queues then: {cluster.queues(vhost)}\n{cluster.diagnosis(vhost)}"
                ) from exc
            finished_at = time.time()
            # a message still on its way (one the killed node's consumers held comes back a few
            # seconds later) is given time to arrive before anything is counted as lost
            try:
                wait_until(
                    lambda: _undelivered(ids, logs) == 0,
                    timeout=30,
                    interval=0.25,
                    what=f"every claim's message delivered ({queue_type} queues)",
                )
            except TimeoutError:
                pass  # counted below as lost
            alive = beat.alive() and all(w.alive() for w in workers) and not restarted
            notes["workers started again"] = restarted
            # a quorum queue's two other replicas elected a leader among themselves
            notes["leader after"] = cluster.queues(vhost).get(RELEASE_QUEUE, {}).get("leader")
    finally:
        for w in workers:
            w.stop(timeout=30)
    times = released_times(ids)
    after = [t for t in times if t > killed_at]
    # the outage: the longest stretch without a release from the kill on (a release that was
    # already running when the node died may commit just after it)
    stretch = [killed_at, *after]
    gap_start, gap_end = max(zip(stretch, stretch[1:], strict=False), key=lambda p: p[1] - p[0])
    claims = claim_counts(ids)
    attempts = dict(outcomes_logged(logs))
    notes["failovers logged"] = len(log_lines(logs, "Trying again in")) + len(
        log_lines(logs, "Will retry using next failover")
    )
    return (
        Drained(
            queue_type=queue_type,
            released_before=released_before,
            outstanding=outstanding,
            killed=victim.name.partition("-")[0],
            first_after_s=after[0] - killed_at,
            resumed_s=gap_end - killed_at,
            longest_gap_s=gap_end - gap_start,
            all_released_s=finished_at - killed_at,
            delayed=sum(1 for t in after if t >= gap_end),
            reclaimed=sum(1 for c in claims.values() if c >= 2),
            lost=_undelivered(ids, logs),
            attempts=attempts,
            extra_attempts=sum(attempts.values()) - HOLDS,
            alive=alive,
            notes=notes,
        ),
        ids,
    )


@pytest.mark.usefixtures("exclusive_workers", "clean")
@pytest.mark.timeout(420)
def test_a_lost_node_is_survived_without_restarts_and_every_hold_is_released_once(
    tmp_path: Path,
) -> None:
    # given: three RabbitMQ nodes of the test's own in one cluster; beat sweeping 2 shards
    # every second
    install_schedule(shards=2, every=1)
    cluster = Cluster(tmp_path / "rabbitmq")
    try:
        try:
            cluster.start()
        except MissingTool as exc:
            skip_for_missing("rabbitmq-server", str(exc))
        started_at = time.time()
        # when/then: quorum queues, their leader killed; the workers know all three nodes
        quorum, quorum_ids = _drain(cluster, tmp_path, "quorum", cluster.nodes, restart=False)
        # classic queues on the two nodes left, the queues' node killed and started again
        left = cluster.alive()
        classic, classic_ids = _drain(cluster, tmp_path, "classic", left, restart=True)
        took = time.time() - started_at
        # and a worker told to use quorum queues on the classic ones' vhost refuses to start,
        # naming the setting and the queues (RabbitMQ cannot change a queue's type)
        refused = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "config", "worker", "--pool", "solo"],
            cwd=ROOT,
            env=service_env(
                CELERY_BROKER_URL=cluster.url("drill_classic", cluster.alive()),
                CLEANUP_RABBITMQ_QUEUE_TYPE="quorum",
            ),
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        cluster.stop()
    print(  # the measurements, shown with -s (docs/TOPOLOGIES.md records them)
        f"\nRabbitMQ cluster drill ({HOLDS} holds per case, lease {LEASE_SECONDS}s, the cases "
        f"{took:.0f}s):\n  {quorum.line()}\n  {classic.line()}"
    )
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert "refusing to start: CLEANUP_RABBITMQ_QUEUE_TYPE=quorum: " in refused.stderr
    for queue in ("sweep", "cleanup", "maintenance"):
        assert f"RabbitMQ refuses to declare queue {queue!r}" in refused.stderr, refused.stderr
    ids = quorum_ids + classic_ids
    # every hold released exactly once, seats conserved, none left held
    assert_each_released_once(ids)
    # with quorum queues nobody was restarted (with classic ones the drill restarted the
    # workers that stopped, as a supervisor would: printed above)
    assert quorum.alive, quorum.line()
    # and no message was lost: every message a claim sent was delivered (one the killed node's
    # consumers held may come back after the drill's 5 s lease, its hold re-claimed and
    # released by the next message, the first ending already_handled; with classic queues the
    # restarted node's unwritten messages are lost: printed above)
    assert quorum.lost == 0, quorum.line()


@pytest.mark.timeout(240)
def test_sends_on_a_new_confirmed_channel_each_reach_a_quorum_queue_whose_leader_just_died(
    tmp_path: Path,
) -> None:
    """RabbitMQ 3.10 keeps, per channel and quorum queue, the leader it found at the channel's
    first publish to the queue; a channel whose first publish comes while the leader has just
    died keeps the dead one and loses every later send to the queue (docs/TOPOLOGIES.md). Beat
    and the outbox relay send through ``confirmed_producer``: a new confirm-mode channel each
    time. Side by side, a long-lived producer as Celery's default path has one."""
    cluster = Cluster(tmp_path / "rabbitmq", prefix="chan")
    try:
        try:
            cluster.start()
        except MissingTool as exc:
            skip_for_missing("rabbitmq-server", str(exc))
        vhost = "channels"
        cluster.add_vhost(vhost)
        first = cluster.nodes[0]
        queues = {
            name: Queue(name, Exchange(""), routing_key=name,
                        queue_arguments={"x-queue-type": "quorum"})
            for name in ("confirmed", "long-lived")
        }  # fmt: skip
        # given: both queues led by the first node (declared through it), and two connections
        # to it that fail over to the two others
        with Connection(first.url(vhost)) as declaring:
            for queue in queues.values():
                queue(declaring.default_channel).declare()
        assert {q["leader"] for q in cluster.queues(vhost).values()} == {first.name}
        url = cluster.url(vhost, cluster.nodes)
        with Connection(url) as beat_like, Connection(url) as celery_like:
            pooled = Producer(beat_like)
            long_lived = Producer(celery_like)
            beat_like.ensure_connection(max_retries=3)
            celery_like.ensure_connection(max_retries=3)

            def confirmed(i: int) -> None:
                with confirmed_producer(pooled) as producer:
                    producer.publish({"i": i}, routing_key="confirmed", retry=False)

            def unconfirmed(i: int) -> None:
                long_lived.publish({"i": i}, routing_key="long-lived", retry=True)

            # when: the node dies, and both send every 50 ms from then on for 4 s
            first.kill()
            killed_at = time.time()
            sent: dict[str, list[bool]] = {"confirmed": [], "long-lived": []}
            while time.time() < killed_at + 4:
                for name, send in (("confirmed", confirmed), ("long-lived", unconfirmed)):
                    try:
                        send(len(sent[name]))
                        sent[name].append(True)
                    except Exception:  # noqa: BLE001 - a refused or lost send is counted
                        sent[name].append(False)
                time.sleep(0.05)
        took = time.time() - killed_at
        # (counted by the queues themselves: list_queues' figures lag behind for quorum queues)
        with Connection(cluster.alive()[0].url(vhost)) as counting:
            channel: Any = counting.default_channel  # py-amqp's: queue.declare-ok's counts
            arrived = {
                name: channel.queue_declare(queue=name, passive=True).message_count
                for name in queues
            }
    finally:
        cluster.stop()
    returned = {name: results.count(True) for name, results in sent.items()}
    print(
        f"\nsends for {took:.1f}s after the leader's node was killed: {returned['confirmed']}"
        f" of {len(sent['confirmed'])} confirmed sends returned and {arrived['confirmed']} "
        f"arrived; {returned['long-lived']} of {len(sent['long-lived'])} sends of the "
        f"long-lived channel returned and {arrived['long-lived']} arrived"
    )
    # then: every confirmed send that returned is in the queue, a refused one raised (not one
    # was lost without a word), and the sends work again after the election: the last second's
    # all returned
    assert arrived["confirmed"] == returned["confirmed"], (arrived, sent)
    assert all(sent["confirmed"][-20:]), sent["confirmed"]
