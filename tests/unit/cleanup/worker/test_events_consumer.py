"""The events consumer step (cleanup.worker.events_consumer) reading the tests' own Redis database
through the project's screened transport: an event is acknowledged only after its task message
is on the broker, a failed send leaves it unacknowledged and it goes back to the events queue
(not to a dead letter), a message that is not an event is dead-lettered once, and the product's own
app consumes nothing of the events queue. In a real worker: tests/integration/
test_events_consumer.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import kombu
import pytest
from celery import bootsteps, current_app
from django.conf import settings

from cleanup.broker.readers import priority_keys, redis_client, unacked_count
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release import outbox
from cleanup.worker import events_consumer as consumer_module
from cleanup.worker.events_consumer import events_consumer
from reservations import events as domain_events
from reservations import services
from tests.support.planted import queued_bodies

HOST_TASK = "host.on_reservation_event"


@pytest.fixture
def step() -> Any:
    """The step a host adds, sending to the maintenance queue (the project's app refuses any
    queue but its own task queues)."""
    step_class = events_consumer(current_app, HOST_TASK, queue=cleanup_settings().maintenance_queue)
    made: Any = step_class(SimpleNamespace())
    made.fatal = ()
    return made


@pytest.fixture
def connection(broker: Any) -> Iterator[kombu.Connection]:
    """A connection to the tests' Redis database on the project's screened transport."""
    with kombu.Connection(
        settings.CELERY_BROKER_URL, transport="cleanup.worker.redis_transport:Transport"
    ) as conn:
        yield conn


def _receive_one(step: Any, connection: kombu.Connection) -> Any:
    """Consume the events queue with the step's consumer until one message was handled; the
    channel (kombu restores what it still holds unacknowledged when it closes)."""
    channel = connection.channel()
    (consumer,) = step.get_consumers(channel)
    consumer.consume()
    connection.drain_events(timeout=5)
    return channel


def _one_event() -> dict[str, Any]:
    offering = services.create_offering("consumer", 1)
    services.hold_seat(offering.pk, "a", 60)
    assert outbox.relay_batch() == 1
    (event,) = queued_bodies(redis_client(), cleanup_settings().events_queue)
    return event


def test_an_event_is_acknowledged_only_after_its_task_message_is_sent(
    db, step, connection, broker, monkeypatch
):
    # given: a relayed event on the events queue
    event = _one_event()
    queue = cleanup_settings().events_queue
    unacked_during_send = []
    send = consumer_module.send

    def noting_send(*args: Any) -> None:
        unacked_during_send.append(unacked_count(queue))
        send(*args)

    monkeypatch.setattr(consumer_module, "send", noting_send)
    # when: the step handles it
    _receive_one(step, connection).close()
    # then: it was still unacknowledged while its task was sent, and acknowledged after
    assert unacked_during_send == [1]
    assert (unacked_count(queue), queued_bodies(broker, queue)) == (0, [])
    # and the host's task message carries the event as its one argument
    (task_body,) = queued_bodies(broker, cleanup_settings().maintenance_queue)
    assert task_body[0] == [event]
    domain_events.validate(task_body[0][0])


def test_a_failed_send_leaves_the_event_unacknowledged_and_it_returns_to_its_queue(
    db, step, connection, broker, monkeypatch, caplog
):
    event = _one_event()
    queue = cleanup_settings().events_queue

    def refused(*_: Any) -> None:
        raise RuntimeError("no such queue")

    monkeypatch.setattr(consumer_module, "send", refused)
    with caplog.at_level(logging.ERROR, logger="cleanup.events_consumer"):
        channel = _receive_one(step, connection)
    # then: nothing sent, the event held unacknowledged, and why logged
    assert queued_bodies(broker, cleanup_settings().maintenance_queue) == []
    assert unacked_count(queue) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "cleanup.events_consumer"]
    assert logged == ["event not handed on; left unacknowledged"]
    # when: the consumer's channel goes (a worker stopping): kombu restores what it held
    channel.close()
    # then: the event is back on the events queue, not dead-lettered as routed elsewhere
    assert queued_bodies(broker, queue) == [event]
    assert (unacked_count(queue), DeadLetter.objects.count()) == (0, 0)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"[1, 2", "(message): not JSON"),
        (b'{"schema_version": 1, "kind": "reservation.held"}', "event_id: None is not a"),
        (b'{"schema_version": 0, "kind": "reservation.held", "event_id": 1}', "schema_version"),
    ],
)
def test_a_message_that_is_not_an_event_is_dead_lettered_once(
    db, step, connection, broker, body, error
):
    queue = cleanup_settings().events_queue
    _publish(connection, body)
    _receive_one(step, connection).close()
    (letter,) = DeadLetter.objects.all()
    assert (letter.reason, letter.error[: len(error)]) == (DeadLetter.Reason.MALFORMED, error)
    assert (queued_bodies(broker, queue), unacked_count(queue)) == ([], 0)
    assert queued_bodies(broker, cleanup_settings().maintenance_queue) == []


def test_an_event_of_a_newer_schema_version_is_acknowledged_and_not_handed_on(
    db, step, connection, broker
):
    newer = {**_one_event(), "schema_version": 2}
    queue = cleanup_settings().events_queue
    broker.delete(*priority_keys(queue))  # only the newer copy waits
    _publish(connection, json.dumps(newer).encode())
    _receive_one(step, connection).close()
    assert (queued_bodies(broker, queue), unacked_count(queue)) == ([], 0)
    assert queued_bodies(broker, cleanup_settings().maintenance_queue) == []
    assert DeadLetter.objects.count() == 0


def test_the_products_own_app_consumes_nothing_of_the_events_queue() -> None:
    """Only a host's step consumes it (the tests' stand-in host names tests.keep_event)."""
    steps = [
        step
        for step in current_app.steps["consumer"]
        if isinstance(step, type)
        and issubclass(step, bootsteps.ConsumerStep)
        and step.__module__ == consumer_module.__name__
        and not str(step.name).endswith("[tests.keep_event]")
    ]
    assert steps == []


def test_a_step_needs_a_task_name() -> None:
    with pytest.raises(ValueError, match="needs the name of the task"):
        events_consumer(current_app, "")


def _publish(connection: kombu.Connection, body: bytes) -> None:
    from cleanup.broker import queues

    queue = queues.events_queue(cleanup_settings())
    connection.Producer().publish(
        body,
        exchange=queue.exchange,
        routing_key=queue.routing_key,
        declare=[queue],
        content_type="application/json",
        content_encoding="utf-8",
    )
