"""The outbox relay and retention (cleanup.release.outbox): events published in order and marked,
a second relay relaying nothing while the first publishes, every kind the services write relayed
as its schema says (reservations/event_schemas) on Redis and on RabbitMQ, the relay held back
while the events queue is at its maximum and relaying everything in order once it drained, and
retention pruning only what is finished and old enough, dead letters after their own retention,
events never relayed after the same retention as relayed ones, counted (real PostgreSQL, the
tests' own Redis database, and a RabbitMQ vhost of this module's own)."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import kombu
import pytest
from celery import current_app
from django.db import connection
from django.utils import timezone
from kombu import Producer

from cleanup.broker.readers import priority_keys
from cleanup.conf import cleanup_settings
from cleanup.models import CleanupReceipt, DeadLetter, DeliveryCount
from cleanup.release import dead_letters, outbox
from cleanup.release.messages import ReleaseMessage
from cleanup.wire import RELEASE_TASK
from reservations import events as domain_events
from reservations import services
from reservations.models import OutboxEvent, Reservation
from tests.support.dead_letters import letter
from tests.support.holds import expire
from tests.support.metrics import counter
from tests.support.planted import queued_bodies
from tests.support.rabbitmq_vhosts import private_vhosts
from tests.support.rabbitmq_vhosts import vhost_url as rabbitmq_vhost_url


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
    # and: a delivery count last changed two days ago, and one changed now
    DeliveryCount.objects.create(idempotency_key="release:1:8", count=2)
    DeliveryCount.objects.filter(pk="release:1:8").update(updated_at=old)
    DeliveryCount.objects.create(idempotency_key="release:1:9", count=1)
    # when
    result = outbox.prune(retention_days=14)
    # then
    assert result == {
        "outbox_events": 1,
        "unpublished_outbox_events": 0,
        "receipts": 1,
        "dead_letters": 1,
        "delivery_counts": 1,
    }
    assert OutboxEvent.objects.filter(published_at__isnull=True).count() == 1
    assert DeadLetter.objects.filter(pk=open_letter.pk).exists()
    assert list(DeliveryCount.objects.values_list("pk", flat=True)) == ["release:1:9"]


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


def test_a_retention_of_a_fraction_of_a_day_prunes_by_the_hour(db, settings):
    # given: a retention of six hours for receipts and events, and of one hour for letters
    settings.CLEANUP_RETENTION_DAYS = 0.25
    settings.CLEANUP_DEAD_LETTER_RETENTION_DAYS = 1 / 24
    now = timezone.now()
    old, recent = CleanupReceipt.objects.bulk_create(
        CleanupReceipt(
            idempotency_key=f"release:1:{v}", reservation_id=1, version=v, outcome="renewed"
        )
        for v in (1, 2)
    )
    CleanupReceipt.objects.filter(pk=old.pk).update(created_at=now - timedelta(hours=7))
    CleanupReceipt.objects.filter(pk=recent.pk).update(created_at=now - timedelta(hours=5))
    gone, kept = letter(), letter()
    DeadLetter.objects.filter(pk=gone.pk).update(
        resolved_at=now - timedelta(minutes=61), resolution="discarded"
    )
    DeadLetter.objects.filter(pk=kept.pk).update(
        resolved_at=now - timedelta(minutes=59), resolution="discarded"
    )
    # when
    result = outbox.prune()
    # then: only what is older than its retention is gone
    assert (result["receipts"], result["dead_letters"]) == (1, 1)
    assert list(CleanupReceipt.objects.values_list("pk", flat=True)) == [recent.pk]
    assert list(DeadLetter.objects.values_list("pk", flat=True)) == [kept.pk]


# --- events never relayed: deleted after the same retention, counted and logged --------------


def test_retention_deletes_unpublished_events_older_than_it_counts_and_logs_them(db, caplog):
    # given: a hold's three events, none relayed (nobody consumes: the relay was held back);
    # two of them older than the retention, one recent
    _hold_renewed_and_cancelled()
    old_ids = list(OutboxEvent.objects.order_by("id").values_list("id", flat=True)[:2])
    OutboxEvent.objects.filter(id__in=old_ids).update(
        created_at=timezone.now() - timedelta(days=15)
    )
    expired_before = counter("outbox_events_expired")
    # when
    with caplog.at_level(logging.WARNING, logger="cleanup.outbox"):
        result = outbox.prune(retention_days=14)
    # then: the two old ones are gone, counted and logged with how many; the recent one waits
    assert (result["unpublished_outbox_events"], result["outbox_events"]) == (2, 0)
    assert not OutboxEvent.objects.filter(id__in=old_ids).exists()
    assert OutboxEvent.objects.filter(published_at__isnull=True).count() == 1
    assert counter("outbox_events_expired") == expired_before + 2
    (warning,) = [r for r in caplog.records if "never relayed" in r.getMessage()]
    assert (warning.levelno, warning.deleted, warning.retention_days) == (logging.WARNING, 2, 14)
    # and a second prune finds nothing more to delete, and says nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cleanup.outbox"):
        assert outbox.prune(retention_days=14)["unpublished_outbox_events"] == 0
    assert caplog.records == []


# --- every kind, relayed as its schema says ---------------------------------------------------


def _every_kind(run_task: Any) -> set[str]:
    """One event of each kind, each written by the service that writes it in production: a hold
    taken and renewed, one confirmed, one cancelled, and one released by the release task (the
    path a sweep's message takes). The kinds written."""
    offering = services.create_offering("every kind", 3)
    renewed = services.hold_seat(offering.pk, "a", 60)
    services.renew(renewed.pk, 1, 120)
    services.confirm(services.hold_seat(offering.pk, "b", 60).pk, 1)
    services.cancel(services.hold_seat(offering.pk, "c", 60).pk, 1)
    expired = services.hold_seat(offering.pk, "d", 60)
    expire(expired.pk)
    expired.refresh_from_db()
    message = ReleaseMessage.for_hold(expired.pk, 1, expired.expires_at, 0, "every-kind")
    run_task(RELEASE_TASK, message.as_dict())
    assert Reservation.objects.get(pk=expired.pk).status == Reservation.Status.RELEASED
    return set(OutboxEvent.objects.values_list("kind", flat=True))


def _assert_each_as_its_schema_says(relayed: list[dict[str, Any]]) -> None:
    """Each message is valid for its kind's schema and carries exactly the fields the schema
    lists (the schemas allow added fields, so validation alone would not see one undocumented),
    each of the outbox's events once, in id order."""
    rows = list(OutboxEvent.objects.order_by("id"))
    assert [m["event_id"] for m in relayed] == [row.pk for row in rows]
    assert {m["kind"] for m in relayed} == set(domain_events.KINDS)
    for message, row in zip(relayed, rows, strict=True):
        domain_events.validate(message)
        schema = domain_events.load_schema(message["kind"])
        assert sorted(message) == sorted(schema["required"]), message["kind"]
        payload_fields = schema["properties"]["payload"]["required"]
        assert sorted(message["payload"]) == sorted(payload_fields), message["kind"]
        assert (message["schema_version"], message["version"]) == (1, row.version)
        assert message["reservation_id"] == row.reservation_id


def test_every_kind_is_relayed_to_redis_as_its_schema_says(db, broker, settings, run_task):
    # given: one event of every kind, written by the real services and the release task
    assert _every_kind(run_task) == set(domain_events.KINDS)
    # when
    assert outbox.relay_batch() == OutboxEvent.objects.count()
    # then: read back from the events queue, each is what its schema describes
    _assert_each_as_its_schema_says(queued_bodies(broker, settings.CLEANUP_EVENTS_QUEUE))


# --- the bound on the events queue: backpressure ----------------------------------------------


def _drain(broker: Any, queue: str) -> int:
    """Empty the events queue as a consumer would; how many messages it held."""
    drained = len(queued_bodies(broker, queue))
    broker.delete(*priority_keys(queue))
    return drained


def test_the_relay_relays_nothing_while_the_events_queue_is_full_then_all_in_order(
    db, broker, settings, caplog, monkeypatch
):
    # given: an events queue of at most 3 messages, already holding 3 nobody consumed
    settings.CLEANUP_EVENTS_QUEUE_MAX_LENGTH = 3
    queue = settings.CLEANUP_EVENTS_QUEUE
    _hold_renewed_and_cancelled()
    assert outbox.relay_batch() == 3
    # and three more events waiting in the outbox
    _hold_renewed_and_cancelled()
    waiting = list(OutboxEvent.objects.filter(published_at__isnull=True).order_by("id"))
    held_back_before = counter("outbox_relay_held_back")
    monkeypatch.setattr(outbox, "_held_back_logged_at", None)  # not logged in this minute yet
    # when: the relay runs, twice
    with caplog.at_level(logging.WARNING, logger="cleanup.outbox"):
        relayed = [outbox.relay_batch(), outbox.relay_batch()]
    # then: it relayed nothing; the events stay in the outbox, unpublished; each round counted
    assert relayed == [0, 0]
    assert len(queued_bodies(broker, queue)) == 3
    assert OutboxEvent.objects.filter(published_at__isnull=True).count() == 3
    assert counter("outbox_relay_held_back") == held_back_before + 2
    assert _gauge("events_queue_depth") == 3
    (held_back,) = [r for r in caplog.records if r.getMessage().startswith("outbox relay held")]
    assert (held_back.queue_depth, held_back.max_length, held_back.waiting) == (3, 3, 3)
    # when: a consumer drains the queue
    assert _drain(broker, queue) == 3
    # then: the next relay relays every waiting event, in order
    assert outbox.relay_batch() == 3
    assert [e["event_id"] for e in queued_bodies(broker, queue)] == [e.pk for e in waiting]
    assert not OutboxEvent.objects.filter(published_at__isnull=True).exists()
    assert counter("outbox_relay_held_back") == held_back_before + 2


def test_a_batch_relayed_below_the_maximum_is_relayed_whole(db, broker, settings):
    # The depth is read once per batch: one below the maximum, the whole batch goes out, so the
    # queue holds at most the maximum plus a batch less one.
    settings.CLEANUP_EVENTS_QUEUE_MAX_LENGTH = 1
    _hold_renewed_and_cancelled()
    assert outbox.relay_batch() == 3
    _hold_renewed_and_cancelled()
    assert outbox.relay_batch() == 0


def _gauge(name: str) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(f"reservation_cleanup_{name}")


# --- on RabbitMQ: a vhost of this module's own ------------------------------------------------

VHOST = f"reservations-unit-outbox-{os.getpid()}"


@pytest.fixture(scope="module")
def vhost_url() -> Iterator[str]:
    """A vhost of this module on the machine's RabbitMQ, deleted afterwards."""
    with private_vhosts(VHOST):
        yield rabbitmq_vhost_url(VHOST)


@pytest.fixture
def rabbitmq(vhost_url, settings, monkeypatch) -> Iterator[kombu.Connection]:
    """The relay publishing to and reading the depth from the module's vhost, the events queue
    deleted first; the connection, to read the queue back."""
    settings.CELERY_BROKER_URL = vhost_url
    settings.BROKER_IS_REDIS = False
    # the app's own connections (the depth's passive declare) on the screened AMQP transport,
    # as config/settings/base.py chooses it for an amqp:// broker
    monkeypatch.setitem(
        current_app.conf, "broker_transport", "cleanup.worker.amqp_transport:Transport"
    )
    with kombu.Connection(vhost_url) as connection:
        channel: Any = connection.channel()
        channel.queue_delete(cleanup_settings().events_queue)
        channel.close()
        pooled = Producer(connection)

        @contextmanager
        def producer_or_acquire(producer: Any = None) -> Iterator[Any]:
            yield producer if producer is not None else pooled

        monkeypatch.setattr(current_app, "producer_or_acquire", producer_or_acquire)
        yield connection


def _take_all(connection: kombu.Connection, queue: str) -> list[dict[str, Any]]:
    """Every message waiting in ``queue``, taken off it (acknowledged), oldest first."""
    taken = []
    channel: Any = connection.channel()
    try:
        while (message := channel.basic_get(queue)) is not None:
            assert message.content_type == "application/json"
            taken.append(json.loads(message.body))
            channel.basic_ack(message.delivery_tag)
    finally:
        channel.close()
    return taken


@pytest.mark.usefixtures("db")
def test_every_kind_is_relayed_to_rabbitmq_as_its_schema_says(rabbitmq, run_task):
    assert _every_kind(run_task) == set(domain_events.KINDS)
    assert outbox.relay_batch() == OutboxEvent.objects.count()
    _assert_each_as_its_schema_says(_take_all(rabbitmq, cleanup_settings().events_queue))


@pytest.mark.usefixtures("db")
def test_on_rabbitmq_the_relay_is_held_back_at_the_maximum_then_relays_in_order(rabbitmq, settings):
    # given: an events queue of at most 3 messages, holding 3
    settings.CLEANUP_EVENTS_QUEUE_MAX_LENGTH = 3
    queue = cleanup_settings().events_queue
    _hold_renewed_and_cancelled()
    assert outbox.relay_batch() == 3
    _hold_renewed_and_cancelled()
    waiting = list(OutboxEvent.objects.filter(published_at__isnull=True).order_by("id"))
    # when / then: the depth read by a passive declare stops the relay; nothing is lost
    assert outbox.relay_batch() == 0
    assert OutboxEvent.objects.filter(published_at__isnull=True).count() == 3
    # and once drained, the waiting events go out, in order
    assert len(_take_all(rabbitmq, queue)) == 3
    assert outbox.relay_batch() == 3
    assert [e["event_id"] for e in _take_all(rabbitmq, queue)] == [e.pk for e in waiting]
