"""Deliveries per idempotency key, counted outside the task's transaction.

The count is written before any work, so a delivery that kills its worker, times out or loops
on redelivery still counts; above ``CLEANUP_MAX_DELIVERIES`` the message is dead-lettered
before any work. Redis ``INCR`` + ``EXPIRE`` (one pipelined round trip) when a Redis URL is
configured; otherwise an autocommit upsert in PostgreSQL.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.db import connection, models

from . import redis_clients
from .models import DeliveryCount

KEY_PREFIX = "reservation-cleanup:deliveries:"
# Deliveries of release messages per minute (the health page's "delivery attempts"): one key
# per UTC minute, kept for two hours, written in the same pipelined round trip as the count.
TALLY_PREFIX = "reservation-cleanup:attempts:"
TALLY_TTL = 7200


def increment(key: str) -> int:
    """Count one more delivery of ``key`` and return the total so far."""
    url = settings.CLEANUP_COUNTER_REDIS_URL
    if url:
        pipe = redis_clients.client(url).pipeline(transaction=False)
        pipe.incr(KEY_PREFIX + key)
        pipe.expire(KEY_PREFIX + key, settings.CLEANUP_DELIVERY_COUNTER_TTL)
        if not key.startswith("task:"):  # a release message (a malformed one counts by task)
            tally = f"{TALLY_PREFIX}{int(time.time()) // 60}"
            pipe.incr(tally)
            pipe.expire(tally, TALLY_TTL)
        count = pipe.execute()[0]
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
        value = redis_clients.client(url).get(KEY_PREFIX + key)
        return int(value) if value is not None else 0
    row = DeliveryCount.objects.filter(pk=key).values_list("count", flat=True).first()
    return int(row or 0)


def attempts_since(minutes: int, *, now: float | None = None) -> int | None:
    """Release-message deliveries in the last ``minutes`` whole minutes plus the current one
    (None when deliveries are counted in PostgreSQL, which keeps no tally)."""
    url = settings.CLEANUP_COUNTER_REDIS_URL
    if not url:
        return None
    current = int(time.time() if now is None else now) // 60
    keys = [f"{TALLY_PREFIX}{m}" for m in range(current - minutes + 1, current + 1)]
    return sum(int(v) for v in redis_clients.client(url).mget(keys) if v is not None)


def total(keys: list[str]) -> int:
    """Deliveries counted for these keys, summed (the burst drill's attempt count)."""
    url = settings.CLEANUP_COUNTER_REDIS_URL
    if not url:
        return int(
            DeliveryCount.objects.filter(pk__in=keys).aggregate(n=models.Sum("count"))["n"] or 0
        )
    client = redis_clients.client(url)
    counted = 0
    for start in range(0, len(keys), 5000):
        chunk = [KEY_PREFIX + k for k in keys[start : start + 5000]]
        counted += sum(int(v) for v in client.mget(chunk) if v is not None)
    return counted
