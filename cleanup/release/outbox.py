"""Outbox relay and retention.

The relay publishes unpublished domain events in id order to ``CLEANUP_EVENTS_QUEUE`` (a plain
JSON message per event) and marks them published in the same transaction, on RabbitMQ once the
broker has confirmed every one of them; a transaction-level
advisory lock keeps a single relay at a time, so order holds. Delivery is at-least-once:
consumers dedupe by ``event_id``.

Retention deletes, in bounded batches, only what is finished: published events, receipts, and
resolved dead letters older than ``CLEANUP_RETENTION_DAYS``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.utils import timezone

from cleanup import sql
from cleanup.broker import queues
from cleanup.broker.celery_app import app
from cleanup.broker.confirms import confirmed_producer
from cleanup.conf import PRUNE_BATCH_SIZE, cleanup_settings
from cleanup.release import locks
from reservations.models import OutboxEvent

logger = logging.getLogger("cleanup.outbox")
# Events relayed per batch, under one transaction: the relay runs every few seconds, so 500 keeps
# up with thousands of events a second while one batch's publish-and-confirm stays well inside
# the task's time limit.
RELAY_BATCH_SIZE = 500


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
        # On RabbitMQ on a new channel, confirmed before the events are marked published
        # (cleanup.broker.confirms): an event the broker refused or never answered for rolls
        # the marks back and is relayed again, never lost.
        with app.producer_or_acquire() as pooled, confirmed_producer(pooled) as producer:
            confirmed = producer is not pooled
            for event in events:
                producer.publish(
                    {
                        "event_id": event["id"],
                        "kind": event["kind"],
                        "reservation_id": event["reservation_id"],
                        "version": event["version"],
                        "payload": event["payload"],
                        "created_at": event["created_at"].isoformat(),
                    },
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
    retention_days: int | None = None, dead_letter_retention_days: int | None = None
) -> dict[str, int]:
    """Delete published outbox events and receipts older than ``CLEANUP_RETENTION_DAYS``,
    and dead letters resolved more than ``CLEANUP_DEAD_LETTER_RETENTION_DAYS`` ago (open
    letters are never deleted: the open-letter cap summarises them instead,
    ``dead_letters.summarise_beyond_cap``)."""
    now = timezone.now()
    cutoff = now - timedelta(days=retention_days or cleanup_settings().retention_days)
    letters_cutoff = now - timedelta(
        days=dead_letter_retention_days or cleanup_settings().dead_letter_retention_days
    )
    batch = PRUNE_BATCH_SIZE
    return {
        "outbox_events": _delete_batches(sql.PRUNE_PUBLISHED_EVENTS, cutoff, batch),
        "receipts": _delete_batches(sql.PRUNE_RECEIPTS, cutoff, batch),
        "dead_letters": _delete_batches(sql.PRUNE_RESOLVED_DEAD_LETTERS, letters_cutoff, batch),
    }
