"""Scenarios 1–4 and 7 in the batched release mode (CLEANUP_RELEASE_MODE "batch"), with real
workers: each hold gets the outcome it would get in per-reservation mode."""

from __future__ import annotations

import os
import re
import signal
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from cleanup.models import DeadLetter
from cleanup.release.messages import BatchMessage, build_batch
from cleanup.release.publish import publish_release_messages
from cleanup.wire import RELEASE_BATCH_TASK
from reservations import services
from tests.support.fleet import (
    SessionFleet,
    Worker,
    blocked_backends,
    create_eligible_holds,
    delivery_counts,
    invariant_violations,
    log_lines,
    offering_locked,
    outcome_counts,
    released_count,
    running,
    scalar,
    sql,
    status_of,
    sweep_until,
    wait_until,
)
from tests.support.wire import publish_raw

pytestmark = [pytest.mark.workers]

# The workers' Django settings (tuning settings, not variables).
BATCH_SETTINGS = {"CLEANUP_RELEASE_MODE": "batch", "CLEANUP_RELEASE_BATCH_SIZE": 50}


@pytest.fixture(scope="module")
def batch_workers(
    session_fleet: SessionFleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    session_fleet.pause()  # batch-mode workers only on these queues
    logs = tmp_path_factory.mktemp("batch-workers")
    with running(
        [
            Worker(
                f"bw{i}-{uuid.uuid4().hex[:6]}",
                2,
                logs / f"bw{i}.log",
                django_settings=BATCH_SETTINGS,
            )
            for i in range(2)
        ]
    ) as workers:
        yield workers


def _holds(ids: list[int]) -> list[tuple[int, int, Any]]:
    rows = sql(
        "SELECT id, version, expires_at FROM reservations_reservation WHERE id = ANY(%s) "
        "ORDER BY id",
        [ids],
    )
    return [(r[0], r[1], r[2]) for r in rows]


def test_batched_sweeps_release_every_eligible_hold_once(batch_workers, clean):
    # the sweeps run in the batch-mode workers, so they publish batch messages
    ids = create_eligible_holds(1000, offerings=4)
    sweep_until(lambda: released_count(ids) == len(ids), shards=4, timeout=120)
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts() == {"released": len(ids)}


def test_batched_duplicates_end_already_handled(batch_workers, clean):
    ids = create_eligible_holds(200, offerings=2)
    holds = _holds(ids)
    trace = f"dup-{uuid.uuid4().hex[:8]}"
    batches = [
        BatchMessage.for_holds(holds[i : i + 50], 0, trace) for i in range(0, len(holds), 50)
    ]
    keys = [b.batch_key for b in batches]
    # every batch message published three times
    publish_release_messages(batches * 3)
    wait_until(
        lambda: len(_batch_attempts(batch_workers, trace)) == 3 * len(keys) and _drained(),
        timeout=90,
        what="every copy delivered and acknowledged",
    )
    # then: each copy was delivered once (3 per batch, none redelivered, so none counted),
    # one receipt per hold, all released
    assert delivery_counts(keys) == [0] * len(keys)
    assert outcome_counts() == {"released": len(ids)}
    assert scalar("SELECT count(*) FROM cleanup_deadletter") == 0
    assert invariant_violations(expected_released=ids) == []
    # and the copies ended already_handled: 3 attempts per batch, 200 holds released once and
    # 400 hold-copies already handled, as the workers logged them
    attempts = wait_until(
        lambda: (
            found if len(found := _batch_attempts(batch_workers, trace)) == 3 * len(keys) else None
        ),
        timeout=15,
        what="a log line per batch attempt",
    )
    totals: Counter[str] = Counter()
    for outcomes in attempts:
        totals.update(outcomes)
    assert totals == {"released": len(ids), "already_handled": 2 * len(ids)}


def _batch_attempts(workers: list[Worker], trace: str) -> list[dict[str, int]]:
    """The per-outcome counts of each "release batch attempt" log line of this trace."""
    found = []
    for line in log_lines([w.log_path for w in workers], "release batch attempt"):
        if f"trace_id={trace}" in line:
            found.append({k: int(v) for k, v in re.findall(r"'(\w+)': (\d+)", line)})
    return found


def _drained(queue: str = "cleanup") -> bool:
    """Nothing waiting and nothing fetched but unacknowledged."""
    from cleanup.broker.readers import queue_depth, unacked_count

    return queue_depth(queue) == 0 and unacked_count(queue) == 0


def test_batched_renewed_or_confirmed_holds_are_never_released(batch_workers, clean):
    offering = services.create_offering("renewals", 10)
    renew_me = services.hold_seat(offering.pk, "a", 600)
    confirm_me = services.hold_seat(offering.pk, "b", 600)
    cancel_me = services.hold_seat(offering.pk, "c", 600)
    expired = create_eligible_holds(3, offerings=1)
    now = timezone.now()
    # messages built at v1, then learners act before the workers get them
    message = BatchMessage.for_holds(
        [(h.pk, 1, now) for h in (renew_me, confirm_me, cancel_me)]
        + [(i, 1, now) for i in expired],
        0,
        "mixed",
    )
    services.renew(renew_me.pk, 1, 600)
    services.confirm(confirm_me.pk, 1)
    services.cancel(cancel_me.pk, 1)
    publish_release_messages([message])
    wait_until(lambda: sum(outcome_counts().values()) == 6, timeout=60)
    outcomes = dict(sql("SELECT reservation_id, outcome FROM cleanup_cleanupreceipt"))
    assert outcomes[renew_me.pk] == "renewed"
    assert outcomes[confirm_me.pk] == "no_longer_held"
    assert outcomes[cancel_me.pk] == "no_longer_held"
    assert [outcomes[i] for i in expired] == ["released"] * 3
    assert status_of(renew_me.pk) == "held"
    assert (
        invariant_violations(
            expected_released=expired,
            expected_not_released=[renew_me.pk, confirm_me.pk, cancel_me.pk],
        )
        == []
    )


def test_batched_pool_child_killed_mid_batch_is_redelivered_and_released_once(batch_workers, clean):
    ids = create_eligible_holds(40, offerings=1)
    offering_id = scalar("SELECT offering_id FROM reservations_reservation WHERE id = %s", [ids[0]])
    batch = BatchMessage.for_holds(_holds(ids), 0, "kill")
    key = batch.batch_key
    with offering_locked(offering_id):
        publish_release_messages([batch])
        wait_until(blocked_backends, timeout=30, what="batch waiting on the row lock")
        victims = {c for w in batch_workers for c in w.children()}
        # kill every pool child: whichever holds the batch dies mid-transaction
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        # then: the worker requeues the batch (reject_on_worker_lost) and a new child fetches
        # it again: a redelivery, which the delivery counter counts (the first delivery is not
        # counted). Seen while the row lock is still held: the dead child's parked statement
        # commits once the lock is let go, so "every hold released" alone would not show it.
        wait_until(lambda: delivery_counts([key]) == [1], timeout=60, what="the batch redelivered")
    wait_until(lambda: released_count(ids) == len(ids), timeout=60, what="released")
    wait_until(_drained, timeout=30, what="the batch acknowledged")
    assert delivery_counts([key]) == [1]  # one redelivery: two deliveries in all
    assert outcome_counts() == {"released": len(ids)}
    assert invariant_violations(expected_released=ids) == []


def test_batched_malformed_envelopes_and_items_are_dead_lettered(batch_workers, clean):
    ids = create_eligible_holds(5, offerings=1)
    good = build_batch(_holds(ids), 0, "mixed")
    good["items"] += [{"reservation_id": True, "version": 1}, "x"]  # two bad items
    no_items = build_batch([], 0, "empty")
    wrong_kind = {**build_batch(_holds(ids), 0, "x"), "kind": "something_else"}
    for body in (good, no_items, wrong_kind):
        publish_raw(__import__("json").dumps([[body], {}, {}]), task=RELEASE_BATCH_TASK)
    wait_until(lambda: DeadLetter.objects.count() == 4, timeout=60, what="4 dead letters")
    wait_until(lambda: released_count(ids) == len(ids), timeout=60)
    reasons = sorted(DeadLetter.objects.values_list("error", flat=True))
    assert any("must be an integer" in r for r in reasons)
    assert any("item must be a JSON object" in r for r in reasons)
    assert any("non-empty list" in r for r in reasons)
    assert any("kind" in r for r in reasons)
    assert invariant_violations(expected_released=ids) == []
