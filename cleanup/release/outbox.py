"""Outbox relay and retention.

The relay publishes unpublished domain events in id order to ``CLEANUP_EVENTS_QUEUE`` (a plain
JSON message per event, ``reservations.events.message``; each kind's schema is in
``reservations/event_schemas``) and marks them published in the same transaction, on RabbitMQ
once the broker has confirmed every one of them; a transaction-level advisory lock keeps a
single relay at a time, so order holds. Delivery is at-least-once: consumers dedupe by
``event_id``.

The events queue is bounded: under the lock, before a batch, the relay reads the queue's depth,
and at ``CLEANUP_EVENTS_QUEUE_MAX_LENGTH`` or more it relays nothing that round (the events stay
in the outbox, unpublished), so the queue holds at most that plus one batch less one.

Retention deletes, in bounded batches, what is finished: published events, receipts, and
resolved dead letters older than ``CLEANUP_RETENTION_DAYS``; and events nobody could be sent
in that time (never relayed, older than the same retention), counted and logged as a warning,
so that an unconsumed stream cannot grow the outbox without end either. docs/EVENTS.md.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from cleanup import metrics, sql
from cleanup.broker import queues, readers
from cleanup.broker.celery_app import app
from cleanup.broker.confirms import confirmed_producer
from cleanup.conf import PRUNE_BATCH_SIZE, cleanup_settings
from cleanup.release import delivery_cap, locks
from reservations import events as domain_events
from reservations.models import OutboxEvent

logger = logging.getLogger("cleanup.outbox")
# Events relayed per batch, under one transaction: the relay runs every few seconds, so 500 keeps
# up with thousands of events a second while one batch's publish-and-confirm stays well inside
# the task's time limit.
RELAY_BATCH_SIZE = 500
# While the events queue stays full the relay is held back every round (every few seconds): the
# counter counts each round, the log says so at most once a minute per process.
HELD_BACK_LOG_EVERY_S = 60.0
_held_back_logged_at: float | None = None


def relay_batch(limit: int | None = None) -> int:

    conf = cleanup_settings()
    limit = limit or RELAY_BATCH_SIZE
    # A quorum queue with CLEANUP_RABBITMQ_QUEUE_TYPE=quorum (cleanup.broker.queues).
    queue = queues.events_queue(conf)
    with transaction.atomic():
        if not locks.try_transaction_lock(locks.OUTBOX_RELAY):
            return 0
        events = list(
            OutboxEvent.objects.filter(published_at__isnull=True)
            .order_by("id")
            .values("id", "kind", "reservation_id", "version", "payload", "created_at")[:limit]
        )
        if not events:
            return 0
        # Read under the lock: no other relay publishes between this reading and the batch.
        depth = readers.queue_depth(queue.name)
        held_back = depth >= conf.events_queue_max_length
        metrics.record_events_queue_depth(depth, held_back)
        if held_back:
            _log_held_back(
                {
                    "queue": queue.name,
                    "queue_depth": depth,
                    "max_length": conf.events_queue_max_length,
                    "waiting": len(events),
                }
            )
            return 0
        # On RabbitMQ on a new channel, confirmed before the events are marked published
        # (cleanup.broker.confirms): an event the broker refused or never answered for rolls
        # the marks back and is relayed again, never lost.
        with app.producer_or_acquire() as pooled, confirmed_producer(pooled) as producer:
            confirmed = producer is not pooled
            for event in events:
                producer.publish(
                    domain_events.message(
                        event_id=event["id"],
                        kind=event["kind"],
                        reservation_id=event["reservation_id"],
                        version=event["version"],
                        payload=event["payload"],
                        created_at=event["created_at"],
                    ),
                    exchange=queue.exchange,
                    routing_key=queue.routing_key,
                    declare=[queue],
                    serializer="json",
                    retry=not confirmed,
                )
        OutboxEvent.objects.filter(id__in=[e["id"] for e in events]).update(
            published_at=timezone.now()
        )
    logger.info("outbox relayed", extra={"published": len(events)})
    return len(events)


def _log_held_back(fields: dict[str, object]) -> None:
    global _held_back_logged_at
    now = time.monotonic()
    if _held_back_logged_at is None or now - _held_back_logged_at >= HELD_BACK_LOG_EVERY_S:
        _held_back_logged_at = now
        logger.warning("outbox relay held back: the events queue is full", extra=fields)


def _delete_batches(statement: str, before: datetime, batch: int) -> int:
    """Run a ``cleanup.sql.PRUNE_*`` statement until it deletes less than a batch."""
    total = 0
    while True:
        with connection.cursor() as cur:
            cur.execute(statement, {"before": before, "batch": batch})
            deleted = cur.rowcount
        total += deleted
        if deleted < batch:
            return total


def prune(
    retention_days: float | None = None, dead_letter_retention_days: float | None = None
) -> dict[str, int]:
    """Delete outbox events (published or not) and receipts older than
    ``CLEANUP_RETENTION_DAYS``, delivery counts a day after their last change, and dead letters
    resolved more than ``CLEANUP_DEAD_LETTER_RETENTION_DAYS`` ago (open letters are never
    deleted: the open-letter cap summarises them instead, ``dead_letters.summarise_beyond_cap``).
    Unpublished events deleted are counted (``reservation_cleanup_outbox_events_expired_total``)
    and logged."""
    now = timezone.now()
    days = retention_days or cleanup_settings().retention_days
    cutoff = now - timedelta(days=days)
    letters_cutoff = now - timedelta(
        days=dead_letter_retention_days or cleanup_settings().dead_letter_retention_days
    )
    batch = PRUNE_BATCH_SIZE
    expired = _delete_batches(sql.PRUNE_UNPUBLISHED_EVENTS, cutoff, batch)
    if expired:
        metrics.record_events_expired(expired)
        logger.warning(
            "unpublished outbox events deleted by retention, never relayed",
            extra={"deleted": expired, "retention_days": days},
        )
    return {
        "outbox_events": _delete_batches(sql.PRUNE_PUBLISHED_EVENTS, cutoff, batch),
        "unpublished_outbox_events": expired,
        "receipts": _delete_batches(sql.PRUNE_RECEIPTS, cutoff, batch),
        "dead_letters": _delete_batches(sql.PRUNE_RESOLVED_DEAD_LETTERS, letters_cutoff, batch),
        "delivery_counts": _delete_batches(
            sql.PRUNE_DELIVERY_COUNTS,
            now - timedelta(seconds=delivery_cap.COUNTER_TTL_SECONDS),
            batch,
        ),
    }
