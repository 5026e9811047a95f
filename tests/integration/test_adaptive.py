"""The default release mode (adaptive) with real workers: a burst becomes multi-hold messages
whose holds are each released once with a receipt; a renewed hold inside such a message is not
released; a batch redelivered after its pool process died is idempotent hold by hold."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cleanup.conf import cleanup_settings
from cleanup.release import sweep as sweep_module
from cleanup.release.messages import BatchMessage, ReleaseMessage
from cleanup.release.sweep import sweep_shard
from reservations import services
from tests.support import fleet

pytestmark = [pytest.mark.workers]


def receipts_per_message(ids: list[int]) -> dict[str, list[int]]:
    """The holds of each release message, from the receipts (a message's holds share its
    task id)."""
    found: dict[str, list[int]] = {}
    for task_id, rid in fleet.sql(
        "SELECT task_id, reservation_id FROM cleanup_cleanupreceipt "
        "WHERE reservation_id = ANY(%s) ORDER BY reservation_id",
        [ids],
    ):
        found.setdefault(task_id, []).append(rid)
    return found


def test_a_burst_in_the_default_mode_is_released_once_per_hold_in_multi_hold_messages(
    workers, clean
):
    # given: the default mode (nothing set) and 3,000 holds that expired a minute ago
    assert cleanup_settings().release_mode == "adaptive"
    assert all("CLEANUP_RELEASE_MODE" not in w.django_settings for w in workers)
    ids = fleet.create_eligible_holds(3_000, offerings=4)
    # when: the workers' sweeps run, as beat sends them
    fleet.sweep_until(lambda: fleet.released_count(ids) == len(ids), shards=4, timeout=180)
    # then: every hold released once, with one receipt each
    assert fleet.outcome_counts() == {"released": len(ids)}
    assert fleet.scalar(
        "SELECT count(DISTINCT reservation_id) FROM cleanup_cleanupreceipt WHERE "
        "reservation_id = ANY(%s)",
        [ids],
    ) == len(ids)
    assert fleet.invariant_violations(expected_released=ids) == []
    # and the burst travelled in messages of more than one hold (fewer messages than holds)
    messages = receipts_per_message(ids)
    sizes = sorted(len(holds) for holds in messages.values())
    print(f"{len(ids)} holds in {len(messages)} messages; largest {sizes[-1]}")
    assert sizes[-1] > 1
    assert len(messages) < len(ids)
    assert sizes[-1] <= cleanup_settings().release_batch_size


def test_a_renewed_hold_in_a_redelivered_multi_hold_message_is_not_released(
    exclusive_workers, clean, tmp_path, monkeypatch
):
    # given: 600 holds of one offering, expired a minute ago, swept in the default mode with
    # no worker running (what the sweep published is recorded as it goes to the broker)
    ids = fleet.create_eligible_holds(600, offerings=1)
    offering_id = fleet.scalar(
        "SELECT offering_id FROM reservations_reservation WHERE id = %s", [ids[0]]
    )
    published: list[ReleaseMessage | BatchMessage] = []
    real_publish = sweep_module.publish_release_messages

    def recording(messages: list[ReleaseMessage | BatchMessage]) -> None:
        published.extend(messages)
        real_publish(messages)

    monkeypatch.setattr(sweep_module, "publish_release_messages", recording)
    result = sweep_shard(0, 1)
    assert result.published == len(ids)
    batches = [m for m in published if isinstance(m, BatchMessage)]
    assert batches, "the burst was published one hold per message"
    first = published[0]  # the first two messages are fetched first
    assert isinstance(first, BatchMessage) and len(first.items) > 1
    # a learner renews one hold of the first message before any worker gets to it (its expiry
    # had been extended meanwhile, so the renewal is allowed)
    renewed = first.items[1].reservation_id
    fleet.sql(
        "UPDATE reservations_reservation SET expires_at = now() + interval '10 minutes' "
        "WHERE id = %s RETURNING id",
        [renewed],
    )
    services.renew(renewed, first.items[1].version, 600)
    # when: a worker in the default mode starts while the offering is locked, so its first two
    # messages wait inside their release statements, and its pool processes are SIGKILLed there
    # (the messages are redelivered)
    with (
        fleet.offering_locked(offering_id) as lock,
        fleet.dedicated(tmp_path, {"concurrency": 2}) as (worker,),
    ):
        # both pool processes inside a release (a message still waiting in the worker for a
        # process would be handed to a new one without a redelivery)
        fleet.wait_until(
            lambda: len(fleet.blocked_backends()) >= 2,
            timeout=60,
            what="both pool processes' releases waiting on the offering",
        )
        for pid in worker.children():
            os.kill(pid, signal.SIGKILL)
        time.sleep(1)
        lock.rollback()  # the offering is free again
        # then: everything but the renewed hold is released, once
        expected = [i for i in ids if i != renewed]
        fleet.wait_until(
            lambda: fleet.released_count(expected) == len(expected), timeout=120, what="released"
        )
        fleet.wait_until(lambda: sum(fleet.outcome_counts().values()) == len(ids), timeout=60)
    assert fleet.outcome_counts() == {"released": len(expected), "renewed": 1}
    assert fleet.status_of(renewed) == "held"
    assert (
        fleet.invariant_violations(expected_released=expected, expected_not_released=[renewed])
        == []
    )
    # a killed message came back as a redelivery, counted under its batch's key (a message
    # whose start the worker's main process had not yet seen is handed to a new process
    # without one, so not necessarily both), and its holds have one receipt each, all from
    # that one message
    second = published[1]
    assert isinstance(second, BatchMessage)
    redeliveries = fleet.delivery_counts([first.batch_key, second.batch_key])
    assert max(redeliveries) >= 1, redeliveries
    first = first if redeliveries[0] else second
    by_message = receipts_per_message([m.reservation_id for m in first.items])
    assert len(by_message) == 1
    (holds,) = by_message.values()
    assert sorted(holds) == sorted(m.reservation_id for m in first.items)
    outcomes = dict(
        fleet.sql(
            "SELECT reservation_id, outcome FROM cleanup_cleanupreceipt WHERE "
            "reservation_id = ANY(%s)",
            [holds],
        )
    )
    outcomes.pop(renewed, None)
    assert set(outcomes.values()) == {"released"}
    assert dict(
        fleet.sql(
            "SELECT reservation_id, outcome FROM cleanup_cleanupreceipt WHERE reservation_id = %s",
            [renewed],
        )
    ) == {renewed: "renewed"}
