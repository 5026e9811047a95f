"""The adaptive release mode (the default, cleanup.release.sizing): how many holds each release
message carries.

The sizing function is pure; the sweep tests run the product's sweep in process against the
tests' PostgreSQL and Redis database, and read what it published from the broker, as a worker
would receive it. The sweeps' turns near the cap: test_admission.py and test_sweep.py."""

from __future__ import annotations

import base64
import json
import logging
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import REGISTRY

from cleanup.broker.readers import priority_keys, queue_depth, redis_client
from cleanup.release import sizing
from cleanup.release.sizing import choose_release_size, split_evenly
from cleanup.release.sweep import sweep_shard
from tests.support.holds import seed_expired
from tests.support.metrics import counter


def size(**inputs: Any) -> sizing.ReleaseSize:
    defaults: dict[str, Any] = {
        "claimed": 20,
        "queue_depth": 0,
        "oldest_age_s": 2.0,
        "rate_per_s": 40.0,
        "target_s": 10.0,
        "cap": 100,
    }
    return choose_release_size(**{**defaults, **inputs})


# --- The sizing function ------------------------------------------------------------------


def test_light_load_gets_one_hold_per_message():
    # the articles' scenario: 40 holds/s, a sweep of one of 4 shards every 2 s claims ~20,
    # nothing waits, the oldest is one sweep interval old
    decided = size(claimed=20, queue_depth=0, oldest_age_s=2.0, rate_per_s=40.0)
    assert (decided.size, decided.messages, decided.reason) == (1, 20, "keeps_up")
    # even a claim of a full sweep batch, when the fleet starts it well within the target
    assert size(claimed=500, queue_depth=100, rate_per_s=400.0).size == 1
    # and a single hold is always one message, whatever waits ahead
    assert size(claimed=1, queue_depth=10**6, oldest_age_s=500.0).size == 1


def test_a_burst_gets_more_holds_per_message_up_to_the_cap():
    # given: 500 holds claimed, 370 messages/s measured, 8 s left before the oldest is 10 s old
    # (2,960 messages servable): the more messages wait ahead, the bigger each new message
    assert size(claimed=500, queue_depth=2_000, rate_per_s=370.0).size == 1
    grown = size(claimed=500, queue_depth=2_500, rate_per_s=370.0)  # 460 servable
    assert (grown.size, grown.messages, grown.reason) == (2, 250, "backlog")
    bigger = size(claimed=500, queue_depth=2_950, rate_per_s=370.0)  # 10 servable
    assert (bigger.size, bigger.messages, bigger.reason) == (50, 10, "backlog")
    capped = size(claimed=500, queue_depth=2_958, rate_per_s=370.0)  # 2 servable: 250 wanted
    assert (capped.size, capped.messages, capped.reason) == (100, 5, "at_cap")
    # the queue ahead alone outlasts the budget: the cap
    behind = size(claimed=500, queue_depth=5_000, rate_per_s=370.0)
    assert (behind.size, behind.reason) == (100, "behind")
    # a smaller cap bounds it the same way
    assert size(claimed=500, queue_depth=5_000, rate_per_s=370.0, cap=7).size == 7


def test_an_older_batch_gets_bigger_messages_and_a_late_one_keeps_half_the_target():
    # the same claim, older: less of the target is left, so more holds per message
    young = size(claimed=500, queue_depth=0, oldest_age_s=1.0, rate_per_s=20.0)  # 180 servable
    older = size(claimed=500, queue_depth=0, oldest_age_s=7.0, rate_per_s=20.0)  # 100 (floor)
    assert (young.size, older.size) == (3, 5)
    # already past the target (an outage, a lost message claimed again): it is sized to be
    # started within half the target, not given up to the cap; a few late holds stay single
    late = size(claimed=20, queue_depth=0, oldest_age_s=60.0, rate_per_s=20.0)
    assert (late.size, late.budget_s) == (1, 5.0)


def test_the_holds_due_behind_a_full_batch_count_too():
    # a batch of 500 alone would look servable one hold per message (3,600 messages in the
    # budget), but 14,000 are due behind it: the fleet must start those in the same budget
    alone = size(claimed=500, queue_depth=0, oldest_age_s=1.0, rate_per_s=400.0)
    behind = size(claimed=500, due=14_000, queue_depth=0, oldest_age_s=1.0, rate_per_s=400.0)
    assert (alone.size, alone.reason) == (1, "keeps_up")
    assert (behind.size, behind.reason, behind.due) == (4, "backlog", 14_000)
    assert behind.messages == 125  # the batch's own messages: 500 holds, 4 each
    # and a due count below the batch never shrinks what the batch needs
    assert size(claimed=500, due=10, queue_depth=0, oldest_age_s=1.0, rate_per_s=400.0).due == 500


def test_every_input_is_kept_for_the_log_line():
    decided = size(claimed=500, queue_depth=2_950, oldest_age_s=2.0, rate_per_s=370.0)
    logged = decided.as_log()
    assert logged == {
        "size": 50,
        "messages": 10,
        "reason": "backlog",
        "claimed": 500,
        "due": 500,
        "queue_depth": 2_950,
        "oldest_age_s": 2.0,
        "rate_per_s": 370.0,
        "rate_source": "measured",
        "target_s": 10.0,
        "cap": 100,
        "budget_s": 8.0,
        "servable": 10.0,
    }


def test_bad_inputs_are_refused_naming_them():
    with pytest.raises(ValueError, match="cap"):
        size(cap=0)
    with pytest.raises(ValueError, match="target_s"):
        size(target_s=0)
    with pytest.raises(ValueError, match="rate_per_s"):
        size(rate_per_s=0)


def test_holds_are_split_into_even_messages():
    assert [len(c) for c in split_evenly(list(range(101)), 50)] == [34, 34, 33]
    assert [len(c) for c in split_evenly(list(range(5)), 1)] == [1] * 5
    assert split_evenly(list(range(7)), 100) == [list(range(7))]
    assert split_evenly([], 3) == []


def test_the_drain_arithmetic_is_the_one_the_autoscaler_and_the_capacity_plan_use():
    from cleanup.operations.scaling import autoscale, capacity

    assert capacity.ceil_consumers is sizing.ceil_whole
    assert capacity.offered_load is sizing.offered_load
    assert autoscale.drain_consumers is sizing.drain_consumers
    # the docs' worked example: 6,000 holds at 0.05 s each within 140 s
    assert sizing.drain_consumers(6_000, 0.05, 140) == 3


# --- The sweep in the adaptive mode -----------------------------------------------------------


def queued_messages() -> list[tuple[str, dict[str, Any]]]:
    """(task name, message) of every release message waiting in the queue, oldest first."""
    client = redis_client()
    found = []
    for key in priority_keys("cleanup"):
        for raw in reversed(client.lrange(key, 0, -1)):  # LPUSH: the oldest is last
            envelope = json.loads(raw)
            body = base64.b64decode(envelope["body"])
            args = json.loads(body)[0]
            found.append((envelope["headers"]["task"], args[0]))
    return found


def holds_in(message: dict[str, Any]) -> list[int]:
    if message.get("kind") == "release_batch":
        return [item["reservation_id"] for item in message["items"]]
    return [message["reservation_id"]]


@pytest.mark.django_db(transaction=True)
def test_a_light_sweep_publishes_one_per_reservation_message_per_hold(adaptive, broker, caplog):
    ids = seed_expired(30, seconds_ago=1)
    caplog.set_level(logging.DEBUG, logger="cleanup.sweep")
    # when
    result = sweep_shard(0, 1)
    # then: 30 messages, each the per-reservation message of one hold
    queued = queued_messages()
    assert {task for task, _ in queued} == {"cleanup.release_reservation"}
    assert sorted(h for _, m in queued for h in holds_in(m)) == sorted(ids)
    assert (result.published, result.messages, result.largest_message) == (30, 30, 1)
    assert result.sizing_reason == "keeps_up"
    # and the decision was logged with its inputs
    (line,) = [r for r in caplog.records if r.getMessage() == "release size chosen"]
    assert (line.size, line.reason, line.claimed, line.rate_source) == (1, "keeps_up", 30, "floor")


@pytest.mark.django_db(transaction=True)
def test_a_burst_sweep_publishes_multi_hold_messages_and_says_why(adaptive, broker, caplog):
    # given: 1,000 holds just expired and nothing measured yet (the floor: 20 messages/s)
    ids = seed_expired(1_000, seconds_ago=1)
    before = {
        reason: counter("release_sizing_decisions", reason=reason) for reason in sizing.REASONS
    }
    messages_before = counter("published_messages", shard="0")
    holds_before = counter("published", shard="0")
    caplog.set_level(logging.INFO, logger="cleanup.sweep")
    # when
    result = sweep_shard(0, 1, batch_size=500)
    # then: every hold is in exactly one message, and the messages carry several holds each
    queued = queued_messages()
    carried = [h for _, m in queued for h in holds_in(m)]
    assert sorted(carried) == sorted(ids)
    sizes = [len(holds_in(m)) for _, m in queued]
    assert max(sizes) > 1 and max(sizes) <= 100
    assert result.messages == len(queued) < len(ids)
    assert queue_depth("cleanup") == len(queued)
    assert {task for task, m in queued if len(holds_in(m)) > 1} == {"cleanup.release_batch"}
    # each batch item keeps its own id, version and idempotency key
    batch = next(m for _, m in queued if m.get("kind") == "release_batch")
    for item in batch["items"]:
        assert item["idempotency_key"] == f"release:{item['reservation_id']}:{item['version']}"
    # and the log said which size and why, with its inputs, batch by batch
    lines = [r for r in caplog.records if r.getMessage() == "release size chosen"]
    assert [line.claimed for line in lines] == [500, 500]
    assert all(line.size > 1 and line.reason in sizing.REASONS for line in lines)
    assert lines[0].queue_depth == 0 and lines[1].queue_depth == lines[0].messages
    # the counters: messages and holds side by side, one decision per batch
    assert counter("published_messages", shard="0") == messages_before + len(queued)
    assert counter("published", shard="0") == holds_before + 1_000
    decided = sum(
        counter("release_sizing_decisions", reason=reason) - before[reason]
        for reason in sizing.REASONS
    )
    assert decided == 2
    assert REGISTRY.get_sample_value("reservation_cleanup_release_size_chosen") == lines[-1].size


@pytest.mark.django_db(transaction=True)
def test_a_burst_sweep_groups_each_messages_holds_by_offering(adaptive, broker):
    # given: 1,000 holds about 30 s late, taken in turn on 10 offerings: hold p, on offering
    # p % 10, expired a millisecond after hold p - 1 (the claim takes them oldest first)
    from reservations.models import Reservation
    from tools.seed import seed_holds

    seed_holds(
        1_000,
        offerings=10,
        expires_in=lambda p: -30.0 + p / 1000,
        name="grouped",
        interleave=True,
        anchor=datetime.now(UTC),
    )
    offering_of = dict(Reservation.objects.values_list("id", "offering_id"))
    # when
    sweep_shard(0, 1, batch_size=500)
    # then: messages of several holds, each naming few offerings: a release locks every
    # offering its message names, so messages of one batch lock disjoint ones (an offering
    # spans at most two neighbouring messages)
    named = [{offering_of[h] for h in holds_in(m)} for _, m in queued_messages()]
    assert len(named) < 1_000
    assert sum(len(offerings) for offerings in named) <= len(named) + 2 * (10 - 1)
    assert sorted(h for _, m in queued_messages() for h in holds_in(m)) == sorted(offering_of)


@pytest.mark.django_db(transaction=True)
def test_the_measured_rate_is_read_only_when_the_floor_would_batch(adaptive, broker, monkeypatch):
    reads: list[int] = []

    def measured() -> float:
        reads.append(1)
        return 10_000.0  # a fast fleet: 80,000 messages servable within the target

    monkeypatch.setattr(sizing, "_messages_per_second", measured)
    seed_expired(30, seconds_ago=1)
    sweep_shard(0, 1)
    assert reads == []  # 30 holds fit at the floor: no query
    redis_client().flushdb()
    seed_expired(1_000, seconds_ago=1)
    result = sweep_shard(0, 1, batch_size=500)
    # the floor would have batched; the measured fleet keeps up with one hold per message
    assert reads == [1]  # once per sweep run
    assert (result.messages, result.largest_message) == (1_000, 1)


def test_the_fleet_starts_at_its_floor_until_the_queue_needs_a_reading(settings):
    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 20  # the floor: 20 messages a second
    reads: list[int] = []

    def measured() -> float:
        reads.append(1)
        return 50.0

    rate = sizing.ServiceRate(read=measured)
    assert rate.starts_within(10, 199) == 200  # the floor already starts more: no reading
    assert reads == []
    assert rate.starts_within(10, 200) == 500  # the measured rate, higher than the floor
    assert rate.starts_within(10, 900) == 500
    assert reads == [1]  # read once per run
    assert sizing.ServiceRate(read=lambda: 5.0).starts_within(10, 300) == 200  # never below


def test_the_due_backlog_is_counted_only_as_far_as_the_size_can_still_grow(settings):
    # given: a fleet at 20 messages/s (its floor and its reading), a target of 10 s, a full
    # batch of 500 holds due now, and a million more due behind it
    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 20
    now = datetime.now(UTC)
    batch = [sizing.ClaimedReservation(i, 1, now, i % 1024, 1, False, 1) for i in range(1, 501)]
    bounds: list[int] = []

    def due_behind(bound: int) -> int:
        bounds.append(bound)
        return min(bound, 1_000_000)

    def sized(depth: int) -> sizing.ReleaseSize:
        return sizing.size_batch(
            batch, depth, sizing.ServiceRate(read=lambda: 20.0), now, due_behind=due_behind
        )

    # when the queue ahead alone outlasts the budget (300 messages, 200 servable in 10 s):
    # the largest messages, and no count
    assert (sized(300).size, sized(300).reason, bounds) == (500, "behind", [])
    # when 100 are ahead (100 servable): counted only up to the cap's need, 100 + 500 × 100
    decided = sized(100)
    assert (decided.size, decided.due, bounds) == (500, 50_001, [50_101])


@pytest.mark.django_db(transaction=True)
def test_the_measured_rate_counts_messages_not_holds(adaptive, broker):
    from cleanup.models import CleanupReceipt

    ids = seed_expired(6, seconds_ago=1)
    now_rows = [
        CleanupReceipt(
            idempotency_key=f"release:{rid}:1",
            reservation_id=rid,
            version=1,
            outcome="released",
            task_id="batch-task" if i < 4 else f"task-{i}",
        )
        for i, rid in enumerate(ids)
    ]
    CleanupReceipt.objects.bulk_create(now_rows)
    # 4 holds in one message + 2 single messages = 3 messages in the window
    assert sizing._messages_per_second() == 3 / sizing.RATE_WINDOW_S


# --- Turns near the cap ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_full_batch_is_sized_for_the_holds_due_behind_it(adaptive, broker, monkeypatch, caplog):
    # given: 6,000 holds due, a fleet measured at 400 messages/s (3,600 servable in the 9 s
    # left of the target), and batches of 500: one batch alone fits one hold per message
    monkeypatch.setattr(sizing, "_messages_per_second", lambda: 400.0)
    seed_expired(6_000, seconds_ago=1)
    caplog.set_level(logging.INFO, logger="cleanup.sweep")
    # when: a sweep claims one full batch
    result = sweep_shard(0, 1, batch_size=500, max_batches=1)
    # then: it sized its messages for the 6,000 due, not for its 500 alone
    (line,) = [r for r in caplog.records if r.getMessage() == "release size chosen"]
    assert (line.claimed, line.due, line.rate_source) == (500, 6_000, "measured")
    assert line.size == 2 and line.reason == "backlog"
    assert (result.published, result.messages, result.largest_message) == (500, 250, 2)


@pytest.mark.django_db(transaction=True)
def test_a_sweep_run_counts_the_due_backlog_once_and_a_partial_batch_never(
    adaptive, broker, monkeypatch, caplog
):
    # given: a fleet measured at 400 messages/s and a count that says how often it is read
    monkeypatch.setattr(sizing, "_messages_per_second", lambda: 400.0)
    counted: list[int] = []
    real = sizing._eligible_in_all_shards

    def count(bound: int) -> int:
        counted.append(bound)
        return real(bound)

    monkeypatch.setattr(sizing, "_eligible_in_all_shards", count)
    seed_expired(2_400, seconds_ago=1)
    caplog.set_level(logging.DEBUG, logger="cleanup.sweep")
    # when: shard 0 of 2 (about half the holds) is swept in batches of 500
    result = sweep_shard(0, 2, batch_size=500, max_batches=5)
    # then: one count, at the first full batch, and it sizes the run's last, partial batch
    # too: that batch empties shard 0, not shard 1, whose holds are still due
    lines = [r for r in caplog.records if r.getMessage() == "release size chosen"]
    assert result.batches == len(lines) == 3 and len(counted) == 1
    assert [line.claimed for line in lines][:2] == [500, 500] and lines[2].claimed < 500
    assert lines[2].due == 2_400 - lines[0].messages - lines[1].messages > lines[2].claimed
    # and a light run (one partial batch) never counts
    seed_expired(30, seconds_ago=1)
    sweep_shard(1, 2, batch_size=5_000)
    assert len(counted) == 1
