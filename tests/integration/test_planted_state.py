"""Planted broker state against a real worker: a bad entry in kombu's ``unacked`` hash must not
stop the restore of a dead worker's messages.

kombu restores messages whose worker died (their ``unacked`` entries older than the visibility
timeout) newest first, on every scan; one entry it cannot decode used to raise there each time,
so every message stranded before it stayed stranded. Redis only: RabbitMQ keeps no such hash.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from cleanup.broker.readers import redis_client
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from tests.support import fleet

pytestmark = [
    pytest.mark.workers,
    pytest.mark.skipif(not fleet.broker_is_redis(), reason="kombu's unacked hash is Redis only"),
]


# kombu's delivery tags are UUIDs; with equal scores the newest-first scan takes the member that
# sorts last first, so this tag is met before the stranded message's.
PLANTED_TAG = "~planted"


def _plant(client: Any, tag: str, fetched_at: float) -> None:
    """An ``unacked`` entry nested 100,000 deep, fetched at ``fetched_at``."""
    client.hset("unacked", tag, "[" * 100_000 + "]" * 100_000)
    client.zadd("unacked_index", {tag: fetched_at})


def _set_aside_or_stopped(worker: fleet.Worker, letters: int) -> Callable[[], bool]:
    return lambda: not worker.alive() or DeadLetter.objects.count() >= letters


@pytest.mark.parametrize("scan", ["at_start", "while_running"])
def test_a_bad_unacked_entry_is_set_aside_and_a_dead_workers_message_is_still_restored(
    clean, exclusive_workers, tmp_path, scan
):
    """``at_start``: the entries are past the visibility timeout when the next worker starts
    (its consumer's first scan; this stopped the worker before). ``while_running``: the worker
    is already consuming when they become visible (its periodic scan; this stopped the restore
    on every scan before)."""
    # given: worker A parks a release inside its statement and is SIGKILLed whole; the server
    # drops the statement, so the hold is still held and its message stays in kombu's unacked
    # hash, stranded (as in test_delivery.py's whole-worker kill)
    hold_id, offering_id = fleet.one_eligible_hold()
    with fleet.dedicated(tmp_path, {"concurrency": 1}) as (worker_a,):
        with fleet.offering_locked(offering_id):
            fleet.publish_for(hold_id)
            backends = fleet.wait_until(fleet.blocked_backends, timeout=30, what="release waiting")
            worker_a.kill()
            assert fleet.scalar("SELECT pg_terminate_backend(%s)", [backends[0]]) is True
    fleet.wait_until(lambda: not fleet.blocked_backends(), timeout=30, what="the statement dropped")
    assert fleet.status_of(hold_id) == "held"
    client = redis_client()
    index: list[tuple[bytes, float]] = client.zrange("unacked_index", 0, -1, withscores=True)  # type: ignore[assignment]
    ((tag, fetched_at),) = index
    assert client.hexists("unacked", tag)
    # and: a planted entry nested 100,000 deep, fetched at the same instant, which the restore
    # scan meets first
    _plant(client, PLANTED_TAG, fetched_at)
    if scan == "at_start":
        # both past the visibility timeout before another worker starts
        visible_at = fetched_at + cleanup_settings().visibility_timeout + 1
        time.sleep(max(0.0, visible_at - time.time()))

    # when: another worker runs
    with fleet.dedicated(tmp_path, {"concurrency": 1}) as (worker_b,):
        main_pid = worker_b.pid

        # then: its restore brings the stranded message back and the hold is released ...
        def released_or_stopped() -> bool:
            return not worker_b.alive() or fleet.status_of(hold_id) == "released"

        fleet.wait_until(released_or_stopped, timeout=60, what="the stranded hold released")
        assert worker_b.alive() and worker_b.pid == main_pid, worker_b.log_tail(30)
        fleet.wait_until(lambda: fleet.queue_settled(cleanup_settings().release_queue), timeout=30)
        # ... and the planted entry is gone from the hash and its index, as one dead letter
        assert not client.hexists("unacked", PLANTED_TAG)
        assert client.zscore("unacked_index", PLANTED_TAG) is None
        letters = list(DeadLetter.objects.all())
        assert [letter.reason for letter in letters] == [DeadLetter.Reason.REJECTED]
        assert "unacked entry is nested deeper" in letters[0].error
        # and the same main process is still running a few scans later: each of three more
        # planted entries is set aside, as a dead letter, by a later scan of that process
        for later in range(1, 4):
            _plant(client, f"{PLANTED_TAG}-{later}", fetched_at)
            fleet.wait_until(_set_aside_or_stopped(worker_b, 1 + later), timeout=30,
                             what=f"a later scan to set aside planted entry {later}")  # fmt: skip
            assert worker_b.alive() and worker_b.pid == main_pid, worker_b.log_tail(30)
        assert {letter.reason for letter in DeadLetter.objects.all()} == {
            DeadLetter.Reason.REJECTED
        }
    assert fleet.outcome_counts() == {"released": 1}
    assert fleet.invariant_violations(expected_released=[hold_id]) == []


def test_a_restore_lock_planted_again_and_again_does_not_strand_a_dead_workers_message(
    clean, exclusive_workers, tmp_path
):
    """kombu's restore takes a lock in Redis (``unacked_mutex``) and skips its scan while the
    key exists. Planted with an expiry in kombu's own range and planted again before it ends,
    it kept a crashed worker's message stranded for as long as the writer liked (only a lock
    without an expiry, or a longer one, was set aside)."""
    import threading

    # given: worker A SIGKILLed mid-release, its message left unacked (as above)
    hold_id, offering_id = fleet.one_eligible_hold()
    with fleet.dedicated(tmp_path, {"concurrency": 1}) as (worker_a,):
        with fleet.offering_locked(offering_id):
            fleet.publish_for(hold_id)
            backends = fleet.wait_until(fleet.blocked_backends, timeout=30, what="release waiting")
            worker_a.kill()
            assert fleet.scalar("SELECT pg_terminate_backend(%s)", [backends[0]]) is True
    fleet.wait_until(lambda: not fleet.blocked_backends(), timeout=30, what="the statement dropped")
    client = redis_client()
    ((_tag, fetched_at),) = client.zrange("unacked_index", 0, -1, withscores=True)  # type: ignore[misc]
    # and: a broker writer keeps kombu's restore lock held, 3 s at a time, renewed every 0.5 s
    stop = threading.Event()

    def plant_the_lock() -> None:
        planter = redis_client()
        while not stop.is_set():
            planter.set("unacked_mutex", "planted", px=3000)
            stop.wait(0.5)

    planter = threading.Thread(target=plant_the_lock, daemon=True)
    planter.start()
    try:
        # when: another worker runs
        with fleet.dedicated(tmp_path, {"concurrency": 1}) as (worker_b,):
            # then: the stranded message is restored and its hold released within the
            # visibility timeout plus the restore interval (and the time to run it)
            conf = cleanup_settings()
            bound = conf.visibility_timeout + conf.unacked_restore_interval + 5
            fleet.wait_until(
                lambda: fleet.status_of(hold_id) == "released",
                timeout=max(1.0, fetched_at + bound - time.time()),
                what="the stranded hold released while the lock is planted",
            )
            released_after = time.time() - fetched_at
            assert client.get("unacked_mutex") == b"planted"  # the writer never stopped
            assert worker_b.alive(), worker_b.log_tail(30)
    finally:
        stop.set()
        planter.join(timeout=5)
    print(f"released {released_after:.1f} s after the dead worker fetched it")
    assert fleet.outcome_counts() == {"released": 1}
    assert DeadLetter.objects.count() == 0
    assert fleet.invariant_violations(expected_released=[hold_id]) == []


def _unsigned_copy(envelope: dict[str, Any]) -> dict[str, Any]:
    """The same release message (same hold, same key) as a broker writer would plant it: a
    fresh task id and delivery tag, marked as a redelivery, and no project signature."""
    copy = json.loads(json.dumps(envelope))
    copy["headers"].pop("cleanup_signature", None)
    copy["headers"].update(id=str(uuid.uuid4()), redelivered=True)
    copy["properties"]["delivery_tag"] = str(uuid.uuid4())
    copy["properties"]["delivery_info"]["redelivered"] = True
    return copy


def test_only_the_projects_own_redelivery_spends_a_holds_delivery_budget(
    clean, exclusive_workers, tmp_path
):
    """The delivery count lived in the broker's Redis, and the restore counted every unacked
    entry it found: a written count, or planted restorable entries carrying a real hold's key,
    got the hold's genuine post-crash redelivery dead-lettered as deliveries_exhausted (and the
    planted entries wrote deliveries_exhausted letters naming the hold)."""
    from cleanup.models import DeliveryCount
    from cleanup.release.messages import validate

    # given: worker A SIGKILLed mid-release, the hold's genuine message left unacked
    hold_id, offering_id = fleet.one_eligible_hold()
    with fleet.dedicated(tmp_path, {"concurrency": 1}) as (worker_a,):
        with fleet.offering_locked(offering_id):
            fleet.publish_for(hold_id)
            backends = fleet.wait_until(fleet.blocked_backends, timeout=30, what="release waiting")
            worker_a.kill()
            assert fleet.scalar("SELECT pg_terminate_backend(%s)", [backends[0]]) is True
    fleet.wait_until(lambda: not fleet.blocked_backends(), timeout=30, what="the statement dropped")
    client = redis_client()
    ((tag, fetched_at),) = client.zrange("unacked_index", 0, -1, withscores=True)  # type: ignore[misc]
    genuine, exchange, routing_key = json.loads(client.hget("unacked", tag))  # type: ignore[arg-type]
    body = json.loads(base64.b64decode(genuine["body"]))
    key = validate(body[0][0]).idempotency_key
    # and: a broker writer sets the hold's count where it used to be kept (the broker's Redis) ...
    client.set(f"reservation-cleanup:deliveries:{key}", 1000)
    # ... and plants more restorable copies of its message than the budget allows
    planted = cleanup_settings().max_deliveries + 2
    for n in range(planted):
        copy = _unsigned_copy(genuine)
        client.hset("unacked", f"planted-{n}", json.dumps([copy, exchange, routing_key]))
        client.zadd("unacked_index", {f"planted-{n}": fetched_at})

    # when: another worker restores them all
    with fleet.dedicated(tmp_path, {"concurrency": 1}) as (worker_b,):
        # then: the genuine redelivery releases the hold, once
        fleet.wait_until(
            lambda: fleet.status_of(hold_id) == "released", timeout=60, what="the hold released"
        )
        fleet.wait_until(
            lambda: DeadLetter.objects.count() >= planted, timeout=30, what="the planted copies"
        )
        fleet.wait_until(lambda: fleet.queue_settled(cleanup_settings().release_queue), timeout=30)
        assert worker_b.alive(), worker_b.log_tail(30)
    # and: each planted copy is one unsigned letter that names no hold, and none is exhausted
    letters = list(DeadLetter.objects.all())
    assert sorted(d.reason for d in letters) == ["unsigned"] * planted, [
        (d.reason, d.error) for d in letters
    ]
    assert all(d.reservation_id is None and d.idempotency_key == "" for d in letters)
    # and: only the genuine restore was counted, where a broker writer cannot write
    assert DeliveryCount.objects.get(pk=key).count == 1
    assert fleet.outcome_counts() == {"released": 1}
    assert fleet.invariant_violations(expected_released=[hold_id]) == []
