"""The broker's readers (cleanup.broker.readers) against entries planted in the tests' own Redis
database: the queues' depth and age and kombu's ``unacked`` hash.

Each bad entry must be skipped and counted (``reservation_cleanup_broker_entries_skipped_total``
by reader) while the good entry beside it is still read; no reading raises for one bad entry.
A key of the wrong type is named unreadable."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from cleanup.broker import readers
from cleanup.broker import readers as broker_module
from cleanup.operations.console.gauges import BacklogCollector
from tests.support.planted import (
    BAD_LIST_ENTRIES,
    BAD_UNACKED,
    GOOD_AGE,
    NOW,
    QUEUE,
    envelope,
    redis_only,
    skipped,
    unacked_entry,
)

pytestmark = redis_only


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


# --- keys of the wrong type -------------------------------------------------------------------


def test_readers_report_a_planted_queue_key_as_unreadable(broker: redis.Redis) -> None:
    broker.set(QUEUE, "x")
    stats = readers.queue_stats(QUEUE)
    assert stats.unreadable_keys == (QUEUE,) and not stats.readable
