"""Planted broker state: the readers of the queues and of kombu's ``unacked`` hash, and kombu's
restore of unacked messages, against entries planted in the tests' own Redis database.

Each bad entry must be skipped and counted (``reservation_cleanup_broker_entries_skipped_total``
by reader) while the good entry beside it is still read; no reading raises for one bad entry.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis
from django.conf import settings

from cleanup.broker import readers as broker_module
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.operations.console import health
from cleanup.operations.console.gauges import BacklogCollector
from cleanup.operations.scaling.autoscale import Reader
from cleanup.release import delivery_cap
from cleanup.worker.redis_transport import ScreenedQoS
from config.celery_app import app
from tests.support.planted import (
    BAD_LIST_ENTRIES,
    BAD_UNACKED,
    GOOD_AGE,
    NOW,
    QUEUE,
    envelope,
    nested,
    plant_bad_state,
    skipped,
    unacked_entry,
)

pytestmark = pytest.mark.skipif(not settings.BROKER_IS_REDIS, reason="Redis broker state")


@pytest.mark.parametrize("bad", BAD_LIST_ENTRIES.values(), ids=BAD_LIST_ENTRIES.keys())
def test_the_oldest_message_age_skips_a_bad_entry_and_reads_the_next(
    broker: redis.Redis, bad: Any
) -> None:
    # given: the oldest entry of the queue (index -1) is bad, a good one waits behind it
    broker.rpush(QUEUE, envelope(NOW - GOOD_AGE), bad)
    before = skipped("queue_age")
    # when
    stats = broker_module.queue_stats(QUEUE, now=NOW)
    # then: the good entry's age, both entries in the depth, one skip counted
    assert stats.oldest_age_seconds == pytest.approx(GOOD_AGE)
    assert stats.depth == 2
    assert skipped("queue_age") == before + 1
    assert stats.skipped == 1


def test_when_every_peeked_entry_is_bad_the_age_is_absent_not_faked(broker: redis.Redis) -> None:
    # given: more bad entries at the oldest end than a reading peeks at
    bad = [envelope(-1e300)] * broker_module.PEEK_ENTRIES
    broker.rpush(QUEUE, envelope(NOW - GOOD_AGE), *bad)
    before = skipped("queue_age")
    # when
    stats = broker_module.queue_stats(QUEUE, now=NOW)
    queues = BacklogCollector.read_queues()
    # then: no age rather than an absurd one, and the gauge is not exported as "empty" (0)
    assert stats.oldest_age_seconds is None and stats.depth == 5
    assert skipped("queue_age") == before + 2 * broker_module.PEEK_ENTRIES
    assert (QUEUE,) not in dict(queues["queue_oldest_message_age_seconds"])


def test_keys_of_the_wrong_type_are_skipped(broker: redis.Redis) -> None:
    # given: the queue's first priority list and the unacked hash are planted as strings; a
    # good message waits in another priority list
    broker.set(QUEUE, "not a list")
    broker.set("unacked", "not a hash")
    broker.rpush(broker_module.priority_keys(QUEUE)[1], envelope(NOW - GOOD_AGE))
    before = (skipped("queue_depth"), skipped("unacked_count"))
    # when
    stats = broker_module.queue_stats(QUEUE, now=NOW)
    # then: the readable list is read; the planted key is named unreadable, not counted as 0
    assert (stats.depth, stats.oldest_age_seconds, stats.unacked) == (1, GOOD_AGE, 0)
    assert stats.unreadable_keys == (QUEUE,)
    assert broker_module.queue_depth(QUEUE) == 1
    assert skipped("queue_depth") == before[0] + 2
    assert skipped("unacked_count") == before[1] + 1


@pytest.mark.parametrize("bad", BAD_UNACKED.values(), ids=BAD_UNACKED.keys())
def test_the_unacked_count_skips_a_bad_entry(broker: redis.Redis, bad: Any) -> None:
    # given: one good unacked message of the queue, one of another queue, one bad entry
    broker.hset(
        "unacked", mapping={"good": unacked_entry(), "other": unacked_entry("sweep"), "bad": bad}
    )
    before = skipped("unacked_count")
    # when
    count = broker_module.unacked_count(QUEUE)
    # then
    assert count == 1
    assert skipped("unacked_count") == before + 1


# --- the callers: /metrics, the autoscaler, the health page --------------------------------


def test_the_metrics_collector_exports_the_good_values(broker: redis.Redis) -> None:
    # given
    plant_bad_state(broker)
    before = skipped("queue_age") + skipped("unacked_count")
    # when
    queues = BacklogCollector.read_queues()
    # then
    assert dict(queues["queue_depth"])[(QUEUE,)] == 3
    assert dict(queues["queue_oldest_message_age_seconds"])[(QUEUE,)] == pytest.approx(
        GOOD_AGE, abs=5
    )
    assert dict(queues["queue_unacked"])[(QUEUE,)] == 1
    assert skipped("queue_age") + skipped("unacked_count") > before


@pytest.mark.django_db
def test_the_autoscaler_reads_the_good_values_instead_of_an_error(broker: redis.Redis) -> None:
    # given
    plant_bad_state(broker)
    before = skipped("queue_age")
    # when
    reading = Reader("reader-test", 60.0, lambda: 1).read()
    # then: no read_error (which holds the pool), no absurd age (which grows it to max)
    assert reading.error == ""
    assert reading.queue_depth == 3
    assert reading.queue_oldest_age_s == pytest.approx(GOOD_AGE, abs=5)
    assert skipped("queue_age") == before + 2


@pytest.mark.django_db
def test_the_health_page_reads_the_good_values_instead_of_an_error(broker: redis.Redis) -> None:
    # given
    plant_bad_state(broker)
    # when
    page = health.collect(with_workers=False)
    # then
    assert page.queue_error == ""
    assert page.queue is not None
    assert page.queue.oldest_age_seconds == pytest.approx(GOOD_AGE, abs=5)
    assert (page.queue.depth, page.queue.unacked) == (3, 1)


# --- kombu's restore of unacked messages ----------------------------------------------------


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
        set_aside = channel.set_aside_restore_targets

        def another_worker_takes_a_message(*args: Any) -> None:
            # the other worker writes the watched hash while this requeue's transaction reads
            # it, once: Redis refuses the transaction and it runs again
            if not counted:
                broker.hset("unacked", "other-tag", unacked_entry())
            set_aside(*args)

        monkeypatch.setattr(channel, "set_aside_restore_targets", another_worker_takes_a_message)
        # when: this worker requeues its message
        channel.qos.restore_by_tag("tag", leftmost=True)
    # then: the requeue went through once and its redelivery was counted once, not once per
    # run of the transaction (a second count would dead-letter the hold a delivery early)
    assert broker.llen(QUEUE) == 1
    assert set(broker.hkeys("unacked")) == {b"other-tag"}
    assert len(counted) == 1, f"one redelivery counted {len(counted)} times"
