"""The events consumer (cleanup.worker.events_consumer) in a real ``celery worker`` of the project
(its screened transport, its dead-lettering consumer), as a host adds it to its own worker
(tests/support/event_tasks.py): each event the relay published reaches the host's task, and a
message on the events queue that is not an event is dead-lettered once, never delivered again."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from cleanup.broker import queues
from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release import outbox
from reservations import events as domain_events
from reservations import services
from reservations.models import OutboxEvent
from tests.support.event_tasks import kept_events
from tests.support.fleet import dedicated, log_lines, queue_settled, unacked, wait_until

pytestmark = [pytest.mark.workers]

HOST_STEP = ["-I", "tests.support.event_tasks"]


def publish_to_events_queue(body: Any, content_type: str = "application/json") -> None:
    """Put ``body`` (bytes as they are, anything else as JSON) on the events queue, as anyone
    who can write to the broker could."""
    from config.celery_app import app

    raw = body if isinstance(body, bytes) else json.dumps(body, default=str).encode()

    queue = queues.events_queue(cleanup_settings())
    with app.connection_for_write() as conn:
        conn.Producer().publish(
            raw,
            exchange=queue.exchange,
            routing_key=queue.routing_key,
            declare=[queue],
            content_type=content_type,
            content_encoding="utf-8",
        )


def test_a_host_worker_hands_each_event_to_its_task_and_sets_aside_what_is_not_one(
    clean, exclusive_workers, tmp_path
):
    # given: three events relayed to the events queue, and among them messages that are not
    # events: not JSON, a JSON list, an event of an unknown kind
    offering = services.create_offering("events", 2)
    hold = services.hold_seat(offering.pk, "a", 60)
    services.renew(hold.pk, 1, 120)
    assert outbox.relay_batch() == 2
    publish_to_events_queue(b"{not json", content_type="application/json")
    publish_to_events_queue([1, 2, 3])
    stray = {**domain_events.message(**_row(OutboxEvent.objects.first())), "kind": "seat.moved"}
    publish_to_events_queue(stray)
    services.confirm(hold.pk, 2)
    assert outbox.relay_batch() == 1
    queue = cleanup_settings().events_queue
    # when: a worker with the host's consumer step runs
    with dedicated(tmp_path, {"extra_args": HOST_STEP}) as (worker,):
        wait_until(lambda: len(kept_events()) == 3, timeout=60, what="three events handed on")
        wait_until(lambda: queue_settled(queue), timeout=30, what="events queue settled")
        # then: the host's task got each event, as the relay published it, in order
        kept = kept_events()
        assert [e["kind"] for e in kept] == [
            "reservation.held",
            "reservation.renewed",
            "reservation.confirmed",
        ]
        for event in kept:
            domain_events.validate(event)
        assert [e["event_id"] for e in kept] == list(
            OutboxEvent.objects.order_by("id").values_list("id", flat=True)
        )
        # and each message that is not an event is one dead letter, never delivered again
        letters = wait_until(
            lambda: (
                list(DeadLetter.objects.order_by("id")) if DeadLetter.objects.count() == 3 else None
            ),
            timeout=30,
            what="three dead letters",
        )
        assert {letter.reason for letter in letters} == {DeadLetter.Reason.MALFORMED}
        errors = [letter.error for letter in letters]
        assert errors[0].startswith("(message): not JSON")
        assert errors[1] == "(message): a JSON list, not an object"
        assert errors[2].startswith("kind: 'seat.moved' is not one of")
        time.sleep(3)  # a message that looped would come back within this
        assert DeadLetter.objects.count() == 3
        assert (unacked(queue) or 0) == 0
        assert len(log_lines([worker.log_path], "events queue message dead-lettered")) == 3


def _row(event: OutboxEvent | None) -> dict[str, Any]:
    assert event is not None
    return {
        "event_id": event.pk,
        "kind": event.kind,
        "reservation_id": event.reservation_id,
        "version": event.version,
        "payload": event.payload,
        "created_at": event.created_at,
    }
