"""The screened Redis transport (cleanup.worker.redis_transport): still kombu's own read and
restore with the screening added, bad entries dead-lettered or set aside while the rest is
read and restored, a requeue counted once and before its message is back, broadcasts that are
not envelopes dropped; and the same channel through a Sentinel (a private one on free ports)."""

from __future__ import annotations

import inspect
import json
import time
from queue import Empty
from typing import Any

import pytest
import redis
from kombu import Connection
from kombu.transport import redis as kombu_redis

from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release import delivery_cap
from cleanup.worker import redis_transport
from cleanup.worker.redis_transport import ScreenedQoS, screen_entry
from config.celery_app import app
from tests.support.planted import (
    BAD_UNACKED,
    QUEUE,
    envelope,
    nested,
    redis_only,
    skipped,
    unacked_entry,
)
from tests.support.sentinel import MASTER, TRANSPORT, PrivateSentinel


@redis_only
@pytest.mark.django_db
def test_a_queue_entry_whose_delivery_info_names_another_key_is_dead_lettered() -> None:
    entry = json.loads(envelope(time.time()))
    entry["properties"]["delivery_info"]["routing_key"] = "unacked"
    assert screen_entry(json.dumps(entry), QUEUE) is None
    (letter,) = DeadLetter.objects.all()
    assert "misrouted" in letter.error and "'unacked'" in letter.error


@redis_only
@pytest.mark.django_db
@pytest.mark.parametrize("bad", BAD_UNACKED.values(), ids=BAD_UNACKED.keys())
def test_the_restore_sets_a_bad_unacked_entry_aside_and_restores_the_rest(
    broker: redis.Redis, bad: Any
) -> None:
    # given: two messages stranded past the visibility timeout, as a SIGKILLed worker leaves
    # them, and a bad entry between them (the scan goes newest first, so it meets the bad
    # entry before the older good one)
    stranded = time.time() - cleanup_settings().visibility_timeout - 60
    broker.hset("unacked", mapping={"newer": unacked_entry(), "bad": bad, "older": unacked_entry()})
    broker.zadd("unacked_index", {"newer": stranded + 20, "bad": stranded + 10, "older": stranded})
    before = skipped("unacked_restore")
    # when: a worker's periodic restore scan runs
    with app.connection_for_write() as conn:
        channel: Any = conn.default_channel
        assert isinstance(channel.qos, ScreenedQoS)
        qos = channel.qos
        qos.restore_visible(num=10, interval=1)
    # then: both good messages are back in the queue, marked redelivered ...
    restored = [json.loads(raw) for raw in broker.lrange(QUEUE, 0, -1)]
    assert len(restored) == 2
    assert all(m["properties"]["delivery_info"]["redelivered"] for m in restored)
    # ... the bad entry is gone from the hash and its index, as one dead letter, counted
    assert broker.hlen("unacked") == 0 and broker.zcard("unacked_index") == 0
    letters = list(DeadLetter.objects.all())
    assert [letter.reason for letter in letters] == [DeadLetter.Reason.REJECTED]
    assert "unacked entry" in letters[0].error
    assert skipped("unacked_restore") == before + 1


@redis_only
@pytest.mark.django_db
def test_a_requeue_of_a_bad_unacked_entry_sets_it_aside(broker: redis.Redis) -> None:
    # given: a message this worker holds whose unacked entry was overwritten
    broker.hset("unacked", "tag", nested(100_000))
    broker.zadd("unacked_index", {"tag": time.time()})
    # when: the worker requeues it (a pool process was lost, reject_on_worker_lost)
    with app.connection_for_write() as conn:
        channel: Any = conn.default_channel
        channel.qos.restore_by_tag("tag", leftmost=True)
    # then
    assert broker.llen(QUEUE) == 0 and broker.hlen("unacked") == 0
    assert DeadLetter.objects.filter(reason=DeadLetter.Reason.REJECTED).count() == 1


@redis_only
@pytest.mark.django_db
def test_a_requeued_message_is_counted_before_it_is_back_in_its_queue(
    broker: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given: a message this worker holds
    broker.hset("unacked", "tag", unacked_entry())
    broker.zadd("unacked_index", {"tag": time.time()})
    queued_when_counted: list[int] = []
    monkeypatch.setattr(
        delivery_cap,
        "count_restored",
        lambda _envelope: queued_when_counted.append(broker.llen(QUEUE)),
    )
    # when: the worker requeues it (a pool process was lost, reject_on_worker_lost)
    with app.connection_for_write() as conn:
        channel: Any = conn.default_channel
        channel.qos.restore_by_tag("tag", leftmost=True)
    # then: the redelivery was counted once, before the message was back in its queue: no other
    # worker can pop it and read its count without this delivery (a poison message would run
    # once past the cap)
    assert queued_when_counted == [0]
    assert broker.llen(QUEUE) == 1 and broker.hlen("unacked") == 0


@redis_only
@pytest.mark.django_db
def test_a_requeue_run_again_after_a_concurrent_change_counts_its_redelivery_once(
    broker: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given: a message this worker holds, and another worker's message in the same hash
    broker.hset("unacked", "tag", unacked_entry())
    broker.zadd("unacked_index", {"tag": time.time()})
    counted: list[Any] = []
    monkeypatch.setattr(delivery_cap, "count_restored", counted.append)
    with app.connection_for_write() as conn:
        channel: Any = conn.default_channel
        quarantine = channel.quarantine_restore_targets

        def another_worker_takes_a_message(*args: Any) -> None:
            # the other worker writes the watched hash while this requeue's transaction reads
            # it, once: Redis refuses the transaction and it runs again
            if not counted:
                broker.hset("unacked", "other-tag", unacked_entry())
            quarantine(*args)

        monkeypatch.setattr(channel, "quarantine_restore_targets", another_worker_takes_a_message)
        # when: this worker requeues its message
        channel.qos.restore_by_tag("tag", leftmost=True)
    # then: the requeue went through once and its redelivery was counted once, not once per
    # run of the transaction (a second count would dead-letter the hold a delivery early)
    assert broker.llen(QUEUE) == 1
    assert set(broker.hkeys("unacked")) == {b"other-tag"}
    assert len(counted) == 1, f"one redelivery counted {len(counted)} times"


def test_our_redis_read_is_still_kombus_own_with_screening_added() -> None:
    """cleanup.worker.redis_transport copies kombu 5.7's ``Channel._brpop_read`` and ``_get`` and
    adds the screening; when kombu changes them this fails, and the copy must be redone."""
    from kombu.transport import redis

    channel: Any = redis.Channel
    read = inspect.getsource(channel._brpop_read)
    get = inspect.getsource(channel._get)
    assert "self.connection._deliver(loads(bytes_to_str(item)), dest)" in read
    assert "self._flush_brpop_reauth()" in read
    assert "return loads(bytes_to_str(item))" in get
    assert "self._maybe_update_queues_expire(client, queue)" in get


def test_our_unacked_restore_is_still_kombus_own_with_screening_added() -> None:
    """cleanup.worker.redis_transport.ScreenedQoS copies kombu 5.7's ``QoS.restore_by_tag`` with the
    screening in place of the bare decode, and relies on every restore (the visibility scan, a
    requeue, the restore at shutdown) going through it; when kombu changes any of that this
    fails, and the copy must be redone."""
    from kombu.transport import redis

    qos: Any = redis.QoS
    by_tag = inspect.getsource(qos.restore_by_tag)
    assert "M, EX, RK = loads(bytes_to_str(p))  # json is unicode" in by_tag
    assert "self.channel._do_restore_message(M, EX, RK, pipe, leftmost)" in by_tag
    assert "self._remove_from_indices(tag, pipe)" in by_tag
    assert "client.transaction(restore_transaction, self.unacked_key)" in by_tag
    assert "self.restore_by_tag(tag, client)" in inspect.getsource(qos.restore_visible)
    assert "self.restore_by_tag(tag, client=client)" in inspect.getsource(qos.restore_unacked)
    reject = inspect.getsource(qos.reject)
    assert "self.restore_by_tag(delivery_tag, leftmost=True)" in reject
    # the one other reader of the hash, Channel._restore, is not used by the Redis QoS
    source = inspect.getsource(qos)
    assert "._restore(" not in source and "_restore_at_beginning" not in source


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"[]", "a JSON list"),
        (b"\xff not json", "not JSON"),
        (b"[" * 100_000, "nested deeper"),
        (b"x" * (3 * 1024 * 1024), "exceeds CLEANUP_MAX_MESSAGE_BYTES"),
        (b'{"body": "e30="}', "'properties'"),
    ],
)
def test_a_broadcast_that_is_not_an_envelope_is_dropped_by_the_redis_transport(
    data: bytes, words: str
) -> None:
    problem = redis_transport.screen_broadcast(data)
    assert problem is not None and words in problem


def test_kombu_passes_over_a_pub_sub_reply_whose_type_is_not_a_message() -> None:
    """cleanup.worker.redis_transport drops a broadcast by renaming its type in ``_handle_message``;
    kombu's ``_receive_one`` must still deliver only types ending in 'message'."""
    from kombu.transport import redis

    channel: Any = redis.Channel
    receive = inspect.getsource(channel._receive_one)
    assert "payload = self._handle_message(c, response)" in receive
    assert "if bytes_to_str(payload['type']).endswith('message'):" in receive


def _own_names(cls: type) -> set[str]:
    return {name for name in vars(cls) if not (name.startswith("__") and name != "__init__")}


def _sentinel_connection(sentinel: PrivateSentinel) -> Connection:
    """A kombu connection of the screened Sentinel transport, told only the sentinel's URL and
    the master's name (as a worker is)."""
    conn = Connection(sentinel.url, transport=TRANSPORT)
    conn.transport_options = {"master_name": MASTER}
    return conn


def test_every_screened_method_is_the_one_a_sentinel_channel_runs() -> None:
    # given: what the screened channel overrides, and what kombu's Sentinel channel adds
    screened = _own_names(redis_transport.Channel)
    sentinel = _own_names(kombu_redis.SentinelChannel)
    # then: neither overrides the other (kombu overriding a screened method would need review)
    assert screened & sentinel == set()
    # and: the screened methods and QoS win, kombu's Sentinel pool and fan-out logic is kept
    for name in screened:
        assert (
            inspect.getattr_static(redis_transport.SentinelChannel, name)
            is vars(redis_transport.Channel)[name]
        ), name
    # (what the project's Sentinel channel defines itself is checked by its own tests below)
    for name in sentinel - {"__init__", "QoS"} - set(vars(redis_transport.SentinelChannel)):
        assert (
            inspect.getattr_static(redis_transport.SentinelChannel, name)
            is vars(kombu_redis.SentinelChannel)[name]
        ), name
    assert redis_transport.SentinelChannel.QoS is redis_transport.ScreenedQoS
    assert redis_transport.SentinelTransport.Channel is redis_transport.SentinelChannel
    assert redis_transport.SentinelTransport.default_port == 26379


def test_a_failed_connection_switching_to_the_next_sentinel_keeps_the_screened_transport() -> None:
    # given: a broker connection over two sentinels, as Celery makes it from the settings
    conn = Connection("sentinel://127.0.0.1:1;sentinel://127.0.0.1:2", transport=TRANSPORT)
    assert conn.transport_cls == TRANSPORT
    # when: kombu switches to the next URL, as it does after a failed connection attempt
    conn.maybe_switch_next()
    # then: the URL's scheme selects the project's transport, not kombu's unscreened one
    assert conn.port == 2
    assert type(conn.transport) is redis_transport.SentinelTransport


@pytest.mark.django_db
def test_an_entry_that_is_not_json_is_dead_lettered_by_a_channel_made_through_a_sentinel(
    private_sentinel: PrivateSentinel,
) -> None:
    # given: a channel of the screened Sentinel transport, told only the sentinel and the name
    conn = _sentinel_connection(private_sentinel)
    try:
        channel: Any = conn.default_channel
        assert type(channel) is redis_transport.SentinelChannel
        # when: the master's queue holds an entry that stops kombu's own channel
        private_sentinel.master().lpush("sentinel-unit", b"not json at all")
        # then: the screened read sets it aside as a dead letter, and the channel reads on
        with pytest.raises(Empty):
            channel._get("sentinel-unit")
    finally:
        conn.release()
    letter = DeadLetter.objects.get()
    assert letter.error.startswith("not a broker envelope: not JSON")
    assert private_sentinel.master().llen("sentinel-unit") == 0


@pytest.mark.django_db
def test_closing_a_channel_whose_connection_is_gone_keeps_its_unacked_message_and_the_worker(
    private_sentinel: PrivateSentinel,
) -> None:
    # given: a message delivered and not acknowledged on a channel of the Sentinel transport
    conn = _sentinel_connection(private_sentinel)
    channel: Any = conn.channel()
    with conn.Producer(channel) as producer:
        producer.publish({"x": 1}, routing_key="sentinel-unit", serializer="json")
    assert channel.basic_get("sentinel-unit", no_ack=False) is not None
    # when: the channel is closed after its broker connection was dropped, as Celery does when
    # the master dies (kombu's close needs a new pool to restore the message, and the client
    # it builds that pool from is gone)
    channel._disconnect_pools()
    channel.connection.client = None
    with pytest.raises(conn.connection_errors):
        channel.close()
    # then: a connection error, which Celery's release ignores (an AttributeError stopped the
    # worker), and the message is still in the ack bookkeeping for the visibility timeout
    assert private_sentinel.master().hlen("unacked") == 1
