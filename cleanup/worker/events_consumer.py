"""A consumer of the events queue for a host project's Celery worker: each domain event the
outbox relay published is handed to a Celery task of the host's. docs/EVENTS.md, "Consuming
the events".

The events are plain JSON messages, not Celery task messages, so a worker does not consume the
events queue by itself (the product's own workers never do). A host adds the step this factory
makes to its app's consumer blueprint::

    app.steps["consumer"].add(events_consumer(app, "billing.tasks.on_reservation_event"))

Every worker of that app then reads ``CLEANUP_EVENTS_QUEUE`` (its own channel, on the worker's
broker connection) and, for each message:

- a valid event (a JSON object with a known ``schema_version``, a kind and an ``event_id``:
  ``reservations.events.check_envelope``) is sent as ``send_task(task_name, args=[event])``,
  on RabbitMQ through a confirm-mode channel and confirmed, and only then acknowledged: an
  event is never acknowledged before its task message is on the broker (at least once; a
  worker lost in between sends it again, so the task deduplicates by ``event_id``);
- an event of a newer ``schema_version`` than this release knows is acknowledged and not
  handed on: while a version is deprecated, each event is published in both versions, and
  this consumer hands on the one it knows (a warning says so, at most once a minute);
- anything else (not JSON, not an object, an unknown kind, a body larger than
  ``CLEANUP_MAX_MESSAGE_BYTES``) is logged, kept as a ``malformed`` dead letter and rejected:
  it never comes back, so it cannot loop;
- a send that fails leaves the event unacknowledged and logged: a lost connection restarts the
  consumer and the broker delivers the event again; any other failure keeps it unacknowledged
  (on Redis it comes back after the visibility timeout, on RabbitMQ when the worker's connection
  is next opened), so a misconfigured task name or queue stops the flow, visibly, and loses
  nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery, bootsteps
from kombu import Consumer
from kombu.exceptions import ContentDisallowed, DecodeError

from cleanup.broker import queues, screening
from cleanup.broker.confirms import confirmed_producer
from cleanup.conf import cleanup_settings
from reservations.events import KNOWN_SCHEMA_VERSIONS, InvalidEvent, check_envelope

logger = logging.getLogger("cleanup.events_consumer")

# Events a worker holds unacknowledged at once: each is sent on and acknowledged one by one in
# the worker's main process, so a few keep the consumer busy without holding many back from
# the host's other workers.
PREFETCH_COUNT = 10


def events_consumer(
    app: Celery, task_name: str, *, queue: str | None = None
) -> type[bootsteps.ConsumerStep]:
    """A consumer step (add it to ``app.steps["consumer"]``) that hands each event of the events
    queue to the task ``task_name`` as its one argument, sent to ``queue`` (None: where the
    app's routes send that task)."""
    if not isinstance(task_name, str) or not task_name:
        raise ValueError("events_consumer needs the name of the task that takes each event")

    class EventsConsumer(bootsteps.ConsumerStep):  # type: ignore[misc]
        name = f"{__name__}.EventsConsumer[{task_name}]"

        def get_consumers(self, channel: Any) -> list[Consumer]:
            return [
                Consumer(
                    channel,
                    queues=[queues.events_queue(cleanup_settings())],
                    on_message=self.on_message,
                    on_decode_error=self.on_decode_error,
                    accept=["json"],
                    prefetch_count=PREFETCH_COUNT,
                )
            ]

        fatal: tuple[type[BaseException], ...] = ()

        def start(self, c: Any) -> None:
            self.fatal = tuple(c.connection_errors) + tuple(c.channel_errors)
            super().start(c)

        def on_message(self, message: Any) -> None:
            try:
                event = read_event(message)
            except NewerSchemaVersion as exc:
                skip_newer(message, exc.version)
                return
            except InvalidEvent as exc:
                dead_letter_non_event(message, str(exc))
                return
            try:
                send(app, task_name, queue, event)
            except self.fatal:
                raise  # the consumer restarts; the broker delivers the event again
            except Exception:
                logger.exception(
                    "event not handed on; left unacknowledged",
                    extra={"event_id": event["event_id"], "task": task_name},
                )
                return
            message.ack()

        def on_decode_error(self, message: Any, exc: Exception) -> None:
            dead_letter_non_event(message, f"undecodable message: {exc!r}"[:2000])

    EventsConsumer.__qualname__ = EventsConsumer.__name__
    return EventsConsumer


def read_event(message: Any) -> dict[str, Any]:
    """The event a message carries; ``InvalidEvent`` (naming the field) when it is not one."""
    problem = screening.check_raw(message.body) or screening.check_content(
        message.content_type, message.content_encoding
    )
    if problem is not None:
        raise InvalidEvent("(message)", problem)
    try:
        event = message.decode()
    except (DecodeError, ContentDisallowed, ValueError, RecursionError) as exc:
        raise InvalidEvent("(message)", f"not JSON: {exc!r}"[:300]) from exc
    version = event.get("schema_version") if isinstance(event, dict) else None
    if isinstance(version, int) and not isinstance(version, bool):
        if version > max(KNOWN_SCHEMA_VERSIONS):
            raise NewerSchemaVersion(version)
    check_envelope(event)
    return event  # type: ignore[no-any-return]


class NewerSchemaVersion(InvalidEvent):
    """An event of a schema_version newer than this release knows: published beside the one
    this consumer reads while the older one is deprecated (docs/EVENTS.md, "The change rule")."""

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__("schema_version", f"{version} is newer than this consumer knows")


# Each event of a newer schema_version is skipped; the log says so at most once a minute.
SKIPPED_LOG_EVERY_S = 60.0
_skipped_logged_at: float | None = None


def skip_newer(message: Any, version: int) -> None:
    """Acknowledge an event of a newer schema_version without handing it on: its copy in the
    version this consumer knows is published beside it."""
    global _skipped_logged_at
    now = time.monotonic()
    if _skipped_logged_at is None or now - _skipped_logged_at >= SKIPPED_LOG_EVERY_S:
        _skipped_logged_at = now
        logger.warning(
            "events of a newer schema_version skipped",
            extra={"schema_version": version, "known": sorted(KNOWN_SCHEMA_VERSIONS)},
        )
    message.ack()


def send(app: Celery, task_name: str, queue: str | None, event: dict[str, Any]) -> None:
    """``send_task(task_name, args=[event])``, returning once the broker has it (on RabbitMQ,
    confirmed: ``cleanup.broker.confirms``)."""
    with app.producer_or_acquire() as pooled, confirmed_producer(pooled) as producer:
        app.send_task(
            task_name,
            args=[event],
            queue=queue,
            producer=producer,
            retry=producer is pooled,
        )


def dead_letter_non_event(message: Any, error: str) -> None:
    """Keep a message that is not an event as a dead letter and reject it (never raises but
    for the connection): it is not delivered again."""
    logger.error("events queue message dead-lettered: not an event", extra={"error": error[:300]})
    # Imported here: a host's Celery module imports this one while Django loads its apps.
    from cleanup.models import DeadLetter  # noqa: PLC0415
    from cleanup.worker.signals import dead_letter_message  # noqa: PLC0415

    dead_letter_message(message, DeadLetter.Reason.MALFORMED, error)
    if not message.acknowledged:
        message.reject(requeue=False)
