"""The sweep's admission decisions as values, without a database: when a run goes on after a
batch, whose turn it is near the cap, and how the loop records each stop on the sweep's result
(the flags and log lines operators and the sweep tests read). The decisions against real queue
depths and other sessions' locks are in test_sweep.py and test_sizing.py.
"""

from __future__ import annotations

import logging

import pytest

from cleanup.release import admission
from cleanup.release.admission import (
    Reason,
    Stop,
    Take,
    Turn,
    after_the_batch,
    fair_share,
    near_the_cap,
    whose_turn,
)
from cleanup.release.sweep import SweepResult, _stop

FAR = Take(holds=10, depth=0, room=1_000)


def near(behind: int) -> Take:
    """A batch of 2 holds admitted near the cap, ``behind`` shards sharing the room."""
    return Take(holds=2, depth=6, room=4, turn=Turn(0, 30.0, 0, 30.0, behind))


def test_a_full_batch_far_from_the_cap_goes_on_and_a_partial_one_ends_the_run():
    assert not FAR.holds_the_lock
    assert after_the_batch(FAR, claimed=10, messages=10) is None
    assert after_the_batch(FAR, claimed=9, messages=9) == Stop(Reason.NOTHING_DUE)


def test_a_batch_that_fills_the_queue_to_its_cap_is_a_backpressure_pause():
    stop = after_the_batch(Take(holds=5, depth=95, room=5), claimed=5, messages=5)
    assert stop == Stop(Reason.BACKPRESSURE, "sweep paused by backpressure", {"queue_depth": 100})


def test_near_the_cap_a_run_ends_after_its_share_unless_its_shard_is_the_only_one_behind():
    assert near(1).holds_the_lock
    assert after_the_batch(near(1), claimed=2, messages=2) is None
    # two shards behind: the other one is owed the room next
    stop_at_two = after_the_batch(near(2), claimed=2, messages=2)
    assert stop_at_two is not None and stop_at_two.reason is Reason.TOOK_SHARE
    stop = after_the_batch(near(3), claimed=2, messages=2)
    assert stop is not None
    assert (stop.reason, stop.message) == (
        Reason.TOOK_SHARE,
        "sweep took its share of the room near the cap",
    )
    assert stop.fields == {"queue_depth": 6, "room": 4, "share": 2}


def test_room_other_sweeps_reserved_counts_against_the_cap(monkeypatch):
    # given: an empty release queue (cap 100), while sweeps that let go of the publish lock
    # before claiming still have 100 messages to publish into it
    monkeypatch.setattr(admission.broker, "queue_depth", lambda _queue: 0)
    monkeypatch.setattr(admission.locks, "room_reserved_by_others", lambda: 100)
    # (nothing due in any shard, were a turn read: this module has no database)
    monkeypatch.setattr(admission, "oldest_due_by_shard", lambda _shards: {})
    # when: another sweep asks under the lock what it may claim
    took = admission.under_the_lock("release", 0, 4, 10, 100)
    # then: it pauses for backpressure (the queue would pass its cap), saying why
    assert isinstance(took, Stop) and took.reason is Reason.BACKPRESSURE, took
    assert took.fields == {"queue_depth": 0, "reserved_elsewhere": 100}
    # and once that room is published and drained, it takes a full batch again
    monkeypatch.setattr(admission.locks, "room_reserved_by_others", lambda: 0)
    assert admission.under_the_lock("release", 0, 4, 10, 100) == Take(10, 0, 100)


def test_a_shard_more_than_the_slack_ahead_gives_way():
    slack = admission.TURN_SLACK_S
    ages = {0: 100.0, 1: 100.0 - slack, 2: 100.0 - slack - 0.5}
    assert whose_turn(0, ages).behind == 2
    assert not whose_turn(1, ages).gives_way  # within the slack: it shares the room
    assert whose_turn(2, ages).gives_way
    assert whose_turn(3, ages).gives_way  # nothing of its own is due
    assert whose_turn(0, {}).own_age is None


@pytest.mark.parametrize(
    ("reason", "flags"),
    [
        (Reason.BACKPRESSURE, {"backpressure"}),
        (Reason.NO_ROOM_AHEAD, {"backpressure"}),
        (Reason.QUEUE_AHEAD, {"backpressure"}),
        (Reason.GAVE_WAY, {"backpressure", "gave_way"}),
        (Reason.TOOK_SHARE, {"backpressure", "took_share"}),
        (Reason.BUDGET_SPENT, {"budget_exhausted"}),
        (Reason.NOTHING_DUE, set()),
    ],
)
def test_each_stop_sets_the_flags_of_the_sweep_result(reason, flags):
    result = SweepResult(0, 4, "t-1")
    _stop(result, Stop(reason))
    names = ("backpressure", "gave_way", "took_share", "budget_exhausted")
    assert {name for name in names if getattr(result, name)} == flags


def test_a_stop_is_logged_with_the_shard_its_fields_the_trace_id_and_the_turn(caplog):
    caplog.set_level(logging.INFO, logger="cleanup.sweep")
    turn = Turn(1, 10.0, 2, 14.5, 1, query_ms=3.0)
    result = SweepResult(1, 4, "t-2")
    _stop(result, Stop(Reason.GAVE_WAY, "sweep gave way", {"queue_depth": 7, "room": 1}, turn))
    _stop(result, Stop(Reason.NOTHING_DUE))  # no line
    (line,) = caplog.records
    assert line.getMessage() == "sweep gave way"
    assert (line.shard, line.queue_depth, line.room, line.trace_id) == (1, 7, 1, "t-2")  # type: ignore[attr-defined]
    assert (line.furthest_behind, line.furthest_behind_s) == (2, 14.5)  # type: ignore[attr-defined]


def test_the_share_is_the_whole_batch_with_room_to_spare_and_equal_near_the_cap():
    # room wider than every shard's full batch together: no turns
    assert not near_the_cap(room=20_000, shards=4, batch_size=500)
    assert not near_the_cap(room=2_000, shards=4, batch_size=500)
    assert not near_the_cap(room=10, shards=1, batch_size=500)  # one shard: all of the room
    # narrower: turns, each an equal share of the whole cap, at most a batch
    assert near_the_cap(room=1_999, shards=4, batch_size=500)
    assert fair_share(shards=4, batch_size=500, cap=20_000) == 500
    assert fair_share(shards=4, batch_size=500, cap=1_000) == 250
    assert fair_share(shards=4, batch_size=500, cap=42) == 11  # ceil(42 / 4)
    assert fair_share(shards=8, batch_size=500, cap=3) == 1


def test_the_shares_of_one_round_fill_the_cap():
    """Four sweeps taking their turns one after another fill the queue to its cap (shares of
    the room each found would stop at about two thirds of it, and the drain with them)."""
    cap, shards, batch, depth = 400, 4, 500, 0
    for _ in range(shards):
        room = cap - depth
        assert near_the_cap(room, shards, batch)
        depth += min(batch, room, fair_share(shards, batch, cap))
    assert depth == cap
