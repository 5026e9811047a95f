"""The sweep under trouble, in process (real PostgreSQL, the tests' own Redis database): the
per-shard lock, the publish-lock timeout and time budget, the soft time limit, advisory locks
leaked by an interrupted sweep, backpressure, and the sweep counters.

Other sessions holding advisory locks stand in for "another worker's sweep": they are real
PostgreSQL sessions holding the same keys the product takes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.db import connection
from django.db.backends.base.base import BaseDatabaseWrapper

from cleanup.broker.readers import queue_depth, redis_client
from cleanup.release import admission, claim, locks
from cleanup.release import sweep as sweep_module
from cleanup.release.messages import BatchMessage, ReleaseMessage
from cleanup.release.publish import publish_release_messages
from cleanup.release.sweep import SweepResult, sweep_shard
from reservations.models import Reservation
from tests.support.holds import claim_counts, due_now, expired_holds, seed_expired
from tests.support.metrics import counter

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("broker")]

LOCK_NAMESPACE = locks.NAMESPACE
PUBLISH_LOCK = locks.SWEEP_PUBLISH[1]


def shard_lock_key(shard: int, shards: int) -> int:
    return locks.sweep_shard(shard, shards)[1]


def _lock(session: BaseDatabaseWrapper, key: int) -> None:
    with session.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_NAMESPACE, key])


def _unlock(session: BaseDatabaseWrapper, key: int) -> None:
    with session.cursor() as cur:
        cur.execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_NAMESPACE, key])


def _free(session: BaseDatabaseWrapper, key: int) -> bool:
    """Whether ``session`` can take the lock (it lets go at once if so)."""
    with session.cursor() as cur:
        cur.execute("SELECT pg_try_advisory_lock(%s, %s)", [LOCK_NAMESPACE, key])
        got = bool(cur.fetchone()[0])
        if got:
            cur.execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_NAMESPACE, key])
        return got


def _lock_holders(key: int, granted: bool = True) -> int:
    """Sessions holding the advisory lock ``key`` (``granted=False``: waiting for it)."""
    with connection.cursor() as cur:
        cur.execute(
            # this database's locks only: a test run beside this one (its own database on the
            # same server) takes the same keys
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted = %s "
            "AND classid = %s AND objid = %s "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            [granted, LOCK_NAMESPACE, key],
        )
        return int(cur.fetchone()[0])


def sweep_in_a_thread(
    shard: int, shards: int, **kwargs: Any
) -> tuple[threading.Thread, list[SweepResult], list[BaseException]]:
    """A sweep started in a thread of its own (another worker's sweep, with its own database
    connection, closed when it ends); its result or its error is appended to the lists."""
    results: list[SweepResult] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(sweep_shard(shard, shards, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results, errors


def test_a_second_sweep_of_a_shard_being_swept_skips_at_once(other_session, settings):
    # given: sweep A of shard 0 holds its shard lock and waits for the publish lock, which
    # another session holds (a sweep of another shard publishing)
    settings.CLEANUP_SWEEP_TIME_BUDGET = 60
    ids = expired_holds(20)
    _lock(other_session, PUBLISH_LOCK)
    thread, results, errors = sweep_in_a_thread(0, 1, trace_id="sweep-a")
    try:
        deadline = time.monotonic() + 30
        while _lock_holders(shard_lock_key(0, 1)) == 0:
            assert time.monotonic() < deadline, "sweep A never took its shard lock"
            time.sleep(0.05)
        # when: sweep B of the same shard runs meanwhile
        second = sweep_shard(0, 1, trace_id="sweep-b")
        # then: B skipped without waiting for the publish lock and claimed nothing
        assert second.skipped_locked is True
        assert (second.claimed, second.published, second.budget_exhausted) == (0, 0, False)
        assert claim_counts(ids) == {0}
        # while a sweep of shard 0 under another shard count (the schedule's N just changed)
        # is not skipped by A's shard lock: it waits for the publish lock like any sweep, and
        # here gives up at its (short) budget without claiming
        settings.CLEANUP_SWEEP_TIME_BUDGET = 0.3
        resharded = sweep_shard(0, 2, trace_id="sweep-c")
        assert (resharded.skipped_locked, resharded.budget_exhausted) == (False, True)
        assert claim_counts(ids) == {0}
    finally:
        _unlock(other_session, PUBLISH_LOCK)
        thread.join(60)
    # and A, once it gets the publish lock, does the work
    assert errors == []
    (first,) = results
    assert (first.skipped_locked, first.claimed, first.published) == (False, 20, 20)
    assert claim_counts(ids) == {1}
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 20
    # and it let go of its shard lock: the next sweep of the shard is not skipped
    assert sweep_shard(0, 1).skipped_locked is False


def test_a_sweep_that_cannot_get_the_publish_lock_in_its_budget_claims_nothing(
    other_session, settings
):
    # given: another session holds the publish lock for longer than the sweep's budget
    settings.CLEANUP_SWEEP_TIME_BUDGET = 0.5
    ids = expired_holds(5)
    _lock(other_session, PUBLISH_LOCK)
    try:
        # when
        result = sweep_shard(0, 1)
    finally:
        _unlock(other_session, PUBLISH_LOCK)
    # then: it gave up (budget exhausted), claimed and published nothing, left no lock behind
    assert result.budget_exhausted is True
    assert (result.claimed, result.published, result.batches) == (0, 0, 0)
    assert claim_counts(ids) == {0}
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    assert _free(other_session, shard_lock_key(0, 1))
    # and the next sweep does the work
    assert sweep_shard(0, 1).published == 5


def test_a_sweep_stops_between_batches_when_its_time_budget_is_spent(settings, monkeypatch):
    # given: three batches of work, and a budget that runs out after the first batch
    settings.CLEANUP_SWEEP_TIME_BUDGET = 30
    ids = expired_holds(30)
    real_publish = publish_release_messages
    published_batches: list[int] = []

    def publish_then_spend_the_budget(messages: list[ReleaseMessage | BatchMessage]) -> None:
        real_publish(messages)
        published_batches.append(len(messages))
        clock_skip[0] = 3600.0

    clock_skip = [0.0]
    real_monotonic = time.monotonic
    monkeypatch.setattr(
        "cleanup.release.sweep.publish_release_messages", publish_then_spend_the_budget
    )
    # the sweep's own clock jumps an hour once the first batch is published
    monkeypatch.setattr(
        sweep_module,
        "time",
        SimpleNamespace(
            monotonic=lambda: real_monotonic() + clock_skip[0],
            perf_counter=time.perf_counter,
            sleep=time.sleep,
        ),
    )
    # when
    result = sweep_shard(0, 1, batch_size=10)
    # then: one batch published, then it stopped with its budget spent; the rest waits, unclaimed
    assert published_batches == [10]
    assert result.budget_exhausted is True
    assert (result.batches, result.claimed, result.published) == (1, 10, 10)
    assert sorted(Reservation.objects.filter(pk__in=ids).values_list("claim_count", flat=True)) == (
        [0] * 20 + [1] * 10
    )


def test_a_sweep_interrupted_by_its_soft_time_limit_lets_go_of_its_locks(
    other_session, settings, monkeypatch
):
    # given: the soft time limit fires during the publish, before the claim commits
    ids = expired_holds(5)

    def soft_limit(messages: list[ReleaseMessage | BatchMessage]) -> None:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr("cleanup.release.sweep.publish_release_messages", soft_limit)
    # when
    result = sweep_shard(0, 1)
    # then: the sweep reports it and returns (a periodic task, not poison)
    assert result.timed_out is True
    assert result.published == 0
    # the claim rolled back: the holds are due again at once, nothing was published
    assert claim_counts(ids) == {0}
    assert due_now(ids) == set(ids)
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    # and no lock is left: another session can take the shard and the publish lock
    assert _free(other_session, shard_lock_key(0, 1))
    assert _free(other_session, PUBLISH_LOCK)


def test_a_publish_that_fails_leaves_the_batch_due_at_once_not_leased(monkeypatch):
    # given: the broker refuses the fan-out (its claim has not committed yet)
    ids = expired_holds(5)

    def broker_down(messages: list[ReleaseMessage | BatchMessage]) -> None:
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr("cleanup.release.sweep.publish_release_messages", broker_down)
    # when
    with pytest.raises(ConnectionError):
        sweep_shard(0, 1)
    # then: nothing is leased without a message: the next sweep takes the same holds at once
    assert claim_counts(ids) == {0}
    assert due_now(ids) == set(ids)
    monkeypatch.undo()
    assert sweep_shard(0, 1).published == len(ids)
    assert claim_counts(ids) == {1}


def test_a_sweep_drops_advisory_locks_leaked_on_its_connection(other_session):
    # given: an earlier run on this (pooled) connection was interrupted holding both locks
    ids = expired_holds(3)
    _lock(connection, shard_lock_key(0, 1))
    _lock(connection, PUBLISH_LOCK)
    assert not _free(other_session, shard_lock_key(0, 1))
    # when
    result = sweep_shard(0, 1)
    # then: it swept, and afterwards neither lock is held (other workers can sweep the shard)
    assert (result.skipped_locked, result.published) == (False, 3)
    assert claim_counts(ids) == {1}
    assert _free(other_session, shard_lock_key(0, 1))
    assert _free(other_session, PUBLISH_LOCK)


def test_backpressure_stops_the_sweep_and_the_counters_move(settings):
    # given: the release queue is already at the cap
    settings.CLEANUP_MAX_QUEUE_DEPTH = 3
    queued = expired_holds(3, name="queued")
    publish_release_messages(
        [
            ReleaseMessage.for_hold(i, 1, Reservation.objects.get(pk=i).expires_at, 0, "q")
            for i in queued
        ]
    )
    Reservation.objects.filter(pk__in=queued).update(status="cancelled")
    waiting = expired_holds(4, name="waiting")
    before = {
        name: counter(name, shard="0") for name in ("claimed", "published", "backpressure_pauses")
    }
    # when
    paused = sweep_shard(0, 1)
    # then: nothing claimed, one pause counted
    assert paused.backpressure is True and paused.claimed == 0
    assert claim_counts(waiting) == {0}
    assert counter("backpressure_pauses", shard="0") == before["backpressure_pauses"] + 1
    assert counter("claimed", shard="0") == before["claimed"]
    # when: the queue drains and a sweep runs
    redis_client().flushdb()
    done = sweep_shard(0, 1)
    # then: it claimed and published waiting holds up to the cap (3 of 4: the room left), which
    # is a pause again, and the counters say so
    assert (done.backpressure, done.claimed, done.published) == (True, 3, 3)
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 3
    assert counter("claimed", shard="0") == before["claimed"] + 3
    assert counter("published", shard="0") == before["published"] + 3
    assert counter("backpressure_pauses", shard="0") == before["backpressure_pauses"] + 2
    # and once that drains too, the next sweep takes the last one
    redis_client().flushdb()
    assert sweep_shard(0, 1).published == 1
    assert claim_counts(waiting) == {1}


def fill_the_queue(count: int) -> None:
    """``count`` release messages waiting in the queue, for holds no longer held."""
    queued = expired_holds(count, name="queued")
    publish_release_messages(
        [
            ReleaseMessage.for_hold(i, 1, Reservation.objects.get(pk=i).expires_at, 0, "q")
            for i in queued
        ]
    )
    Reservation.objects.filter(pk__in=queued).update(status="cancelled")


@pytest.mark.parametrize("mode", ["adaptive", "single"])
def test_a_queue_that_outlasts_the_release_target_pauses_the_adaptive_sweep(settings, mode, caplog):
    # given: a fleet that starts 20 messages a second (its floor, no receipts yet) and a release
    # target of 0.2 s: it starts 2 messages within half the target; 2 are waiting, far below
    # the cap
    settings.CLEANUP_RELEASE_MODE = mode
    settings.CLEANUP_CAPACITY_PER_CONSUMER_PER_S = 20
    settings.CLEANUP_RELEASE_TARGET_SECONDS = 0.2
    fill_the_queue(2)
    waiting = expired_holds(3, name="waiting")
    caplog.set_level("INFO", logger="cleanup.sweep")
    # when
    result = sweep_shard(0, 1)
    # then: the adaptive sweep claims nothing (its holds would wait behind that queue anyway)
    # and says why; the single mode, which sizes nothing, still fills up to the cap
    if mode == "adaptive":
        assert (result.backpressure, result.claimed) == (True, 0)
        assert claim_counts(waiting) == {0}
        (line,) = [r for r in caplog.records if r.getMessage() == "sweep paused by backpressure"]
        assert (line.queue_depth, line.fleet_starts) == (2, 2.0)  # type: ignore[attr-defined]
    else:
        assert (result.backpressure, result.claimed) == (False, 3)
    # and once one message has drained, the adaptive sweep claims again
    redis_client().flushdb()
    fill_the_queue(1)
    assert sweep_shard(0, 1).claimed == (3 if mode == "adaptive" else 0)


def queue_near_its_cap(settings: Any, cap: int, queued: int, due: int) -> list[int]:
    """A release queue capped at ``cap`` with ``queued`` messages waiting, sweeps that wait
    30 s in line for the publish lock (a wait ``sweep_seen_from_pg_locks`` cannot miss), and
    ``due`` holds waiting to be claimed (their ids)."""
    settings.CLEANUP_MAX_QUEUE_DEPTH = cap
    settings.CLEANUP_SWEEP_LOCK_WAIT = 30.0
    settings.CLEANUP_SWEEP_TIME_BUDGET = 60
    fill_the_queue(queued)
    return expired_holds(due, name="waiting")


def sweep_seen_from_pg_locks(
    other_session: BaseDatabaseWrapper, shard: int, shards: int
) -> SweepResult:
    """A sweep run in a thread while ``other_session`` holds the publish lock, watched in
    ``pg_locks``: it fails as soon as the sweep is seen waiting in line for that lock (a wait
    lasts ``CLEANUP_SWEEP_LOCK_WAIT``, long enough to be seen), else returns its result. On a
    failure the lock is let go so the waiting sweep ends before the test does."""
    thread, results, errors = sweep_in_a_thread(shard, shards)
    try:
        deadline = time.monotonic() + 60
        while thread.is_alive():
            assert _lock_holders(PUBLISH_LOCK, granted=False) == 0, (
                "the sweep waited in line for the publish lock"
            )
            assert time.monotonic() < deadline, "the sweep never ended"
            thread.join(0.02)
    except AssertionError:
        _unlock(other_session, PUBLISH_LOCK)
        raise
    finally:
        thread.join(60)
    assert errors == []
    (result,) = results
    return result


def test_a_sweep_that_finds_the_queue_full_leaves_without_waiting_in_line(other_session, settings):
    # given: the release queue is at its cap, and another sweep holds the publish lock (and
    # would for longer than this sweep waits in line)
    waiting = queue_near_its_cap(settings, cap=3, queued=3, due=4)
    pauses = counter("backpressure_pauses", shard="0")
    _lock(other_session, PUBLISH_LOCK)
    try:
        # when
        result = sweep_seen_from_pg_locks(other_session, 0, 1)
    finally:
        _unlock(other_session, PUBLISH_LOCK)
    # then: it never got in line for the publish lock (pg_locks), and left as a backpressure
    # pause, not as a sweep that ran out of time in line
    assert (result.backpressure, result.budget_exhausted) == (True, False)
    assert (result.batches, result.claimed, result.published) == (0, 0, 0)
    assert counter("backpressure_pauses", shard="0") == pauses + 1
    assert claim_counts(waiting) == {0}
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 3


def test_near_the_cap_a_sweep_leaves_when_the_sweeps_ahead_take_the_room(other_session, settings):
    # given: 4 shards under a cap of 8 (a fair share of 2 holds), 7 messages queued (room for
    # 1), and another sweep holding the publish lock: it takes up to its share, all the room
    waiting = queue_near_its_cap(settings, cap=8, queued=7, due=40)
    _lock(other_session, PUBLISH_LOCK)
    try:
        # when
        spoken_for = sweep_seen_from_pg_locks(other_session, 0, 4)
        # then: it never got in line for the publish lock (pg_locks), a backpressure pause
        # claiming nothing
        assert (spoken_for.backpressure, spoken_for.budget_exhausted) == (True, False)
        assert spoken_for.claimed == 0
        # when: the queue drains to 4 (room for 2 shares, one sweep ahead)
        redis_client().flushdb()
        fill_the_queue(4)
        settings.CLEANUP_SWEEP_LOCK_WAIT = 0.3
        in_line = sweep_shard(0, 4)
        # then: the room is more than the sweep ahead takes: it waited in line (here until its
        # wait ran out, the other session never letting go), as before
        assert (in_line.backpressure, in_line.budget_exhausted) == (False, True)
    finally:
        _unlock(other_session, PUBLISH_LOCK)
    assert claim_counts(waiting) == {0}
    # and with nobody ahead, a sweep takes even a room smaller than its share: the queue is
    # refilled to its cap
    settings.CLEANUP_MAX_QUEUE_DEPTH = 5
    published = [sweep_shard(shard, 4).published for shard in range(4)]
    assert sum(published) == 1
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 5


def test_a_set_aside_hold_moves_the_dead_letter_counter(settings):
    settings.CLEANUP_MAX_CLAIMS = 1
    ids = expired_holds(2)
    Reservation.objects.filter(pk__in=ids).update(claim_count=1)
    before = counter("dead_letters", reason="claims_exhausted")
    # when
    result = sweep_shard(0, 1)
    # then
    assert (result.set_aside, result.published) == (2, 0)
    assert counter("dead_letters", reason="claims_exhausted") == before + 2


def test_a_batch_with_holds_set_aside_and_published_counts_each_once(settings):
    # given: three expired holds, one of them already claimed as often as allowed
    settings.CLEANUP_MAX_CLAIMS = 1
    ids = expired_holds(3, name="mixed")
    Reservation.objects.filter(pk=ids[0]).update(claim_count=1)
    # when: a sweep claims them in one batch
    result = sweep_shard(0, 1)
    # then: its result (the sweep's log line) counts the hold set aside and the two published
    assert (result.claimed, result.set_aside, result.published) == (3, 1, 2)
    assert sorted(result.published_ids) == sorted(ids[1:])


def shard_backlogs(shards: int, per_shard: int) -> dict[int, list[int]]:
    """``per_shard`` due holds in each shard, the n-th oldest of every shard expired at the same
    moment (one second apart, the oldest 10 minutes ago)."""
    from datetime import timedelta

    from django.utils import timezone

    ids = expired_holds(shards * per_shard, name="backlogs")
    by_shard: dict[int, list[int]] = {s: [] for s in range(shards)}
    for hold in Reservation.objects.filter(pk__in=ids).order_by("pk"):
        by_shard[hold.bucket % shards].append(hold.pk)
    start = timezone.now() - timedelta(minutes=10)
    for held in by_shard.values():
        for n, pk in enumerate(held):
            Reservation.objects.filter(pk=pk).update(expires_at=start + timedelta(seconds=n))
    return by_shard


def drain(count: int, queue: str) -> None:
    """The workers' part: take ``count`` messages off the release queue (the holds stay leased)."""
    for _ in range(count):
        redis_client().rpop(queue)


def rounds_near_the_cap(settings: Any) -> tuple[dict[int, int], list[float]]:
    """4 shards with 30 due holds each (the n-th oldest of each the same age), a cap of 8 (a
    share of 2), batches of 4, and the workers draining 4 messages per round: near the cap
    every round, with room for two shares. 10 rounds of sweeps in shard order (as beat sends
    them), draining in between. Returns what each shard published and, after each round, how
    far apart the shards' oldest due holds were (seconds)."""
    settings.CLEANUP_MAX_QUEUE_DEPTH = 8
    settings.CLEANUP_SWEEP_BATCH_SIZE = 4
    settings.CLEANUP_SWEEP_TIME_BUDGET = 60
    settings.CLEANUP_RELEASE_MODE = "single"
    settings.CLEANUP_LEASE_SECONDS = 300  # no claimed hold comes due again meanwhile
    backlogs = shard_backlogs(4, 30)
    queue = settings.CLEANUP_RELEASE_QUEUE
    published = {s: 0 for s in range(4)}
    spreads = []
    for _ in range(10):
        for shard in range(4):
            published[shard] += sweep_shard(shard, 4).published
            # never past the cap
            assert queue_depth(queue) <= 8
        ages = claim.oldest_due_by_shard(4)
        spreads.append(round(max(ages.values()) - min(ages.values()), 1))
        drain(4, queue)
    assert all(due_now(held) for held in backlogs.values())
    return published, spreads


def test_near_the_cap_the_shards_take_turns_by_how_far_behind_they_are(settings):
    # given/when: rounds of sweeps near the cap
    published, spreads = rounds_near_the_cap(settings)
    # then: the drain was what the cap allows (8, then 4 per round), every shard got turns,
    # and the shards' oldest due holds stayed within the slack and a share (2 s) of each other
    # (on shard order alone shards 2 and 3 published nothing after the first round, and
    # their oldest holds fell 2 s further behind shard 0's every round)
    assert sum(published.values()) == 8 + 9 * 4
    assert min(published.values()) >= 8, (published, spreads)
    assert max(spreads) <= admission.TURN_SLACK_S + 2, spreads


# --- Far from the cap: room reserved, the publish lock let go before the claim ---------------

PARK_KEY = 999_001  # the test's own lock: a parked claim waits on it


@pytest.fixture
def parked_claims(other_session: BaseDatabaseWrapper) -> Iterator[BaseDatabaseWrapper]:
    """While the yielded session holds PARK_KEY, every UPDATE of a hold (a sweep's claim) waits
    for it inside its transaction: a real claim held mid-way, no function of ours patched."""
    table = Reservation._meta.db_table
    with connection.cursor() as cur:
        cur.execute(
            "CREATE FUNCTION test_park_claim() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN PERFORM pg_advisory_xact_lock({LOCK_NAMESPACE}, {PARK_KEY}); RETURN NEW; END $$"
        )
        cur.execute(
            f"CREATE TRIGGER test_park_claim BEFORE UPDATE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION test_park_claim()"
        )
    try:
        yield other_session
    finally:
        with connection.cursor() as cur:
            cur.execute(f"DROP TRIGGER IF EXISTS test_park_claim ON {table}")
            cur.execute("DROP FUNCTION IF EXISTS test_park_claim()")


def _reserved_rows() -> dict[int, int]:
    with connection.cursor() as cur:
        cur.execute("SELECT lock_key, holds FROM cleanup_roomclaim")
        return dict(cur.fetchall())


def test_far_from_the_cap_a_sweep_lets_go_of_the_publish_lock_before_it_claims(
    parked_claims, settings
):
    # given: 5 due holds, a queue far from its cap, and claims that wait while the test says so
    settings.CLEANUP_MAX_QUEUE_DEPTH = 1000
    settings.CLEANUP_SWEEP_BATCH_SIZE = 10
    waiting = expired_holds(5)
    _lock(parked_claims, PARK_KEY)
    results: list[SweepResult] = []

    def run_sweep() -> None:
        try:
            results.append(sweep_shard(0, 1))
        finally:
            connection.close()  # this thread's own connection

    sweep = threading.Thread(target=run_sweep)
    sweep.start()
    try:
        # when: the sweep is in its claim
        deadline = time.monotonic() + 10
        while not _lock_holders(PARK_KEY, granted=False):
            assert time.monotonic() < deadline, "the sweep never reached its claim"
            time.sleep(0.02)
        # then: the publish lock is free for the next sweep in line, and the room this batch
        # took (a batch of 10) is reserved under its shard lock
        assert _free(parked_claims, PUBLISH_LOCK)
        assert _reserved_rows() == {shard_lock_key(0, 1): 10}
    finally:
        _unlock(parked_claims, PARK_KEY)
        sweep.join(30)
    # and once the claim goes on, the holds are published and the room is given back
    assert [r.published for r in results] == [5]
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 5
    assert due_now(waiting) == set()
    assert _reserved_rows() == {shard_lock_key(0, 1): 0}


def test_room_another_running_sweep_reserved_is_not_free_until_that_sweep_is_gone(
    other_session, settings
):
    # given: a cap of 5, an empty queue, 8 due holds of shard 0 of 1, and another sweep (shard 1
    # of 2, another worker's session) that holds its shard lock and has reserved 3 holds of room
    settings.CLEANUP_MAX_QUEUE_DEPTH = 5
    waiting = expired_holds(8)
    other_key = shard_lock_key(1, 2)
    _lock(other_session, other_key)
    with other_session.cursor() as cur:
        cur.execute(
            "INSERT INTO cleanup_roomclaim (lock_key, pid, holds) VALUES (%s, pg_backend_pid(), 3)",
            [other_key],
        )
    # when
    narrowed = sweep_shard(0, 1)
    # then: it took only the room left beside that reservation, a backpressure pause
    assert (narrowed.published, narrowed.backpressure) == (2, True)
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 2
    # when: that sweep's session lets go of its shard lock (its worker died, say) without
    # clearing its row, and the queue drains
    _unlock(other_session, other_key)
    redis_client().flushdb()
    # then: the row counts for nothing, and the next sweep fills the queue to its cap
    assert sweep_shard(0, 1).published == 5
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 5
    assert len(due_now(waiting)) == 1


# --- near the cap: every shard in every round, and the publish lock's wait --------------------


@pytest.mark.django_db(transaction=True)
def test_near_the_cap_every_shard_publishes_in_every_round(settings, broker):
    # given: a cap of 40 messages, 4 shards each with more due holds than the whole cap
    settings.CLEANUP_RELEASE_MODE = "single"
    settings.CLEANUP_MAX_QUEUE_DEPTH = 40
    ids = seed_expired(400, seconds_ago=5, offerings=4)
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
    ids = seed_expired(5, seconds_ago=1)
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
