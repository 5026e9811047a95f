"""Dead letters as the triage tests make them (open, of a reason and a task, aged), and what
those tests read back: whether a letter is still open, its admin history, a command's output."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.utils import timezone

from cleanup.models import DeadLetter
from cleanup.release.messages import build

MALFORMED = DeadLetter.Reason.MALFORMED
UNKNOWN = DeadLetter.Reason.UNKNOWN_TASK


def letter(reason: str = MALFORMED, task: str = "", age: timedelta | None = None) -> DeadLetter:
    """An open letter of ``reason`` (for the task ``task``), written ``age`` ago (now)."""
    made = DeadLetter.objects.create(
        reason=reason, task_name=task, error="boom", payload="x" * 2000
    )
    if age is not None:
        DeadLetter.objects.filter(pk=made.pk).update(created_at=timezone.now() - age)
        made.refresh_from_db()
    return made


def requeueable(reservation_id: int) -> DeadLetter:
    """An open letter of a release message whose retries ran out: requeue sends it again."""
    message = build(reservation_id, 1, timezone.now(), 0, "triage")
    return DeadLetter.objects.create(
        reason=DeadLetter.Reason.RETRIES_EXHAUSTED,
        task_name="cleanup.release_reservation",
        reservation_id=reservation_id,
        version=1,
        idempotency_key=message["idempotency_key"],
        message=message,
    )


def is_open(*letters: DeadLetter) -> list[bool]:
    """Whether each letter is still open, read again, in id order."""
    return [
        DeadLetter.objects.get(pk=x.pk).resolved_at is None
        for x in sorted(letters, key=lambda x: x.pk)
    ]


def history(pk: int) -> list[tuple[str, str]]:
    """The admin history of the letter ``pk``: (user, change message), oldest first."""
    return [
        (str(e.user), e.get_change_message())
        for e in LogEntry.objects.filter(
            content_type__model="deadletter", object_id=str(pk)
        ).order_by("pk")
    ]


def run_command(command: str, *args: str) -> tuple[str, str]:
    """``manage.py command args`` in this process: its stdout and stderr."""
    out, err = StringIO(), StringIO()
    call_command(command, *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()
