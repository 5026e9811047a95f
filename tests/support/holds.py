"""Holds made expired: the clock never moves in these tests, so a hold is made eligible for
release by moving its expiry into the past, by the database clock (``now()``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models.functions import Now

from reservations.models import Reservation


def expire(
    *holds: Reservation | int, ago: timedelta = timedelta(minutes=1), due: bool = True
) -> None:
    """Move the holds' ``expires_at`` to ``ago`` before the database's ``now()``, and their due
    time (``next_attempt_at``) with it, so a sweep claims them at once; ``due=False`` leaves
    the due time where it was."""
    changes: dict[str, Any] = {"expires_at": Now() - ago}
    if due:
        changes["next_attempt_at"] = Now() - ago
    ids = [hold if isinstance(hold, int) else hold.pk for hold in holds]
    Reservation.objects.filter(pk__in=ids).update(**changes)


def expired_holds(
    count: int,
    name: str = "sweep",
    *,
    offering_id: int | None = None,
    ago: timedelta = timedelta(minutes=1),
) -> list[int]:
    """``count`` holds that expired ``ago`` before the database's ``now()``: on the offering
    ``offering_id``, or every seat of a new offering of ``count`` seats named ``name``. Their
    ids."""
    from reservations import services

    if offering_id is None:
        offering_id = services.create_offering(name, capacity=count).pk
    ids = [services.hold_seat(offering_id, f"l{i}", ttl_seconds=60).pk for i in range(count)]
    expire(*ids, ago=ago)
    return ids


def due_now(ids: list[int]) -> set[int]:
    """The holds a sweep would claim now: eligible and not leased."""
    due = Reservation.objects.eligible().filter(pk__in=ids, next_attempt_at__lte=Now())
    return set(due.values_list("pk", flat=True))


def claim_counts(ids: list[int]) -> set[int]:
    """The claim counts the holds ``ids`` have (each distinct count once)."""
    return set(Reservation.objects.filter(pk__in=ids).values_list("claim_count", flat=True))
