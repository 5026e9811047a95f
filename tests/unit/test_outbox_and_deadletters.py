"""Outbox relay order and marking, retention, and dead-letter requeue (real PostgreSQL and the
tests' own Redis database)."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from cleanup import deadletters, outbox
from cleanup.broker import priority_keys, queue_depth, redis_client
from cleanup.messages import build
from cleanup.models import CleanupReceipt, DeadLetter
from reservations import services
from reservations.models import OutboxEvent


@pytest.fixture
def broker():
    client = redis_client()
    client.flushdb()
    yield client
    client.flushdb()


def _events_in_queue(client, queue: str) -> list[dict]:
    raw = []
    for key in priority_keys(queue):
        raw.extend(client.lrange(key, 0, -1))
    bodies = []
    for item in reversed(raw):  # LPUSH: the oldest is last
        message = json.loads(item)
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        bodies.append(json.loads(body))
    return bodies


def test_the_relay_publishes_unpublished_events_in_order_and_marks_them(db, broker, settings):
    # given
    offering = services.create_offering("relay", 5)
    hold = services.hold_seat(offering.pk, "a", 60)
    services.renew(hold.pk, 1, 120)
    services.cancel(hold.pk, 2)
    # when
    published = outbox.relay_batch()
    # then
    events = _events_in_queue(broker, settings.CLEANUP_EVENTS_QUEUE)
    assert published == 3
    assert [e["kind"] for e in events] == [
        "reservation.held",
        "reservation.renewed",
        "reservation.cancelled",
    ]
    assert [e["event_id"] for e in events] == sorted(e["event_id"] for e in events)
    assert not OutboxEvent.objects.filter(published_at__isnull=True).exists()
    assert outbox.relay_batch() == 0  # nothing twice


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
    open_letter = deadletters.record("malformed", error="x")
    resolved = deadletters.record("malformed", error="y")
    assert open_letter is not None and resolved is not None
    DeadLetter.objects.filter(pk=resolved.pk).update(resolved_at=old)
    # when
    result = outbox.prune(retention_days=14)
    # then
    assert result == {"outbox_events": 1, "receipts": 1, "dead_letters": 1}
    assert OutboxEvent.objects.filter(published_at__isnull=True).count() == 1
    assert DeadLetter.objects.filter(pk=open_letter.pk).exists()


def test_requeue_republishes_the_same_message_and_resolves_the_letter(db, broker, settings):
    message = build(42, 3, timezone.now(), 1, "trace-1")
    letter = deadletters.record("retries_exhausted", error="db down", message=message)
    assert letter is not None
    out = StringIO()
    call_command("requeue_dead_letters", "--dry-run", stdout=out)
    assert "would requeue: republished: 1" in out.getvalue()
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    call_command("requeue_dead_letters", "--reason", "retries_exhausted", stdout=out)
    letter.refresh_from_db()
    assert letter.resolution == "republished" and letter.resolved_at is not None
    queued = _events_in_queue(broker, settings.CLEANUP_RELEASE_QUEUE)
    assert queued[0][0][0]["idempotency_key"] == "release:42:3"  # same key: safe to redo


def test_a_malformed_letter_is_reported_not_requeued(db, broker):
    letter = deadletters.record("malformed", error="bad", payload="garbage")
    assert letter is not None
    result = deadletters.requeue([letter])
    assert list(result) == [k for k in result if k.startswith("not_requeueable")]
    letter.refresh_from_db()
    assert letter.resolved_at is None
