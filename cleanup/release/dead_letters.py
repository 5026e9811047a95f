"""Dead letters: record what could not be handled, with its reason, and resolve the letters
that need nobody (a later release or a later run of the same periodic task settled them).
When the open letters reach ``CLEANUP_DEAD_LETTER_OPEN_CAP``, the oldest beyond it are
summarised: one open summary letter per reason and task stands for them. An operator's
requeue and discard are in ``cleanup.operations.triage``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from cleanup import metrics, sql
from cleanup.conf import PRUNE_BATCH_SIZE, cleanup_settings
from cleanup.models import CleanupReceipt, DeadLetter
from cleanup.release import locks
from reservations.db import rows, scalar

logger = logging.getLogger("cleanup.deadletters")

# Reasons a later release settles: the failure was slowness or a transient error, not the
# message. (Malformed, poison and unexpected-error letters stay open: they are evidence.)
RESOLVED_BY_A_LATER_RELEASE = (DeadLetter.Reason.TIME_LIMIT, DeadLetter.Reason.RETRIES_EXHAUSTED)
RELEASED_LATER = "released_later"
DISCARDED = "discarded"
# A periodic task's letter: its key names the task and its arguments (delivery.CleanupTask); the
# next success of the same run settles it.
PERIODIC_KEY_PREFIX = "periodic:"
SUCCEEDED_LATER = "succeeded_later"
SUMMARISED = "summarised"
# ``resolved_by`` of the resolutions the cleanup makes itself (released_later, summarised).
AUTOMATIC = "cleanup"
WHY_LIMIT = 500  # characters of an operator's "why"

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
        DeadLetter.objects.filter(resolved_at__isnull=True, reason__in=RESOLVED_BY_A_LATER_RELEASE)
        .exclude(idempotency_key="")
        .filter(Exists(released))
        .update(
            resolved_at=timezone.now(),
            resolution=RELEASED_LATER,
            resolved_by=AUTOMATIC,
            resolution_note="a later message with the same key released the hold",
        )
    )
    if settled:
        logger.info("dead letters resolved by a later release", extra={"resolved": settled})
    return settled


def resolve_periodic(key: str) -> int:
    """Resolve the open ``periodic_failed`` letters of one periodic run (``key``: the task and
    its arguments) after that run succeeded, and return how many (``succeeded_later``). A
    periodic task has no message to requeue: the next tick runs it again, and once it succeeds
    its earlier failures need nobody, so the open-letter count and its alert clear."""
    settled = DeadLetter.objects.filter(
        resolved_at__isnull=True,
        reason=DeadLetter.Reason.PERIODIC_FAILED,
        idempotency_key=clean_text(key, 120),
    ).update(
        resolved_at=timezone.now(),
        resolution=SUCCEEDED_LATER,
        resolved_by=AUTOMATIC,
        resolution_note="the next run of the same periodic task succeeded",
    )
    if settled:
        logger.info("periodic dead letters resolved", extra={"key": key, "resolved": settled})
    return settled


# --- The open-letter cap ---------------------------------------------------------------------

# Per reason, task names that get a summary letter of their own; letters of further tasks
# (the task name of an unknown_task letter is whatever the sender wrote) share one.
SUMMARY_TASKS_PER_REASON = 50
OTHER_TASKS = "(other tasks)"
SUMMARY_ERROR_LIMIT = 500  # characters of its error a summarised letter keeps
# claims_exhausted letters are never summarised: each is the only way back (requeue) for a
# hold that is set aside, and there is at most one open per such hold.
NOT_SUMMARISED = (DeadLetter.Reason.CLAIMS_EXHAUSTED,)
SUMMARY_BUDGET_S = 5.0  # no summarising batch starts after this long in one call


def summarise_beyond_cap(
    cap: int | None = None,
    *,
    batch: int | None = None,
    max_batches: int = 20,
    budget_s: float = SUMMARY_BUDGET_S,
) -> int:
    """Keep at most ``cap`` (``CLEANUP_DEAD_LETTER_OPEN_CAP``) open letters in full: the
    oldest beyond it are resolved as ``summarised`` (payload and parsed message dropped, the
    error cut to 500 characters, kept until pruned) and counted into one open summary letter
    per reason and task, which says how many it stands for and when the first and the last
    of them were written. Returns how many letters were summarised (at most
    ``batch × max_batches`` per call, and no batch is started after ``budget_s`` seconds, so
    the maintenance task stays well inside its time limit; the next call goes on).

    Summary letters and claims_exhausted letters are never summarised; they still count as
    open, so the open total can stay a little above the cap (and its alert stays up) until
    someone triages.
    """
    cap = int(cap or cleanup_settings().dead_letter_open_cap)
    batch = int(batch or PRUNE_BATCH_SIZE)
    total = 0
    started = time.monotonic()
    for _ in range(max_batches):
        summarised = _summarise_batch(cap, batch)
        total += summarised
        if summarised < batch or time.monotonic() - started > budget_s:
            break
    if total:
        logger.warning(
            "open dead letters beyond the cap summarised", extra={"summarised": total, "cap": cap}
        )
    return total


def _summarise_batch(cap: int, batch: int) -> int:
    excluded = [str(r) for r in NOT_SUMMARISED]
    with transaction.atomic():
        if not locks.try_transaction_lock(locks.DEAD_LETTER_CAP):
            return 0  # another summariser is at work
        newest = scalar(sql.NEWEST_LETTER_BEYOND_CAP, {"excluded": excluded, "cap": cap})
        if newest is None:
            return 0
        letters = rows(
            sql.LETTERS_TO_SUMMARISE, {"excluded": excluded, "newest": newest, "batch": batch}
        )
        if not letters:
            return 0
        groups = _group(letters)
        now = timezone.now()
        for (reason, task), (ids, first, last) in groups.items():
            summary = _summary_letter(reason, task, len(ids), first, last, cap)
            rows(
                sql.SUMMARISE_LETTERS,
                {
                    "at": now,
                    "resolution": SUMMARISED,
                    "by": AUTOMATIC,
                    "note": f"summarised into dead letter #{summary.pk}: the open letters "
                    f"reached CLEANUP_DEAD_LETTER_OPEN_CAP={cap}",
                    "error_limit": SUMMARY_ERROR_LIMIT,
                    "ids": ids,
                },
            )
        return len(letters)


def _group(
    letters: Sequence[tuple[Any, ...]],
) -> dict[tuple[str, str], tuple[list[int], datetime, datetime]]:
    """The letters by (reason, task) with their ids and first/last times; per reason, tasks
    beyond ``SUMMARY_TASKS_PER_REASON`` (counting those that have an open summary already)
    share ``OTHER_TASKS``."""
    summarised_tasks: dict[str, set[str]] = {}
    for reason, task in DeadLetter.objects.filter(
        resolved_at__isnull=True, summarised_count__gt=0
    ).values_list("reason", "task_name"):
        summarised_tasks.setdefault(reason, set()).add(task)
    sizes = Counter((str(r[1]), str(r[2])) for r in letters)
    for reason, task in sorted(sizes, key=lambda k: -sizes[k]):
        known = summarised_tasks.setdefault(reason, set())
        if task not in known and len(known) < SUMMARY_TASKS_PER_REASON:
            known.add(task)
    groups: dict[tuple[str, str], tuple[list[int], datetime, datetime]] = {}
    for pk, reason, task, created_at in letters:
        key = (reason, task if task in summarised_tasks[reason] else OTHER_TASKS)
        ids, first, last = groups.get(key, ([], created_at, created_at))
        ids.append(int(pk))
        groups[key] = (ids, min(first, created_at), max(last, created_at))
    return groups


def _summary_letter(
    reason: str, task: str, count: int, first: datetime, last: datetime, cap: int
) -> DeadLetter:
    summary = (
        DeadLetter.objects.select_for_update()
        .filter(resolved_at__isnull=True, summarised_count__gt=0, reason=reason, task_name=task)
        .order_by("id")
        .first()
    )
    if summary is None:
        summary = DeadLetter(reason=reason, task_name=task, summarised_first_at=first)
    summary.summarised_count += count
    summary.summarised_first_at = min(summary.summarised_first_at or first, first)
    summary.summarised_last_at = max(summary.summarised_last_at or last, last)
    summary.error = (
        f"summary of {summary.summarised_count} older open dead letter(s) ({reason}, task "
        f"{task or '(none)'}) written from {summary.summarised_first_at:%Y-%m-%d %H:%M:%S} to "
        f"{summary.summarised_last_at:%Y-%m-%d %H:%M:%S} UTC: the open letters reached "
        f"CLEANUP_DEAD_LETTER_OPEN_CAP={cap}. They are resolved as summarised (payloads "
        f"dropped) and deleted after CLEANUP_DEAD_LETTER_RETENTION_DAYS. Discard this letter "
        f"once their cause is understood."
    )
    summary.save()
    return summary
