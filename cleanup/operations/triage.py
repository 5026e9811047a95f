"""Dead-letter triage, the operator's side: requeue, discard and the filters they share
(docs/OPERATOR-CONSOLE.md, "Dead-letter triage").

Requeue re-publishes the same release message (same idempotency key, so a message that was
in fact handled ends ``already_handled``), or makes a set-aside hold due for a sweep again.
Discard resolves a letter without sending anything, recording who and why.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from cleanup import sql
from cleanup.models import DeadLetter
from cleanup.release.claim import reschedule_claim
from cleanup.release.dead_letters import DISCARDED, WHY_LIMIT, clean_text
from cleanup.release.messages import (
    BATCH_KIND,
    BatchMessage,
    MalformedMessage,
    ReleaseMessage,
    validate,
    validate_batch,
)
from cleanup.release.publish import publish_release_messages
from reservations.db import rows

logger = logging.getLogger("cleanup.deadletters")
# What ``requeue`` counts the letters after a failed send as: left open, never sent.
NOT_TRIED = "not_tried"


def requeue_action(letter: DeadLetter) -> str:
    """What requeueing ``letter`` would do: ``rescheduled`` (a set-aside hold becomes due
    again), ``republished`` (its release message is sent again), ``already_resolved`` or
    ``not_requeueable (<why>)``."""
    if letter.resolved_at is not None:
        return "already_resolved"
    if letter.reason == DeadLetter.Reason.PERIODIC_FAILED:
        return (
            "not_requeueable (a periodic task: beat runs it again at its next tick, and its "
            "next success settles this letter; discard it once the cause is understood)"
        )
    if letter.reason == DeadLetter.Reason.CLAIMS_EXHAUSTED and letter.reservation_id:
        return "rescheduled"
    try:
        _republishable(letter.message)
    except MalformedMessage as exc:
        return f"not_requeueable ({exc})"
    return "republished"


def _republishable(raw: Any) -> ReleaseMessage | BatchMessage:
    """The letter's message, read as a worker reads it (the letter keeps it as JSON)."""
    if isinstance(raw, dict) and raw.get("kind") == BATCH_KIND:
        batch = validate_batch(raw)
        if batch.rejected:
            raise MalformedMessage(f"{len(batch.rejected)} malformed item(s)")
        return batch
    return validate(raw)


def requeue(
    letters: Iterable[DeadLetter],
    *,
    dry_run: bool = False,
    on_each: Callable[[DeadLetter, str], None] | None = None,
    by: str = "",
    why: str = "",
    on_error: Callable[[DeadLetter, Exception], None] | None = None,
) -> Counter[str]:
    """Requeue open dead letters; returns counts by what happened to each (``on_each`` is
    called with every letter and its result). ``by`` and ``why`` are kept on each letter
    requeued (``resolved_by``, ``resolution_note``).

    Each letter is claimed first (a conditional UPDATE of ``resolved_at``): of two operators
    requeueing the same letter at once, one sends and the other gets ``already_resolved``.
    If sending then fails, the claim is undone and the letter counts as ``error``
    (``on_error`` is called with the letter and the exception, so a caller can say why).

    The first failed send ends the requeue: every letter after it counts as ``not_tried`` and
    stays open. A letter is validated before it is claimed, so what fails a send is the broker
    or the database, and the next letter would fail the same way, each after the publish's
    own retries (about 6 s against a broker that refuses connections): a thousand letters
    would hold the admin's request or the command for over an hour.
    """
    results: Counter[str] = Counter()
    for letter in letters:
        if results["error"]:
            results[NOT_TRIED] += 1
            if on_each:
                on_each(letter, NOT_TRIED)
            continue
        action = requeue_action(letter)
        if dry_run or action not in ("rescheduled", "republished"):
            results[action] += 1
            if on_each:
                on_each(letter, action)
            continue
        claimed = DeadLetter.objects.filter(pk=letter.pk, resolved_at__isnull=True).update(
            resolved_at=timezone.now(),
            resolution=action,
            resolved_by=clean_text(by, 150),
            resolution_note=clean_text(why, WHY_LIMIT),
        )
        if not claimed:
            action = "already_resolved"
        else:
            try:
                if action == "rescheduled":
                    reschedule_claim([letter.reservation_id or 0])
                else:
                    publish_release_messages([_republishable(letter.message)])
            except Exception as exc:  # reported per letter; the claim is undone
                logger.exception("requeue failed", extra={"dead_letter_id": letter.pk})
                DeadLetter.objects.filter(pk=letter.pk).update(
                    resolved_at=None, resolution="", resolved_by="", resolution_note=""
                )
                action = "error"
                if on_error:
                    on_error(letter, exc)
        results[action] += 1
        if on_each:
            on_each(letter, action)
    return results


# --- Triage: which letters, discard ----------------------------------------------------------

_AGE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> timedelta:
    """``"90s"``, ``"30m"``, ``"6h"``, ``"7d"``, ``"2w"`` as a timedelta (ValueError saying
    what is expected otherwise)."""
    found = _AGE.match(text or "")
    if not found or int(found.group(1)) <= 0:
        raise ValueError(
            f"{text!r} is not an age: give a positive number and a unit, s, m, h, d or w "
            f"(for example 30m, 6h or 7d)"
        )
    return timedelta(seconds=int(found.group(1)) * _UNITS[found.group(2)])


def clean_why(text: str) -> str:
    """An operator's reason for a discard: required, at most ``WHY_LIMIT`` characters
    (ValueError saying which rule it broke)."""
    why = (text or "").strip()
    if not why:
        raise ValueError(
            "say why these letters are discarded: the text is kept on each letter and in its "
            "history"
        )
    if len(why) > WHY_LIMIT:
        raise ValueError(f"the reason is {len(why)} characters long; at most {WHY_LIMIT}")
    return clean_text(why, WHY_LIMIT)


@dataclass(frozen=True)
class LetterFilter:
    """Which open letters a command acts on: all of these that are given."""

    reason: str = ""
    task: str = ""
    older_than: timedelta | None = None
    ids: tuple[int, ...] = ()

    def open_letters(self, now: datetime | None = None) -> QuerySet[DeadLetter]:
        letters = DeadLetter.objects.filter(resolved_at__isnull=True)
        if self.reason:
            letters = letters.filter(reason=self.reason)
        if self.task:
            letters = letters.filter(task_name=self.task)
        if self.older_than is not None:
            letters = letters.filter(created_at__lt=(now or timezone.now()) - self.older_than)
        if self.ids:
            letters = letters.filter(pk__in=self.ids)
        return letters.order_by("id")

    @property
    def empty(self) -> bool:
        return not (self.reason or self.task or self.older_than is not None or self.ids)


def by_reason(letters: Iterable[DeadLetter]) -> list[tuple[str, int]]:
    """(reason, count) of ``letters``, the most frequent first."""
    counts = Counter(str(letter.reason) for letter in letters)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def discard(
    letters: Sequence[DeadLetter], *, by: str, why: str, dry_run: bool = False
) -> dict[str, list[DeadLetter]]:
    """Resolve open ``letters`` as ``discarded`` without sending anything, keeping ``by``
    and ``why`` on each; returns them by what happened: ``discarded`` (or ``would discard``
    with ``dry_run``) and ``already_resolved`` (resolved meanwhile, by someone else or by the
    cleanup: left as it is).

    One conditional UPDATE per thousand letters (``resolved_at IS NULL``), so of two operators
    discarding the same letters at once each letter is discarded once.
    """
    note = clean_why(why)
    who = clean_text(by, 150)
    done: dict[str, list[DeadLetter]] = {}
    if dry_run:
        for letter in letters:
            key = "would discard" if letter.resolved_at is None else "already_resolved"
            done.setdefault(key, []).append(letter)
        return done
    resolved: set[int] = set()
    for start in range(0, len(letters), 1000):
        chunk = [int(letter.pk) for letter in letters[start : start + 1000]]
        found = rows(
            sql.DISCARD_DEAD_LETTERS,
            {"at": timezone.now(), "resolution": DISCARDED, "by": who, "note": note, "ids": chunk},
        )
        resolved.update(int(row[0]) for row in found)
    for letter in letters:
        done.setdefault(DISCARDED if letter.pk in resolved else "already_resolved", []).append(
            letter
        )
    if resolved:
        logger.info(
            "dead letters discarded", extra={"discarded": len(resolved), "by": who, "why": note}
        )
    return done
