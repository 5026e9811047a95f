"""Dead letters: record what could not be handled, with its reason; requeue it safely.

Requeue re-publishes the same release message (same idempotency key, so a message that was
in fact handled ends ``already_handled``), or makes a set-aside hold due for a sweep again.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError, transaction
from django.utils import timezone

from reservations import services as reservation_services

from . import metrics
from .messages import BATCH_KIND, MalformedMessage, validate, validate_batch
from .models import DeadLetter

logger = logging.getLogger(__name__)

PAYLOAD_LIMIT = 8192


def _truncate(payload: Any) -> str:
    if isinstance(payload, bytes | bytearray | memoryview):
        text = bytes(payload).decode("utf-8", errors="replace")
    elif isinstance(payload, str):
        text = payload
    else:
        try:
            text = json.dumps(payload, default=repr)
        except (TypeError, ValueError):
            text = repr(payload)
    return text[:PAYLOAD_LIMIT]


def record(
    reason: str,
    *,
    error: str = "",
    task_name: str = "",
    task_id: str = "",
    payload: Any = None,
    message: dict[str, Any] | None = None,
    delivery_count: int = 0,
    reservation_id: int | None = None,
    version: int | None = None,
    idempotency_key: str = "",
    trace_id: str = "",
) -> DeadLetter | None:
    """Write a dead letter in its own transaction. Never raises: when the database itself is
    down, the dead letter is logged and counted, and the hold's lease brings it back later."""
    if message is not None:
        reservation_id = reservation_id or _int_or_none(message.get("reservation_id"))
        version = version or _int_or_none(message.get("version"))
        idempotency_key = idempotency_key or str(message.get("idempotency_key", ""))[:120]
        trace_id = trace_id or str(message.get("trace_id", ""))[:64]
    metrics.record_dead_letter(reason)
    log_fields = {
        "reason": reason,
        "task": task_name,
        "task_id": task_id,
        "reservation_id": reservation_id,
        "version": version,
        "trace_id": trace_id,
        "deliveries": delivery_count,
        "error": error[:500],
    }
    try:
        with transaction.atomic():
            letter = DeadLetter.objects.create(
                reason=reason,
                error=error[:4000],
                task_name=task_name[:200],
                task_id=task_id[:64],
                payload=_truncate(payload if payload is not None else message),
                message=message if _jsonable(message) else None,
                delivery_count=delivery_count,
                reservation_id=reservation_id,
                version=version,
                idempotency_key=idempotency_key,
                trace_id=trace_id,
            )
    except DatabaseError:
        logger.exception("dead letter could not be stored", extra=log_fields)
        return None
    logger.warning("dead-lettered", extra={**log_fields, "dead_letter_id": letter.pk})
    return letter


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _jsonable(value: Any) -> bool:
    if value is None:
        return False
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def requeue(letters: Iterable[DeadLetter], *, dry_run: bool = False) -> Counter[str]:
    """Requeue open dead letters; returns counts by what happened to each."""
    from .tasks import publish_release_messages

    results: Counter[str] = Counter()
    for letter in letters:
        if letter.resolved_at is not None:
            results["already_resolved"] += 1
            continue
        if letter.reason == DeadLetter.Reason.CLAIMS_EXHAUSTED and letter.reservation_id:
            action = "rescheduled"
            if not dry_run:
                reservation_services.reschedule_claim([letter.reservation_id])
        else:
            raw = letter.message
            try:
                if isinstance(raw, dict) and raw.get("kind") == BATCH_KIND:
                    batch = validate_batch(raw)
                    if batch.rejected:
                        raise MalformedMessage(f"{len(batch.rejected)} malformed item(s)")
                    payload = raw
                else:
                    payload = validate(raw).as_dict()
            except MalformedMessage as exc:
                results[f"not_requeueable ({exc})"] += 1
                continue
            action = "republished"
            if not dry_run:
                publish_release_messages([payload])
        results[action] += 1
        if not dry_run:
            DeadLetter.objects.filter(pk=letter.pk).update(
                resolved_at=timezone.now(), resolution=action
            )
    return results
