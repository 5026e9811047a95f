"""The adaptive release mode (the default): how many holds each release message carries, and
the sweeps' turns near the queue's cap.

The sizing function is pure (``cleanup.release.sizing``); the sweep tests run the product's
sweep in process against the tests' PostgreSQL and Redis database, and read what it published
from the broker, as a worker would receive it.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest
from prometheus_client import REGISTRY

from cleanup.broker.readers import priority_keys, queue_depth, redis_client
from cleanup.release import sizing
from cleanup.release.admission import fair_share, near_the_cap
from cleanup.release.sizing import choose_release_size, split_evenly
from cleanup.release.sweep import sweep_shard
from reservations.models import Reservation
from tools.seed import seed_holds


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


def expired(count: int, seconds_ago: float, offerings: int = 2) -> list[int]:
    return seed_holds(count, offerings=offerings, expires_in=-seconds_ago, name="sizing")


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"reservation_cleanup_{name}_total", labels) or 0.0


@pytest.fixture
def adaptive(settings: Any) -> Any:
    settings.CLEANUP_RELEASE_MODE = "adaptive"
    settings.CLEANUP_RELEASE_TARGET_SECONDS = 10
    settings.CLEANUP_RELEASE_BATCH_SIZE = 100
    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 0
    settings.CLEANUP_AUTOSCALE_SERVICE_TIME = 0.05  # a floor of 20 messages/s
    sizing._last_sizing.clear()
    return settings


@pytest.mark.django_db(transaction=True)
def test_a_light_sweep_publishes_one_per_reservation_message_per_hold(adaptive, broker, caplog):
    ids = expired(30, seconds_ago=1)
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
    ids = expired(1_000, seconds_ago=1)
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
def test_the_measured_rate_is_read_only_when_the_floor_would_batch(adaptive, broker, monkeypatch):
    reads: list[int] = []

    def measured() -> float:
        reads.append(1)
        return 10_000.0  # a fast fleet: 80,000 messages servable within the target

    monkeypatch.setattr(sizing, "_messages_per_second", measured)
    expired(30, seconds_ago=1)
    sweep_shard(0, 1)
    assert reads == []  # 30 holds fit at the floor: no query
    redis_client().flushdb()
    expired(1_000, seconds_ago=1)
    result = sweep_shard(0, 1, batch_size=500)
    # the floor would have batched; the measured fleet keeps up with one hold per message
    assert reads == [1]  # once per sweep run
    assert (result.messages, result.largest_message) == (1_000, 1)


@pytest.mark.django_db(transaction=True)
def test_the_measured_rate_counts_messages_not_holds(adaptive, broker):
    from cleanup.models import CleanupReceipt

    ids = expired(6, seconds_ago=1)
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


@pytest.mark.django_db(transaction=True)
def test_near_the_cap_every_shard_publishes_in_every_round(settings, broker):
    # given: a cap of 40 messages, 4 shards each with more due holds than the whole cap
    settings.CLEANUP_RELEASE_MODE = "single"
    settings.CLEANUP_MAX_QUEUE_DEPTH = 40
    ids = expired(400, seconds_ago=5, offerings=4)
    shard_of = {
        rid: bucket % 4
        for rid, bucket in Reservation.objects.filter(pk__in=ids).values_list("pk", "bucket")
    }
    assert all(list(shard_of.values()).count(shard) > 40 for shard in range(4))
    rounds: list[dict[int, int]] = []
    for _ in range(3):
        # when: the four sweeps of one beat interval run, then the workers drain the queue
        published = {shard: sweep_shard(shard, 4).published for shard in range(4)}
        rounds.append(published)
        assert queue_depth("cleanup") <= 40
        redis_client().flushdb()
    # then: in every round every shard published (before, shard 0 took all 40 and the others
    # found the queue full), and no sweep took more than an equal share of the room it found
    for published in rounds:
        assert all(n > 0 for n in published.values()), rounds
        assert published[0] == 10  # ceil(40 / 4)
    # and over the rounds the first shard published less than the other three together
    firsts = sum(r[0] for r in rounds)
    others = sum(r[s] for r in rounds for s in (1, 2, 3))
    assert firsts < others


@pytest.mark.django_db(transaction=True)
def test_a_sweep_waits_in_line_for_the_publish_lock_at_most_the_lock_wait(settings, broker):
    # given: another session holds the publish lock; the lock wait is 0.3 s, the budget 600 s
    import threading

    from django.db import connection, connections

    from cleanup.release import locks

    settings.CLEANUP_SWEEP_TIME_BUDGET = 600
    settings.CLEANUP_SWEEP_LOCK_WAIT = 0.3
    ids = expired(5, seconds_ago=1)
    other = connections.create_connection("default")
    results: list[Any] = []

    def sweep() -> None:
        try:
            results.append(sweep_shard(0, 1))
            with connection.cursor() as cur:
                cur.execute("SHOW lock_timeout")
                results.append(cur.fetchone()[0])
        finally:
            connection.close()

    thread = threading.Thread(target=sweep)
    try:
        with other.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(%s, %s)", list(locks.SWEEP_PUBLISH))
        # when: a sweep runs while the lock stays taken
        thread.start()
        thread.join(60)  # far beyond the lock wait: still running means it waits its budget
        still_waiting = thread.is_alive()
    finally:
        other.close()
        thread.join(60)
    # then: it gave its pool process back without the lock, long before its budget, claimed
    # nothing, and its session's lock_timeout is back to the default
    assert not still_waiting, "the sweep waited for the publish lock beyond its lock wait"
    result, lock_timeout = results
    assert result.budget_exhausted is True
    assert (result.claimed, result.published) == (0, 0)
    assert set(Reservation.objects.filter(pk__in=ids).values_list("claim_count", flat=True)) == {0}
    assert lock_timeout == "0"
    assert sweep_shard(0, 1).published == 5


@pytest.mark.django_db(transaction=True)
def test_a_failed_batch_is_dead_lettered_hold_by_hold_and_each_letter_settles_alone(broker):
    # given: a release batch of three holds that ran out of retries
    from django.db import OperationalError
    from django.utils import timezone

    from cleanup.models import CleanupReceipt, DeadLetter
    from cleanup.release import dead_letters
    from cleanup.release.messages import build_batch
    from cleanup.tasks import release_batch_task

    ids = expired(3, seconds_ago=1, offerings=1)
    message = build_batch([(rid, 1, timezone.now()) for rid in ids], 0, "failed-batch")
    # when: its final failure is dead-lettered (as the task does before acknowledging it)
    release_batch_task.push_request(id="task-1", retries=5)
    try:
        stored = release_batch_task._dead_letter_failure(
            OperationalError("db gone"), (message,), {}
        )
    finally:
        release_batch_task.pop_request()
    assert stored is not None
    # then: one letter per hold, each naming its hold and its key
    letters = list(DeadLetter.objects.order_by("reservation_id"))
    assert [(d.reservation_id, d.version, d.idempotency_key, d.reason) for d in letters] == [
        (rid, 1, f"release:{rid}:1", "retries_exhausted") for rid in sorted(ids)
    ]
    assert {d.task_id for d in letters} == {"task-1"}
    # and a later release of one of the holds settles that hold's letter only
    CleanupReceipt.objects.create(
        idempotency_key=f"release:{ids[0]}:1", reservation_id=ids[0], version=1, outcome="released"
    )
    assert dead_letters.resolve_released() == 1
    assert DeadLetter.objects.filter(resolved_at__isnull=True).count() == 2


@pytest.mark.django_db(transaction=True)
def test_the_last_sweep_shows_messages_and_holds_on_the_health_page(adaptive, broker, admin_client):
    from cleanup.operations.console import health

    expired(1_000, seconds_ago=1, offerings=2)
    result = sweep_shard(0, 1, batch_size=500)
    health.record_sweep(result)
    page = admin_client.get("/admin/cleanup/health/").content.decode()
    assert f'data-metric="published">{result.published}<' in page
    assert f'data-metric="messages">{result.messages}<' in page
    assert f"up to {result.largest_message} ({result.sizing_reason})" in page


@pytest.mark.django_db(transaction=True)
def test_a_batch_attempt_log_line_names_each_hold_with_its_outcome(broker, caplog):
    # given: a batch of three expired holds, one of them renewed after its message was built
    from datetime import timedelta

    from django.utils import timezone

    from cleanup.release.messages import build_batch
    from cleanup.tasks import release_batch_task

    ids = expired(3, seconds_ago=1, offerings=1)
    message = build_batch([(rid, 1, timezone.now()) for rid in ids], 0, "named-batch")
    Reservation.objects.filter(pk=ids[1]).update(
        version=2, expires_at=timezone.now() + timedelta(minutes=5)
    )
    caplog.set_level(logging.INFO, logger="cleanup.tasks")
    # when: a worker runs it
    release_batch_task.push_request(id="task-named", retries=0)
    try:
        release_batch_task(message)
    finally:
        release_batch_task.pop_request()
    # then: its log line names which hold ended how, not only the counts
    (line,) = [r for r in caplog.records if r.getMessage() == "release batch attempt"]
    assert line.holds_by_outcome == {  # type: ignore[attr-defined]
        "released": [ids[0], ids[2]],
        "renewed": [ids[1]],
    }
    assert line.outcomes == {"released": 2, "renewed": 1}  # type: ignore[attr-defined]


@pytest.mark.django_db(transaction=True)
def test_a_full_batch_is_sized_for_the_holds_due_behind_it(adaptive, broker, monkeypatch, caplog):
    # given: 6,000 holds due, a fleet measured at 400 messages/s (3,600 servable in the 9 s
    # left of the target), and batches of 500: one batch alone fits one hold per message
    monkeypatch.setattr(sizing, "_messages_per_second", lambda: 400.0)
    expired(6_000, seconds_ago=1)
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
    expired(2_400, seconds_ago=1)
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
    expired(30, seconds_ago=1)
    sweep_shard(1, 2, batch_size=5_000)
    assert len(counted) == 1
