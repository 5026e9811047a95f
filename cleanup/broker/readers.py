"""Queue depth and the age of the oldest waiting message, read from the broker.

Redis (kombu's virtual transport): a queue is a list per priority step; publish is LPUSH and
consume is BRPOP, so the oldest waiting message of each list is at index -1
(docs/LIBRARY-NOTES.md §1).
Messages fetched but not yet acknowledged sit in the ``unacked`` hash, not in the lists.
Every entry read here is untrusted: an unreadable or absurd one is skipped and counted, and the
reading goes on (the bounds are below; docs/HARDENING.md, "Planted broker state").
RabbitMQ: depth from a passive declare; there is no peek, so the age is not available (None).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings

from cleanup import metrics
from cleanup.broker import celery_policy, keys, screening
from cleanup.broker.celery_app import app
from cleanup.broker.screening import ENVELOPE_SLACK, parse_unacked
from reservations import redis_clients

_log = logging.getLogger("cleanup.broker")

# kombu's Redis priority steps and separator (kombu.transport.redis defaults).
PRIORITY_STEPS = (0, 3, 6, 9)
PRIORITY_SEP = keys.PRIORITY_SEP


@dataclass(frozen=True)
class QueueStats:
    queue: str
    depth: int
    oldest_age_seconds: float | None  # None when empty or not observable (RabbitMQ)
    unacked: int | None  # reserved by workers, not yet acked (Redis only)
    skipped: int = 0  # unreadable or absurd entries this reading skipped (Redis only)
    # Keys of the queue that hold another type than a list (planted): their depth is unknown,
    # so ``depth`` counts only the readable ones and is not to be shown as the queue's depth.
    unreadable_keys: tuple[str, ...] = ()

    @property
    def readable(self) -> bool:
        return not self.unreadable_keys


def priority_keys(queue: str) -> list[str]:
    return list(keys.queue_keys(queue, PRIORITY_STEPS))


def redis_client() -> redis.Redis:
    return redis_clients.client(settings.CELERY_BROKER_URL)


# --- Bounds on what a reader accepts (docs/HARDENING.md, "Planted broker state") -------------
#
# Anything that can write to Redis can plant entries the readers below would otherwise trust.
# An entry that is unreadable or absurd is skipped and counted in
# ``reservation_cleanup_broker_entries_skipped_total{reader}``; the reading goes on with the
# rest and never fails for one bad entry.

# An ``enqueued_at`` up to this far ahead of this host's clock is taken as "now"; further
# ahead, the entry is skipped.
CLOCK_SKEW_S = 60.0
# An ``enqueued_at`` older than this is not a message this system still holds (holds live a
# day at most, receipts are kept CLEANUP_RETENTION_DAYS): the entry is skipped.
MAX_MESSAGE_AGE_S = 30 * 86400.0
# When the oldest entry of a priority list is skipped, at most this many of the oldest entries
# of that list are read in all to find a readable one.
PEEK_ENTRIES = 4


# A planted entry stays until something removes it and is skipped by every reading: the counter
# counts each skip, the log says so at most once a minute per reader and queue.
LOG_EVERY_S = 60.0
_last_logged: dict[tuple[str, str], float] = {}


def _skipped(reader: str, problem: str, queue: str, skips: list[str] | None = None) -> None:
    metrics.record_skipped_entry(reader)
    if skips is not None:
        skips.append(reader)
    now = time.monotonic()
    if now - _last_logged.get((reader, queue), -LOG_EVERY_S) >= LOG_EVERY_S:
        _last_logged[(reader, queue)] = now
        _log.warning(
            "broker entry skipped",
            extra={"reader": reader, "queue": queue, "error": problem[:300]},
        )


def entry_stamp(raw: bytes | str, now: float) -> tuple[float | None, str | None]:
    """The ``enqueued_at`` of a list entry as ``(stamp, None)``, or ``(None, problem)``.

    Size and nesting are checked before the entry is decoded. The stamp must be a JSON number
    (not a string or a boolean), finite, no older than ``MAX_MESSAGE_AGE_S`` and no further
    than ``CLOCK_SKEW_S`` ahead of ``now``; a stamp within the skew counts as ``now``."""
    problem = screening.check_raw(raw, "queue entry", slack=ENVELOPE_SLACK)
    if problem is not None:
        return None, problem
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return None, f"queue entry is not JSON ({type(exc).__name__})"
    if not isinstance(message, dict) or not isinstance(message.get("headers"), dict):
        return None, "queue entry is not an envelope with headers"
    value = message["headers"].get("enqueued_at")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None, f"enqueued_at is not a number: {type(value).__name__}"
    try:
        stamp = float(value)
    except OverflowError:
        return None, "enqueued_at is out of range"
    if not math.isfinite(stamp):
        return None, "enqueued_at is not finite"
    if stamp < now - MAX_MESSAGE_AGE_S:
        return None, "enqueued_at is absurdly old (or negative)"
    if stamp > now + CLOCK_SKEW_S:
        return None, "enqueued_at is in the future beyond the clock skew"
    return min(stamp, now), None


def queue_depth(queue: str) -> int:
    """Waiting messages (all priorities). Cheap: one pipelined LLEN per priority list."""
    if celery_policy.broker_is_redis():
        pipe = redis_client().pipeline(transaction=False)
        names = priority_keys(queue)
        for key in names:
            pipe.llen(key)
        replies = pipe.execute(raise_on_error=False)
        return sum(_length(key, reply) for key, reply in zip(names, replies, strict=True))
    return _amqp_depth(queue)


def _length(
    key: str, reply: Any, skips: list[str] | None = None, unreadable: list[str] | None = None
) -> int:
    """An LLEN reply; a key of another type (a planted string, say) adds nothing and is listed
    in ``unreadable`` (workers set such a key aside when they next touch it; readers never
    change what they read)."""
    if isinstance(reply, redis.ResponseError):
        _skipped("queue_depth", str(reply), key, skips)
        if unreadable is not None:
            unreadable.append(keys.describe(key))
        return 0
    if isinstance(reply, Exception):
        raise reply
    return int(reply)


def _oldest_stamp(
    client: redis.Redis, key: str, tail: Any, now: float, skips: list[str]
) -> float | None:
    """The oldest readable ``enqueued_at`` among the list's ``PEEK_ENTRIES`` oldest entries,
    starting from ``tail`` (index -1); each unreadable one is skipped and counted."""
    if tail is None or isinstance(tail, redis.ResponseError):
        return None  # empty, or not a list (counted by _length)
    if isinstance(tail, Exception):
        raise tail
    stamp, problem = entry_stamp(tail, now)
    if problem is None:
        return stamp
    _skipped("queue_age", problem, key, skips)
    try:
        older = client.lrange(key, -PEEK_ENTRIES, -2) or []
    except redis.ResponseError:  # the key changed type since the first read
        return None
    # Index -2 is the next oldest, then -3, ...: read them oldest first.
    for raw in reversed(older):
        stamp, problem = entry_stamp(raw, now)
        if problem is None:
            return stamp
        _skipped("queue_age", problem, key, skips)
    return None


def queue_stats(queue: str, *, now: float | None = None) -> QueueStats:
    if not celery_policy.broker_is_redis():
        return QueueStats(queue, _amqp_depth(queue), None, None)
    now = time.time() if now is None else now
    client = redis_client()
    pipe = client.pipeline(transaction=False)
    names = priority_keys(queue)
    for key in names:
        pipe.llen(key)
        pipe.lindex(key, -1)
    results = pipe.execute(raise_on_error=False)
    skips: list[str] = []
    unreadable: list[str] = []
    depth = sum(_length(key, results[2 * i], skips, unreadable) for i, key in enumerate(names))
    stamps = [
        stamp
        for i, key in enumerate(names)
        if (stamp := _oldest_stamp(client, key, results[2 * i + 1], now, skips)) is not None
    ]
    oldest = max(0.0, now - min(stamps)) if stamps else None
    unacked = unacked_count(queue, skips)
    return QueueStats(queue, depth, oldest, unacked, len(skips), tuple(unreadable))


def unacked_count(queue: str, skips: list[str] | None = None) -> int:
    """Messages of ``queue`` fetched by workers and not yet acknowledged (kombu's hash).

    Scans the hash's values; bounded by prefetch × consumers, so small. An entry kombu's
    restore would refuse (``cleanup.broker.screening.parse_unacked``) is skipped and counted.
    """
    client = redis_client()
    count = 0
    try:
        for _tag, value in client.hscan_iter("unacked", count=500):
            entry, problem = parse_unacked(value)
            if entry is None:
                _skipped("unacked_count", problem or "unreadable", "unacked", skips)
            elif entry[2] == queue:
                count += 1
    except redis.ResponseError as exc:  # not a hash: nothing of ours is in it
        _skipped("unacked_count", str(exc), "unacked", skips)
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
