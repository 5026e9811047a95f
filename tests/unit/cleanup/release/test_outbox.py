"""Outbox relay order and marking, retention, and dead-letter requeue (real PostgreSQL and the
tests' own Redis database)."""

from __future__ import annotations

import base64
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from kombu import Producer

from cleanup.broker.readers import priority_keys, queue_depth
from cleanup.models import CleanupReceipt, DeadLetter
from cleanup.operations import triage
from cleanup.release import dead_letters, outbox
from cleanup.release.messages import build, build_batch, validate
from cleanup.release.release import Attempt, release
from cleanup.release.sweep import sweep_shard
from reservations import services
from reservations.models import OutboxEvent, Reservation
from tools.seed import seed_holds


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


def _hold_renewed_and_cancelled() -> None:
    """Three unpublished events: a hold taken, renewed and cancelled."""
    offering = services.create_offering("relay", 5)
    hold = services.hold_seat(offering.pk, "a", 60)
    services.renew(hold.pk, 1, 120)
    services.cancel(hold.pk, 2)


def _assert_each_event_queued_once_in_order(broker: Any, queue: str) -> None:
    events = _events_in_queue(broker, queue)
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


def test_requeue_republishes_the_same_message_and_resolves_the_letter(db, broker, settings):
    message = build(42, 3, timezone.now(), 1, "trace-1")
    letter = dead_letters.record("retries_exhausted", error="db down", message=message)
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


def test_a_malformed_letter_is_reported_not_requeued(db, broker, settings):
    letter = dead_letters.record("malformed", error="bad", payload="garbage")
    assert letter is not None
    result = triage.requeue([letter])
    assert sum(result.values()) == 1
    (what,) = result
    assert what.startswith("not_requeueable")
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    letter.refresh_from_db()
    assert letter.resolved_at is None and letter.resolution == ""


@pytest.mark.django_db(transaction=True)
def test_requeue_of_a_claims_exhausted_hold_makes_the_next_sweep_publish_it(broker, settings):
    # given: an expired hold that has used up its claim budget
    settings.CLEANUP_MAX_CLAIMS = 2
    offering = services.create_offering("exhausted", 2)
    hold = services.hold_seat(offering.pk, "a", 60)
    Reservation.objects.filter(pk=hold.pk).update(
        expires_at=timezone.now() - timedelta(minutes=1),
        next_attempt_at=timezone.now() - timedelta(minutes=1),
        claim_count=2,
    )
    # when: a sweep claims it a third time, it is set aside with a dead letter, not published
    first = sweep_shard(0, 1, trace_id="exhausted")
    assert (first.claimed, first.set_aside, first.published) == (1, 1, 0)
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    letter = DeadLetter.objects.get(reason=DeadLetter.Reason.CLAIMS_EXHAUSTED)
    assert letter.reservation_id == hold.pk
    assert sweep_shard(0, 1).claimed == 0  # set aside: no sweep takes it
    # when: the letter is requeued
    assert triage.requeue([letter]) == {"rescheduled": 1}
    # then: the hold is due again with a fresh budget; the next sweep publishes its message
    letter.refresh_from_db()
    assert letter.resolution == "rescheduled" and letter.resolved_at is not None
    assert Reservation.objects.get(pk=hold.pk).claim_count == 0
    again = sweep_shard(0, 1, trace_id="after-requeue")
    assert (again.claimed, again.set_aside, again.published) == (1, 0, 1)
    queued = _events_in_queue(broker, settings.CLEANUP_RELEASE_QUEUE)
    assert [q[0][0]["idempotency_key"] for q in queued] == [f"release:{hold.pk}:1"]
    # a second requeue of the same letter does nothing
    assert triage.requeue([DeadLetter.objects.get(pk=letter.pk)]) == {"already_resolved": 1}


def test_requeue_of_a_batch_message_republishes_the_batch_to_the_batched_task(db, broker, settings):
    now = timezone.now()
    message = build_batch([(41, 1, now), (42, 3, now)], 0, "batch-trace")
    letter = dead_letters.record("retries_exhausted", error="db down", message=message)
    assert letter is not None
    # when
    assert triage.requeue([letter]) == {"republished": 1}
    # then: the same batch, to cleanup.release_batch
    raw = [
        json.loads(item)
        for key in priority_keys(settings.CLEANUP_RELEASE_QUEUE)
        for item in broker.lrange(key, 0, -1)
    ]
    assert [r["headers"]["task"] for r in raw] == ["cleanup.release_batch"]
    (queued,) = _events_in_queue(broker, settings.CLEANUP_RELEASE_QUEUE)
    assert queued[0][0] == message
    letter.refresh_from_db()
    assert letter.resolution == "republished"


def test_a_batch_letter_with_a_malformed_item_is_not_requeued(db, broker, settings):
    message = build_batch([(41, 1, timezone.now())], 0, "bad-batch")
    message["items"].append({"reservation_id": "x", "version": 1})
    letter = dead_letters.record("malformed", error="bad item", message=message)
    assert letter is not None
    result = triage.requeue([letter])
    assert list(result) == ["not_requeueable (1 malformed item(s))"]
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0


def test_letters_a_later_release_settled_are_resolved_and_the_rest_stay_open(db):
    # given: three expired holds whose releases were dead-lettered — two for slowness or
    # transient errors, one as malformed (its payload is evidence) — and a fourth hold, whose
    # dead-lettered release lost the race to a renewal
    ids = seed_holds(4, offerings=1, expires_in=lambda p: -60.0 if p < 3 else 60.0, name="settle")
    messages = {i: build(i, 1, timezone.now() - timedelta(minutes=1), 0, "t") for i in ids}
    reasons = [
        DeadLetter.Reason.TIME_LIMIT,
        DeadLetter.Reason.RETRIES_EXHAUSTED,
        DeadLetter.Reason.MALFORMED,
        DeadLetter.Reason.TIME_LIMIT,
    ]
    recorded = [
        dead_letters.record(reason, error="x", message=messages[i])
        for reason, i in zip(reasons, ids, strict=True)
    ]
    letters = [letter for letter in recorded if letter is not None]
    assert len(letters) == 4
    renewed = Reservation.objects.get(pk=ids[3])
    services.renew(renewed.pk, renewed.version, ttl_seconds=600)
    # and when later messages with the same keys are handled (a later sweep's, or the
    # interrupted statement that committed after all)
    attempt = Attempt(1, "w@h", "task-later", 0.1)
    outcomes = [release(validate(messages[i]), attempt) for i in ids]
    assert outcomes == ["released", "released", "released", "renewed"]
    # when
    assert dead_letters.resolve_released() == 2
    # then: the two a release settled are resolved; the malformed one and the one whose hold
    # was renewed (not released) stay open
    for letter in letters:
        letter.refresh_from_db()
    assert [(x.resolved_at is not None, x.resolution) for x in letters] == [
        (True, "released_later"),
        (True, "released_later"),
        (False, ""),
        (False, ""),
    ]
    # and a second pass changes nothing
    assert dead_letters.resolve_released() == 0
