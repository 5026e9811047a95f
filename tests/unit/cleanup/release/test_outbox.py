"""The outbox relay and retention (cleanup.release.outbox): events published in order and marked,
a second relay relaying nothing while the first publishes, and retention pruning only what is
finished and old enough, dead letters after their own retention (real PostgreSQL and the
tests' own Redis database)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from kombu import Producer

from cleanup.models import CleanupReceipt, DeadLetter
from cleanup.release import dead_letters, outbox
from reservations import services
from reservations.models import OutboxEvent
from tests.support.dead_letters import letter
from tests.support.planted import queued_bodies


def _hold_renewed_and_cancelled() -> None:
    """Three unpublished events: a hold taken, renewed and cancelled."""
    offering = services.create_offering("relay", 5)
    hold = services.hold_seat(offering.pk, "a", 60)
    services.renew(hold.pk, 1, 120)
    services.cancel(hold.pk, 2)


def _assert_each_event_queued_once_in_order(broker: Any, queue: str) -> None:
    events = queued_bodies(broker, queue)
    assert [e["kind"] for e in events] == [
        "reservation.held",
        "reservation.renewed",
        "reservation.cancelled",
    ]
    assert [e["event_id"] for e in events] == sorted(e["event_id"] for e in events)
    assert not OutboxEvent.objects.filter(published_at__isnull=True).exists()


def test_the_relay_publishes_unpublished_events_in_order_and_marks_them(db, broker, settings):
    # given
    _hold_renewed_and_cancelled()
    # when
    published = outbox.relay_batch()
    # then
    assert published == 3
    _assert_each_event_queued_once_in_order(broker, settings.CLEANUP_EVENTS_QUEUE)
    assert outbox.relay_batch() == 0  # nothing twice


@pytest.mark.django_db(transaction=True)
def test_a_second_relay_while_the_first_is_publishing_relays_nothing(broker, settings, monkeypatch):
    # given: three unpublished events, and a relay stopped after publishing the first of them
    # (its transaction, and the relay lock with it, still open)
    _hold_renewed_and_cancelled()
    published_one, go_on = threading.Event(), threading.Event()
    publish = Producer.publish

    def held_in_the_first_relay(self: Producer, *args: Any, **kwargs: Any) -> Any:
        result = publish(self, *args, **kwargs)
        if threading.current_thread().name.startswith("first-relay"):
            published_one.set()
            go_on.wait(timeout=30)
        return result

    monkeypatch.setattr(Producer, "publish", held_in_the_first_relay)

    def first_relay() -> int:
        try:
            return outbox.relay_batch()
        finally:
            connection.close()  # this thread's own connection

    with ThreadPoolExecutor(1, thread_name_prefix="first-relay") as pool:
        first = pool.submit(first_relay)
        try:
            assert published_one.wait(timeout=30), "the first relay never published"
            # when: another relay runs meanwhile
            second = outbox.relay_batch()
        finally:
            go_on.set()
        # then: it relays nothing; the first relays every event, each once and in order
        assert second == 0
        assert first.result(timeout=30) == 3
    _assert_each_event_queued_once_in_order(broker, settings.CLEANUP_EVENTS_QUEUE)


def test_retention_prunes_only_finished_rows_older_than_the_cutoff(db, broker):
    offering = services.create_offering("prune", 5)
    hold = services.hold_seat(offering.pk, "a", 60)
    outbox.relay_batch()
    old = timezone.now() - timedelta(days=30)
    OutboxEvent.objects.update(published_at=old)
    services.renew(hold.pk, 1, 60)  # unpublished: must stay
    CleanupReceipt.objects.create(
        idempotency_key="release:1:9", reservation_id=1, version=9, outcome="renewed"
    )
    CleanupReceipt.objects.update(created_at=old)
    open_letter = dead_letters.record("malformed", error="x")
    resolved = dead_letters.record("malformed", error="y")
    assert open_letter is not None and resolved is not None
    DeadLetter.objects.filter(pk=resolved.pk).update(resolved_at=old)
    # when
    result = outbox.prune(retention_days=14)
    # then
    assert result == {"outbox_events": 1, "receipts": 1, "dead_letters": 1}
    assert OutboxEvent.objects.filter(published_at__isnull=True).count() == 1
    assert DeadLetter.objects.filter(pk=open_letter.pk).exists()


# --- the retention of resolved dead letters ---------------------------------------------------


def test_resolved_letters_are_pruned_after_their_own_retention_and_open_ones_never(db, settings):
    settings.CLEANUP_DEAD_LETTER_RETENTION_DAYS = 3
    settings.CLEANUP_RETENTION_DAYS = 14
    now = timezone.now()
    gone, recent, ancient_open = letter(), letter(), letter(age=timedelta(days=100))
    DeadLetter.objects.filter(pk=gone.pk).update(
        resolved_at=now - timedelta(days=4), resolution="discarded"
    )
    DeadLetter.objects.filter(pk=recent.pk).update(
        resolved_at=now - timedelta(days=2), resolution="discarded"
    )
    receipt = CleanupReceipt.objects.create(
        idempotency_key="release:1:1", reservation_id=1, version=1, outcome="released"
    )
    CleanupReceipt.objects.filter(pk=receipt.pk).update(created_at=now - timedelta(days=4))
    result = outbox.prune()
    assert (result["dead_letters"], result["receipts"]) == (1, 0)
    assert sorted(DeadLetter.objects.values_list("pk", flat=True)) == [recent.pk, ancient_open.pk]
