"""Keys of the wrong type (cleanup.broker.keys), against the tests' own Redis database.

Each case plants what anyone with write access to Redis could (a string where kombu keeps a
list, a hash, a sorted set or a set; kombu's restore lock) and then drives the
project's own transport the way a worker, a sweep or beat would. Before the transport set such
keys aside, every one of these raised ``WRONGTYPE`` out of kombu (in a worker: "Unrecoverable
error", the worker exits) or, for the lock, silently never restored anything again."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.utils import timezone
from prometheus_client import REGISTRY

from cleanup.broker import keys, readers
from cleanup.conf import cleanup_settings
from cleanup.release.messages import ReleaseMessage
from cleanup.release.publish import publish_release_messages
from config.celery_app import app
from tests.support.planted import QUEUE, envelope, redis_only, unacked_entry

pytestmark = redis_only


def set_aside_count(key: str) -> float:
    sample = REGISTRY.get_sample_value(
        "reservation_cleanup_broker_keys_set_aside_total", {"key": keys.describe(key)}
    )
    return sample or 0.0


def copies(client: redis.Redis, key: str) -> list[bytes]:
    return list(client.scan_iter(f"{keys.QUARANTINE_PREFIX}{key}:*"))


def channel() -> Any:
    conn = app.connection_for_write()
    conn.ensure_connection()
    return conn, conn.default_channel


def test_set_aside_moves_only_keys_of_another_type_and_keeps_a_copy(broker: redis.Redis) -> None:
    # given: a string where a list belongs, a real list, and a key that does not exist
    broker.set("planted", "x")
    broker.rpush("a-list", "m")
    before = set_aside_count("planted")
    # when
    moved = keys.quarantine(
        broker, {"planted": keys.LIST, "a-list": keys.LIST, "absent": keys.LIST}, "test"
    )
    # then: only the string moved, its copy kept with an expiry, counted once by name
    assert moved == ["planted"]
    assert broker.exists("planted") == 0 and broker.lrange("a-list", 0, -1) == [b"m"]
    (copy,) = copies(broker, "planted")
    assert broker.get(copy) == b"x" and 0 < broker.ttl(copy) <= keys.KEPT_SECONDS
    assert set_aside_count("planted") == before + 1


def test_a_priority_sub_key_is_named_readably(broker: redis.Redis) -> None:
    assert keys.describe(f"{QUEUE}\x06\x163") == f"{QUEUE} (priority 3)"


@pytest.mark.parametrize("step", [0, 3], ids=["the queue's key", "a priority sub-key"])
def test_consuming_a_queue_whose_key_is_not_a_list_sets_it_aside_and_reads_the_rest(
    broker: redis.Redis, step: int
) -> None:
    # given: a good message in one priority list, a string planted at another of the queue's keys
    names = readers.priority_keys(QUEUE)
    good, planted = names[1 if step == 0 else 0], names[0 if step == 0 else 1]
    broker.rpush(good, envelope(time.time()))
    broker.set(planted, "not a list")
    conn, chan = channel()
    try:
        # when: a worker declares the queue (its depth read) and pops from it
        _name, depth, _consumers = chan.queue_declare(QUEUE)
        delivered = chan._get(QUEUE)
    finally:
        conn.release()
    # then: the planted key is quarantined and the good message is read
    assert depth == 1
    assert delivered["headers"]["task"] == "cleanup.release_reservation"
    assert broker.exists(planted) == 0 and len(copies(broker, planted)) == 1


def test_a_worker_blocked_on_brpop_sets_a_planted_key_aside_and_keeps_polling(
    broker: redis.Redis,
) -> None:
    # given: a consumer of the release queue, and a string at one of its priority sub-keys
    planted = readers.priority_keys(QUEUE)[2]
    broker.set(planted, "x")
    conn = app.connection_for_write()
    got: list[Any] = []
    try:
        with conn.SimpleQueue(QUEUE, no_ack=True) as queue:
            # when: the consumer polls (BRPOP over every priority key answers WRONGTYPE)
            with pytest.raises(queue.Empty):
                queue.get(timeout=1.5)
            # then: the key was quarantined, and a message published now is delivered
            publish_release_messages([ReleaseMessage.for_hold(1, 1, _utc_now(), 0, "t")])
            got.append(queue.get(timeout=5))
    finally:
        conn.release()
    assert broker.exists(planted) == 0
    assert got and got[0].headers["task"] == "cleanup.release_reservation"


def _utc_now() -> Any:
    from datetime import UTC, datetime

    return datetime.now(UTC)


def test_a_batch_publish_to_a_planted_queue_key_publishes_every_message_once(
    broker: redis.Redis,
) -> None:
    # given: the release queue's key planted as a string
    broker.set(QUEUE, "x")
    messages = [ReleaseMessage.for_hold(rid, 1, _utc_now(), 0, "t") for rid in range(1, 251)]
    # when: a sweep publishes its fan-out (pipelined: several flushes)
    publish_release_messages(messages)
    # then: every message is in the queue exactly once
    ids = sorted(
        json.loads(readers_body(raw))[0][0]["reservation_id"] for raw in broker.lrange(QUEUE, 0, -1)
    )
    assert ids == list(range(1, 251))


def readers_body(raw: bytes | str) -> str:
    import base64

    return base64.b64decode(json.loads(raw)["body"]).decode()


def test_a_single_publish_to_a_planted_events_queue_goes_through(broker: redis.Redis) -> None:
    # given: the outbox events queue's key planted as a string (the relay publishes one by one)
    events = cleanup_settings().events_queue
    broker.set(events, "x")
    # when
    with app.producer_or_acquire() as producer:
        producer.publish({"event_id": 1}, exchange="", routing_key=events, serializer="json")
    # then
    assert broker.llen(events) == 1


@pytest.mark.parametrize("planted", ["unacked", "unacked_index"])
def test_recording_and_acking_a_delivery_survive_a_planted_bookkeeping_key(
    broker: redis.Redis, planted: str
) -> None:
    # given: kombu's ack hash or its index replaced by a string
    broker.set(planted, "x")
    publish_release_messages([ReleaseMessage.for_hold(7, 1, _utc_now(), 0, "t")])
    conn = app.connection_for_write()
    try:
        with conn.SimpleQueue(QUEUE) as queue:
            # when: a consumer takes the message with ack emulation, then acks it
            message = queue.get(timeout=5)
            recorded = broker.hlen("unacked"), broker.zcard("unacked_index")
            message.ack()
    finally:
        conn.release()
    # then: the delivery was recorded in a fresh hash and index, and the ack removed it
    assert recorded == (1, 1)
    assert broker.hlen("unacked") == 0 and broker.zcard("unacked_index") == 0
    assert len(copies(broker, planted)) == 1


def strand_a_message(broker: redis.Redis) -> None:
    """An unacked message past the visibility timeout, as a SIGKILLed worker leaves it."""
    stranded = time.time() - cleanup_settings().visibility_timeout - 60
    broker.hset("unacked", "tag", unacked_entry())
    broker.zadd("unacked_index", {"tag": stranded})


def run_restore_scan() -> None:
    """One periodic restore scan of a worker's channel."""
    conn, chan = channel()
    try:
        chan.qos.restore_visible(num=10, interval=1)
    finally:
        conn.release()


@pytest.mark.parametrize("expiry_ms", [None, 60_000], ids=["no expiry", "kombu's expiry"])
def test_a_restore_lock_planted_in_redis_does_not_hold_off_the_restore(
    broker: redis.Redis, expiry_ms: int | None
) -> None:
    # given: a message stranded by a dead worker, and kombu's restore lock planted in Redis
    # (with an expiry in kombu's own range it used to be respected, and planted again before
    # it ended it held the restore off for as long as the writer liked)
    strand_a_message(broker)
    broker.set("unacked_mutex", "planted", px=expiry_ms)
    # when: the periodic restore scan runs
    run_restore_scan()
    # then: the message is back in its queue; the scan's lock lives in PostgreSQL
    assert broker.llen(QUEUE) == 1 and broker.hlen("unacked") == 0


@pytest.mark.django_db(transaction=True)
def test_the_restore_waits_for_another_workers_lease_only_until_it_runs_out(
    broker: redis.Redis,
) -> None:
    from cleanup.models import RestoreLease
    from cleanup.worker.redis_transport import RESTORE_LEASE_SECONDS

    # given: a stranded message, and another worker's live restore lease
    strand_a_message(broker)
    now = timezone.now()
    # (a scan of an earlier test may have left the row, its lease ended)
    RestoreLease.objects.update_or_create(
        pk=1,
        defaults={
            "holder": "other-host:1",
            "until": now + timedelta(seconds=RESTORE_LEASE_SECONDS),
        },
    )
    # when: this worker's scan runs, it leaves the message to the scan in progress
    run_restore_scan()
    assert broker.llen(QUEUE) == 0 and broker.hlen("unacked") == 1
    # and when that worker stalls (cut off from the broker, still holding the lease) until the
    # lease runs out, without ending it
    RestoreLease.objects.filter(pk=1).update(until=now - timedelta(seconds=1))
    # then: the next scan takes the lease, restores the message, and ends its own lease
    run_restore_scan()
    assert broker.llen(QUEUE) == 1 and broker.hlen("unacked") == 0
    lease = RestoreLease.objects.get(pk=1)
    assert lease.holder != "other-host:1" and lease.until <= timezone.now()


@pytest.mark.django_db
def test_a_restore_to_a_planted_queue_key_loses_nothing(broker: redis.Redis) -> None:
    # given: a stranded message, and its queue's key planted as a string
    strand_a_message(broker)
    broker.set(QUEUE, "x")
    run_restore_scan()
    # then: the message was restored into a fresh list (not dropped from the hash alone)
    assert broker.llen(QUEUE) == 1 and broker.hlen("unacked") == 0


def test_a_planted_binding_set_is_set_aside_and_the_bindings_put_back(broker: redis.Redis) -> None:
    # given: the task exchange's bindings as kombu keeps them, then replaced by a string
    exchange = app.conf.task_default_exchange or app.conf.task_default_queue
    conn, chan = channel()
    try:
        chan.exchange_declare(exchange, "direct")
        chan.queue_declare(QUEUE)
        chan.queue_bind(QUEUE, exchange, QUEUE)
        broker.set(f"_kombu.binding.{exchange}", "x")
        # when: a publisher routes by the exchange
        table = chan.get_table(exchange)
    finally:
        conn.release()
    # then: the routing table holds the binding again
    assert (QUEUE, "", QUEUE) in table
    assert broker.type(f"_kombu.binding.{exchange}") == b"set"


# --- routing -----------------------------------------------------------------------------


def test_a_planted_key_rename_is_atomic_with_its_type_check(broker: redis.Redis) -> None:
    """A key that became a list between the failed command and the check stays where it is."""
    broker.rpush(QUEUE, "m")
    assert keys.quarantine(broker, {QUEUE: keys.LIST}, "test") == []
    assert broker.llen(QUEUE) == 1
