"""Queue depth and the age of the oldest waiting message, read from the broker.

Redis (kombu's virtual transport): a queue is a list per priority step; publish is LPUSH and
consume is BRPOP, so the oldest waiting message of each list is at index -1
(docs/LIBRARY-NOTES.md §1).
Messages fetched but not yet acknowledged sit in the ``unacked`` hash, not in the lists.
RabbitMQ: depth from a passive declare; there is no peek, so the age is not available (None).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings

from config.celery_app import app

from . import redis_clients

# kombu's Redis priority steps and separator (kombu.transport.redis defaults).
PRIORITY_STEPS = (0, 3, 6, 9)
PRIORITY_SEP = "\x06\x16"


@dataclass(frozen=True)
class QueueStats:
    queue: str
    depth: int
    oldest_age_seconds: float | None  # None when empty or not observable (RabbitMQ)
    unacked: int | None  # reserved by workers, not yet acked (Redis only)


def priority_keys(queue: str) -> list[str]:
    return [queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


def redis_client() -> redis.Redis:
    return redis_clients.client(settings.CELERY_BROKER_URL)


def _enqueued_at(raw: bytes | None) -> float | None:
    if raw is None:
        return None
    try:
        message = json.loads(raw)
        value = message.get("headers", {}).get("enqueued_at")
        return float(value) if value is not None else None
    except (ValueError, TypeError, AttributeError):
        return None


def queue_depth(queue: str) -> int:
    """Waiting messages (all priorities). Cheap: one pipelined LLEN per priority list."""
    if settings.BROKER_IS_REDIS:
        pipe = redis_client().pipeline(transaction=False)
        for key in priority_keys(queue):
            pipe.llen(key)
        return int(sum(pipe.execute()))
    return _amqp_depth(queue)


def queue_stats(queue: str, *, now: float | None = None) -> QueueStats:
    if not settings.BROKER_IS_REDIS:
        return QueueStats(queue, _amqp_depth(queue), None, None)
    now = time.time() if now is None else now
    client = redis_client()
    pipe = client.pipeline(transaction=False)
    keys = priority_keys(queue)
    for key in keys:
        pipe.llen(key)
        pipe.lindex(key, -1)
    results = pipe.execute()
    depth = sum(int(results[i]) for i in range(0, len(results), 2))
    stamps = [s for s in (_enqueued_at(results[i]) for i in range(1, len(results), 2)) if s]
    oldest = now - min(stamps) if stamps else None
    return QueueStats(
        queue, depth, max(0.0, oldest) if oldest is not None else None, unacked_count(queue)
    )


def unacked_count(queue: str) -> int:
    """Messages of ``queue`` fetched by workers and not yet acknowledged (kombu's hash).

    Scans the hash's values; bounded by prefetch × consumers, so small.
    """
    client = redis_client()
    count = 0
    for _tag, value in client.hscan_iter("unacked", count=500):
        try:
            _message, _exchange, routing_key = json.loads(value)
        except (ValueError, TypeError):
            continue
        if routing_key == queue:
            count += 1
    return count


def _amqp_depth(queue: str) -> int:

    with app.connection_for_write(settings.CELERY_BROKER_URL) as conn:
        channel: Any = conn.channel()
        try:
            _name, count, _consumers = channel.queue_declare(queue=queue, passive=True)
        except Exception:  # noqa: BLE001 - a missing queue is an empty queue here
            return 0
        finally:
            try:
                channel.close()
            except Exception:  # noqa: BLE001
                pass
        return int(count)
