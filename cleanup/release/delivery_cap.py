"""Redeliveries per idempotency key, counted outside the task's transaction; and a per-minute
tally of release attempts.

The counter bounds loops: a message whose delivery kills its worker, times out or keeps
failing comes back as a redelivery or as a retry; above ``CLEANUP_MAX_DELIVERIES`` deliveries
in all (the uncounted first one included) it is dead-lettered before any work. A redelivery is
counted only on the word of whatever made it, never on a flag in the message, which any
publisher can set, and for a release message only when the project signed it
(``cleanup.broker.signing``; any other task's message counts under its own task id):

- kombu's Redis transport restoring an unacknowledged message (after a crash, a lost pool
  process, a shutdown): counted as it is restored (``count_restored``, called by the worker's
  transport), when its signature verifies;
- the project's own retry: counted as it is published (``CleanupTask.retry``);
- RabbitMQ's ``redelivered`` flag, which the broker sets in the delivery itself: counted when
  the message arrives (``increment``; an unsigned release message never gets that far).

A message marked as a redelivery or a retry then only *reads* its key's count (``current``): a
forged mark costs nothing and spends no real hold's budget. A first delivery cannot be a loop
yet, so it is not counted: the common path makes no round trip here.

The counts live in PostgreSQL (``cleanup_deliverycount``, an autocommit upsert), where a broker
writer cannot write: kept in the broker's Redis, a written count spent a real hold's budget.
``prune`` deletes counts a day after their last change.

The tally (the health page's "delivery attempts" per minute, and the drills' attempt counts)
counts every release attempt, per hold, in this process's memory; a daemon thread adds it to
``CLEANUP_COUNTER_REDIS_URL`` every ``TALLY_FLUSH_SECONDS`` (and the process adds the rest when
it stops): a process that is killed loses at most that much of its tally. It is informative
only: nothing is decided on it.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from typing import Any

from django.db import models
from kombu.utils.json import loads

from cleanup import sql
from cleanup.broker import signing
from cleanup.conf import cleanup_settings
from cleanup.models import DeliveryCount
from cleanup.release.messages import BATCH_KIND, MalformedMessage, validate, validate_batch
from reservations import redis_clients
from reservations.db import scalar

logger = logging.getLogger("cleanup.deliveries")

# A counter outlives every redelivery of its message by far (a message comes back within the
# visibility timeout, minutes at most, and is capped after a few deliveries), and a day bounds
# the rows a flood of distinct messages leaves (``prune``).
COUNTER_TTL_SECONDS = 86400
# Release attempts per minute: one key per UTC minute, kept for two hours.
TALLY_PREFIX = "reservation-cleanup:attempts:"
TALLY_TTL = 7200
TALLY_FLUSH_SECONDS = 1.0

_pending: dict[int, int] = {}  # minute -> attempts not yet added to Redis
_pending_lock = threading.Lock()
_flusher: list[threading.Thread] = []  # this process's flush thread, once started


def message_key(message: Any, task_id: str) -> str:
    """The key a task's deliveries are counted under: a valid release message counts by its
    idempotency key (a batch by its items' keys), anything else by its task id, which
    redelivery and retries keep. A malformed message never counts against a real key."""
    try:
        if isinstance(message, dict) and message.get("kind") == BATCH_KIND:
            return validate_batch(message).batch_key
        return validate(message).idempotency_key
    except MalformedMessage:
        return f"task:{task_id}"


def envelope_key(envelope: Any) -> str | None:
    """``message_key`` of a kombu Redis envelope (a task message as it sits in a queue or in
    the ``unacked`` hash); ``None`` when it is not a task message this can read."""
    try:
        task_id = envelope["headers"]["id"]
        message = envelope_message(envelope)
    except Exception:  # noqa: BLE001 - the envelope was screened; anything odd is not counted
        return None
    return message_key(message, str(task_id)) if isinstance(task_id, str) else None


def envelope_message(envelope: Any) -> Any:
    """The release message a kombu Redis envelope carries (its task's first argument); raises
    on an envelope that is not a task message."""
    args, kwargs, _embed = loads(base64.b64decode(envelope["body"]))
    return args[0] if args else kwargs.get("message")


def restored_key(envelope: Any) -> str | None:
    """The key a restored envelope's redelivery counts under: a release message's only when the
    project signed it (an entry planted in kombu's ``unacked`` hash with a real hold's key
    counts nowhere), any other task's under its own task id (``task:<id>``, as
    ``CleanupTask.delivery_key`` reads it), so that it bounds its own loop and never a hold's."""
    try:
        name, task_id = envelope["headers"].get("task"), envelope["headers"].get("id")
    except Exception:  # noqa: BLE001 - the envelope was screened; anything odd is not counted
        return None
    if not isinstance(task_id, str):
        return None
    if name in signing.SIGNED_TASKS:
        return envelope_key(envelope) if signing.envelope_is_signed(envelope) else None
    return f"task:{task_id}"


def count_restored(envelope: Any) -> None:
    """Count one redelivery of a message kombu's Redis transport is restoring
    (``restored_key``); never raises (a counter that cannot be written only weakens the loop
    bound for this message)."""
    key = restored_key(envelope)
    if key is None:
        return
    try:
        increment(key)
    except Exception as exc:  # noqa: BLE001 - the counter is a guard, not a dependency
        logger.warning("restored message not counted", extra={"key": key, "error": repr(exc)[:200]})


def increment(key: str) -> int:
    """Count one more redelivery of ``key`` and return the redeliveries counted so far."""
    # autocommit: outside any transaction by design
    return int(scalar(sql.COUNT_DELIVERY, [key]))


def tally(attempts: int = 1) -> None:
    """Count release attempts (one per hold) for the per-minute tally; never raises."""
    if not cleanup_settings().counter_redis_url:
        return
    minute = current_minute()
    with _pending_lock:
        _pending[minute] = _pending.get(minute, 0) + attempts
    if not _flusher:  # first use in this process (a pool process is forked without it)
        thread = threading.Thread(target=_flush_forever, name="attempt-tally", daemon=True)
        _flusher.append(thread)
        thread.start()


def _flush_forever() -> None:
    while True:
        time.sleep(TALLY_FLUSH_SECONDS)
        flush_tally()


def flush_tally() -> None:
    """Add this process's pending tally to Redis (one pipelined round trip); never raises."""
    url = cleanup_settings().counter_redis_url
    with _pending_lock:
        pending = dict(_pending)
        _pending.clear()
    if not pending or not url:
        return
    try:
        pipe = redis_clients.client(url).pipeline(transaction=False)
        for minute, attempts in pending.items():
            pipe.incrby(f"{TALLY_PREFIX}{minute}", attempts)
            pipe.expire(f"{TALLY_PREFIX}{minute}", TALLY_TTL)
        pipe.execute()
    except Exception as exc:  # noqa: BLE001 - the tally is informative; the work is done
        logger.warning("attempt tally not written", extra={"error": repr(exc)[:200]})


def _forget_after_fork() -> None:
    # A forked child has no flush thread (threads do not survive fork) and a fresh lock.
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()
    _flusher.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def current(key: str) -> int:
    row = DeliveryCount.objects.filter(pk=key).values_list("count", flat=True).first()
    return int(row or 0)


def current_minute(now: float | None = None) -> int:
    """The tally's minute number (epoch minutes) of ``now`` (default: the current time)."""
    return int(time.time() if now is None else now) // 60


def _tallied(first: int, last: int) -> int | None:
    """Attempts flushed for minutes ``first``..``last``; None without a Redis counter."""
    url = cleanup_settings().counter_redis_url
    if not url:
        return None
    keys = [f"{TALLY_PREFIX}{m}" for m in range(first, last + 1)]
    return sum(int(v) for v in redis_clients.client(url).mget(keys) if v is not None)


def attempts_since(minutes: int, *, now: float | None = None) -> int | None:
    """Release attempts (per hold) in the last ``minutes`` whole minutes plus the current one,
    as flushed so far (None when deliveries are counted in PostgreSQL: no tally is kept)."""
    current = current_minute(now)
    return _tallied(current - minutes + 1, current)


def attempts_from(minute: int) -> int:
    """Release attempts tallied (and flushed) from ``minute`` (a ``current_minute()``) to now;
    0 without a Redis counter."""
    return _tallied(minute, current_minute()) or 0


def total(keys: list[str]) -> int:
    """Redeliveries counted for these keys, summed (the burst drill's report)."""
    return int(DeliveryCount.objects.filter(pk__in=keys).aggregate(n=models.Sum("count"))["n"] or 0)
