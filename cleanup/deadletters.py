"""Dead letters: record what could not be handled, with its reason; requeue it safely.

Requeue re-publishes the same release message (same idempotency key, so a message that was
in fact handled ends ``already_handled``), or makes a set-aside hold due for a sweep again.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from reservations import services as reservation_services

from . import metrics
from .messages import BATCH_KIND, MalformedMessage, validate, validate_batch
from .models import CleanupReceipt, DeadLetter
from .publish import publish_release_messages

logger = logging.getLogger(__name__)

# Reasons a later release settles: the failure was slowness or a transient error, not the
# message. (Malformed, poison and unexpected-error letters stay open: they are evidence.)
SETTLED_BY_A_LATER_RELEASE = (DeadLetter.Reason.TIME_LIMIT, DeadLetter.Reason.RETRIES_EXHAUSTED)
RELEASED_LATER = "released_later"

PAYLOAD_LIMIT = 8192  # characters of the raw payload a dead letter keeps
MESSAGE_LIMIT = 8192  # characters of JSON a dead letter keeps as the parsed message
_BIGINT_MAX = 2**63 - 1
_INT_MAX = 2**31 - 1


def clean_text(value: Any, limit: int) -> str:
    """Text PostgreSQL can store: lone surrogates replaced, NUL escaped, cut at ``limit``."""
    text = value if isinstance(value, str) else str(value)
    text = text[: limit * 2]  # bound the work before any copy below
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text[:limit]


def _truncate(payload: Any) -> str:
    if isinstance(payload, bytes | bytearray | memoryview):
        text = bytes(payload[: PAYLOAD_LIMIT * 4]).decode("utf-8", errors="replace")
    elif isinstance(payload, str):
        text = payload
    else:
        try:
            text = json.dumps(payload, default=repr)
        except (TypeError, ValueError, RecursionError):
            text = repr(payload)
    return clean_text(text, PAYLOAD_LIMIT)


def _storable_message(message: Any) -> dict[str, Any] | None:
    """The parsed message as JSON PostgreSQL accepts (no NUL, no lone surrogate), if small."""
    if not isinstance(message, dict):
        return None
    try:
        text = json.dumps(message, ensure_ascii=False)
        text.encode("utf-8")
    except (TypeError, ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    if len(text) > MESSAGE_LIMIT or "\x00" in text or "\\u0000" in text:
        return None
    return message


def _in_range(value: Any, maximum: int) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= maximum:
        return value
    return None


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
    """Write a dead letter in its own transaction (a savepoint inside a caller's: the sweep
    writes a set-aside hold's letter inside its claim, so both commit or neither). Never raises,
    and stores *something* for every input: every field is bounded and sanitized first, and
    when the full row still cannot be written a bare row with the reason and the error is
    tried. Only when the database itself is unreachable is the dead letter just logged and
    counted (a release's hold then comes back to a later sweep through its claim lease; a
    sweep's claim then cannot commit either)."""
    try:
        return _write(
            reason,
            error,
            task_name,
            task_id,
            payload,
            message,
            delivery_count,
            (reservation_id, version, idempotency_key, trace_id),
        )
    except Exception:  # a dead letter is the last resort; it never raises
        logger.exception("dead letter could not be recorded", extra={"reason": reason})
        return None


def _write(
    reason: str,
    error: str,
    task_name: str,
    task_id: str,
    payload: Any,
    message: dict[str, Any] | None,
    delivery_count: int,
    identity: tuple[int | None, int | None, str, str],
) -> DeadLetter | None:
    reservation_id, version, idempotency_key, trace_id = identity
    if not isinstance(message, dict):
        message = None
    if message is not None:
        reservation_id = reservation_id or message.get("reservation_id")
        version = version or message.get("version")
        idempotency_key = idempotency_key or str(message.get("idempotency_key", ""))
        trace_id = trace_id or str(message.get("trace_id", ""))
    fields: dict[str, Any] = {
        "reason": clean_text(reason, 32),
        "error": clean_text(error, 4000),
        "task_name": clean_text(task_name, 200),
        "task_id": clean_text(task_id, 64),
        "reservation_id": _in_range(reservation_id, _BIGINT_MAX),
        "version": _in_range(version, _INT_MAX),
        "idempotency_key": clean_text(idempotency_key, 120),
        "trace_id": clean_text(trace_id, 64),
        "delivery_count": max(0, min(int(delivery_count or 0), _INT_MAX)),
    }
    metrics.record_dead_letter(fields["reason"])
    log_fields = {
        **{k: v for k, v in fields.items() if k != "task_name"},
        "task": fields["task_name"],
        "error": fields["error"][:500],
    }
    try:
        with transaction.atomic():
            letter = DeadLetter.objects.create(
                payload=_truncate(payload if payload is not None else message),
                message=_storable_message(message),
                **fields,
            )
    except (OperationalError, InterfaceError):
        logger.exception("dead letter could not be stored", extra=log_fields)
        return None
    except DatabaseError as exc:
        # Something in the row was still unacceptable: keep the reason and the error.
        logger.exception("dead letter stored without its payload", extra=log_fields)
        with transaction.atomic():
            letter = DeadLetter.objects.create(
                reason=fields["reason"],
                error=clean_text(f"{fields['error']} [row rejected: {exc!r}]", 4000),
                task_name=fields["task_name"],
            )
    logger.warning("dead-lettered", extra={**log_fields, "dead_letter_id": letter.pk})
    return letter


def requeue_action(letter: DeadLetter) -> str:
    """What requeueing ``letter`` would do: ``rescheduled`` (a set-aside hold becomes due
    again), ``republished`` (its release message is sent again), ``already_resolved`` or
    ``not_requeueable (<why>)``."""
    if letter.resolved_at is not None:
        return "already_resolved"
    if letter.reason == DeadLetter.Reason.CLAIMS_EXHAUSTED and letter.reservation_id:
        return "rescheduled"
    try:
        _republishable(letter.message)
    except MalformedMessage as exc:
        return f"not_requeueable ({exc})"
    return "republished"


def _republishable(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict) and raw.get("kind") == BATCH_KIND:
        batch = validate_batch(raw)
        if batch.rejected:
            raise MalformedMessage(f"{len(batch.rejected)} malformed item(s)")
        return raw
    return validate(raw).as_dict()


def requeue(
    letters: Iterable[DeadLetter],
    *,
    dry_run: bool = False,
    on_each: Callable[[DeadLetter, str], None] | None = None,
) -> Counter[str]:
    """Requeue open dead letters; returns counts by what happened to each (``on_each`` is
    called with every letter and its result).

    Each letter is claimed first (a conditional UPDATE of ``resolved_at``): of two operators
    requeueing the same letter at once, one sends and the other gets ``already_resolved``.
    If sending then fails, the claim is undone and the letter counts as ``error``.
    """
    results: Counter[str] = Counter()
    for letter in letters:
        action = requeue_action(letter)
        if dry_run or action not in ("rescheduled", "republished"):
            results[action] += 1
            if on_each:
                on_each(letter, action)
            continue
        claimed = DeadLetter.objects.filter(pk=letter.pk, resolved_at__isnull=True).update(
            resolved_at=timezone.now(), resolution=action
        )
        if not claimed:
            action = "already_resolved"
        else:
            try:
                if action == "rescheduled":
                    reservation_services.reschedule_claim([letter.reservation_id or 0])
                else:
                    publish_release_messages([_republishable(letter.message)])
            except Exception:  # reported per letter; the claim is undone
                logger.exception("requeue failed", extra={"dead_letter_id": letter.pk})
                DeadLetter.objects.filter(pk=letter.pk).update(resolved_at=None, resolution="")
                action = "error"
        results[action] += 1
        if on_each:
            on_each(letter, action)
    return results


def resolve_released() -> int:
    """Resolve the open dead letters whose hold has since been released at the letter's
    version, and return how many.

    A release that hit its time limit or ran out of retries is dead-lettered, but its hold is
    not lost: the interrupted statement may still have committed, or the hold's claim lease
    brings it back to a later sweep, whose message (same idempotency key) releases it. Left
    open, such a letter keeps the open-dead-letter count and its alert up for a hold that
    needs nobody. Its message's receipt saying ``released`` settles it (``released_later``).
    """
    released = CleanupReceipt.objects.filter(
        idempotency_key=OuterRef("idempotency_key"), outcome="released"
    )
    settled = (
        DeadLetter.objects.filter(resolved_at__isnull=True, reason__in=SETTLED_BY_A_LATER_RELEASE)
        .exclude(idempotency_key="")
        .filter(Exists(released))
        .update(resolved_at=timezone.now(), resolution=RELEASED_LATER)
    )
    if settled:
        logger.info("dead letters settled by a later release", extra={"resolved": settled})
    return settled
