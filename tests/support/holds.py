"""Holds as the tests need them, and what the tests read back of them.

The clock never moves in these tests: a hold is made eligible for release by moving its expiry
into the past, by the database clock (``now()``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import connection
from django.db.models.functions import Now

from reservations.models import OutboxEvent, Reservation


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


MISSING_ID = 2_000_000_000  # no hold has this id


def events(reservation_id: int) -> list[tuple[str, int]]:
    """The hold's outbox events: (kind, version), oldest first."""
    return list(
        OutboxEvent.objects.filter(reservation_id=reservation_id)
        .order_by("id")
        .values_list("kind", "version")
    )


def released_events(reservation_id: int) -> list[OutboxEvent]:
    return list(
        OutboxEvent.objects.filter(reservation_id=reservation_id, kind=OutboxEvent.Kind.RELEASED)
    )


def row(reservation_id: int) -> dict[str, object]:
    """The hold's columns, read with SQL (an ORM read cannot load next_attempt_at=infinity)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT status, version, released_version, claim_count, last_trace_id, "
            "next_attempt_at = 'infinity'::timestamptz, "
            "CASE WHEN isfinite(next_attempt_at) THEN next_attempt_at END, "
            "expires_at, release_reason, released_at IS NOT NULL, last_claimed_at IS NOT NULL "
            "FROM reservations_reservation WHERE id = %s",
            [reservation_id],
        )
        values = cur.fetchone()
    assert values is not None
    keys = (
        "status version released_version claim_count last_trace_id infinite next_attempt_at "
        "expires_at release_reason has_released_at has_last_claimed_at"
    ).split()
    return dict(zip(keys, values, strict=True))


def seed_expired(count: int, seconds_ago: float, offerings: int = 2) -> list[int]:
    """``count`` holds over ``offerings`` new offerings (named "sizing"), expired
    ``seconds_ago``, made in bulk (``tools.seed``): their ids."""
    from tools.seed import seed_holds

    return seed_holds(count, offerings=offerings, expires_in=-seconds_ago, name="sizing")
