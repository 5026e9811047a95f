"""Deliveries per idempotency key, counted outside the task's transaction.

The count is written before any work, so a delivery that kills its worker, times out or loops
on redelivery still counts; above ``CLEANUP_MAX_DELIVERIES`` the message is dead-lettered
before any work. Redis ``INCR`` + ``EXPIRE`` (one pipelined round trip) when a Redis URL is
configured; otherwise an autocommit upsert in PostgreSQL.
"""

from __future__ import annotations

from functools import lru_cache

import redis
from django.conf import settings
from django.db import connection

from .models import DeliveryCount

KEY_PREFIX = "reservation-cleanup:deliveries:"


@lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def increment(key: str) -> int:
    """Count one more delivery of ``key`` and return the total so far."""
    url = settings.CLEANUP_COUNTER_REDIS_URL
    if url:
        pipe = _client(url).pipeline(transaction=False)
        pipe.incr(KEY_PREFIX + key)
        pipe.expire(KEY_PREFIX + key, settings.CLEANUP_DELIVERY_COUNTER_TTL)
        count, _ = pipe.execute()
        return int(count)
    table = DeliveryCount._meta.db_table
    with connection.cursor() as cur:  # autocommit: outside any transaction by design
        cur.execute(
            f"INSERT INTO {table} (idempotency_key, count, updated_at) VALUES (%s, 1, now()) "
            f"ON CONFLICT (idempotency_key) DO UPDATE SET count = {table}.count + 1, "
            f"updated_at = now() RETURNING count",
            [key],
        )
        return int(cur.fetchone()[0])


def current(key: str) -> int:
    url = settings.CLEANUP_COUNTER_REDIS_URL
    if url:
        value = _client(url).get(KEY_PREFIX + key)
        return int(value) if value is not None else 0
    row = DeliveryCount.objects.filter(pk=key).values_list("count", flat=True).first()
    return int(row or 0)
