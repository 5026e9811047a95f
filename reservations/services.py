"""Every state change of a hold. Each function is one transaction with conditional updates;
each writes its domain event to the outbox in that same transaction.

Lock order (docs/PIPELINE.md, invariant 8): offerings before reservations, ascending id.
Services that touch a single row (renew, confirm) take only that row's lock, which cannot close
a cycle.

The clock is PostgreSQL's, read when each statement runs (``clock_timestamp()``, never the
transaction's start: reservations/sql.py ``CLOCK``). The ``now`` parameters exist for unit tests
only; when ``None`` the statement uses the database clock.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, NoReturn, cast

from django.db import connection, transaction

from reservations.db import fetch_prepared

from . import conf, sql
from .errors import (
    InvalidTtl,
    NoSeatsAvailable,
    NotHeld,
    OfferingNotFound,
    ReservationExpired,
    ReservationNotFound,
    StaleVersion,
)
from .models import Offering, OutboxEvent, Reservation
from .tracecontext import current_traceparent

# How many eligible holds ``hold_seat`` reclaims inline on a full offering, at most.
RECLAIM_LIMIT = 50


class ReleaseOutcome(StrEnum):
    """What ``release_if_expired`` did, in the outcome order of docs/PIPELINE.md."""

    NOT_FOUND = "not_found"
    ALREADY_HANDLED = "already_handled"
    RENEWED = "renewed"
    NO_LONGER_HELD = "no_longer_held"
    # A version the hold never had while held: no sweep could have sent it (a forged message).
    UNKNOWN_VERSION = "unknown_version"
    NOT_EXPIRED = "not_expired"
    RELEASED = "released"


def _ttl(ttl_seconds: int | None) -> int:
    ttl = (
        conf.value("RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS") if ttl_seconds is None else ttl_seconds
    )
    if isinstance(ttl, bool) or not isinstance(ttl, int):
        raise InvalidTtl("ttl_seconds must be an integer")
    if not 1 <= ttl <= conf.value("RESERVATIONS_MAX_HOLD_TTL_SECONDS"):
        raise InvalidTtl(
            f"ttl_seconds must be between 1 and {conf.value('RESERVATIONS_MAX_HOLD_TTL_SECONDS')}"
        )
    return ttl


def _write_event(kind: str, reservation_id: int, version: int, payload: dict[str, object]) -> None:
    with connection.cursor() as cur:
        cur.execute(
            sql.INSERT_OUTBOX_EVENT,
            {
                "kind": str(kind),
                "id": reservation_id,
                "version": version,
                "payload": json.dumps(payload, default=str),
            },
        )


def insert_holds(
    cur: Any,
    offering_id: int,
    holders: Sequence[str],
    expires_in_seconds: Sequence[float],
    *,
    client_id: int | None = None,
    now: datetime | None = None,
    traceparent: str = "",
) -> list[tuple[int, datetime]]:
    """Insert held reservations (version 1) on ``offering_id``, each expiring that many seconds
    from now (negative: already expired; ``next_attempt_at`` = ``expires_at``); return
    ``(id, expires_at)`` in order, owned by API client ``client_id`` (None: no client), with
    ``traceparent`` as the request that took them.
    Seats are the caller's business: ``hold_seat`` takes one
    under the offering's lock; a seeding caller creates the offering with its seats taken."""
    cur.execute(
        sql.INSERT_HOLDS,
        {
            "offering": offering_id,
            "holders": list(holders),
            "secs": list(expires_in_seconds),
            "client": client_id,
            "now": now,
            "traceparent": traceparent,
        },
    )
    return [(row[0], row[1]) for row in cur.fetchall()]


def create_offering(name: str, capacity: int) -> Offering:
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    return Offering.objects.create(name=name, capacity=capacity, seats_available=capacity)


def hold_seat(
    offering_id: int,
    holder: str,
    ttl_seconds: int | None = None,
    *,
    client_id: int | None = None,
    now: datetime | None = None,
) -> Reservation:
    """Take one seat for ``holder`` for ``ttl_seconds``, the hold owned by API client
    ``client_id`` (None: a hold of no client, as the development token and the admin make).

    A learner is never refused because of an eligible hold cleanup has not reached yet: on a
    full offering, that offering's eligible holds are released first, through the same
    ``release_if_expired`` the cleanup uses (so each gets its one ``reservation.released``).
    """
    ttl = _ttl(ttl_seconds)
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(sql.LOCK_OFFERING_SEATS, [offering_id])
            row = cur.fetchone()
            if row is None:
                raise OfferingNotFound(f"offering {offering_id} does not exist")
            seats = row[0]
            if seats == 0:
                # Offering is locked first; the holds follow in ascending id (lock order).
                cur.execute(
                    sql.RECLAIMABLE_HOLDS,
                    {"offering": offering_id, "now": now, "limit": RECLAIM_LIMIT},
                )
                for reservation_id, version in cur.fetchall():
                    release_if_expired(reservation_id, version, reason="reclaimed", now=now)
                cur.execute(sql.OFFERING_SEATS, [offering_id])
                seats = cur.fetchone()[0]
            if seats == 0:
                raise NoSeatsAvailable(f"offering {offering_id} has no seats available")
            cur.execute(sql.TAKE_SEAT, [offering_id])
            ((reservation_id, expires_at),) = insert_holds(
                cur,
                offering_id,
                [holder],
                [float(ttl)],
                client_id=client_id,
                now=now,
                traceparent=current_traceparent(),
            )
        _write_event(
            OutboxEvent.Kind.HELD,
            reservation_id,
            1,
            {"offering_id": offering_id, "expires_at": expires_at.isoformat()},
        )
    return Reservation.objects.get(pk=reservation_id)


def _explain_refusal(
    reservation_id: int, expected_version: int, now: datetime | None, *, check_expiry: bool = True
) -> NoReturn:
    """Raise the domain error that says why a conditional update on a hold matched no row."""
    with connection.cursor() as cur:
        cur.execute(sql.HOLD_STATE, {"id": reservation_id, "now": now})
        row = cur.fetchone()
    if row is None:
        raise ReservationNotFound(f"hold {reservation_id} does not exist")
    status, version, expired = row
    if status != Reservation.Status.HELD:
        raise NotHeld(reservation_id, status)
    if version != expected_version:
        raise StaleVersion(reservation_id, expected_version, version)
    if expired and check_expiry:
        raise ReservationExpired(reservation_id)
    # The row changed between the update and this read; the caller may retry.
    raise StaleVersion(reservation_id, expected_version, version)


def renew(
    reservation_id: int,
    expected_version: int,
    ttl_seconds: int | None = None,
    *,
    now: datetime | None = None,
) -> Reservation:
    """Extend a hold that has not expired yet; bumps its version so queued releases go stale.

    An expired hold cannot be renewed, even before cleanup reaches it: an eligible hold's seat
    already counts as available and may have been promised to another learner.
    """
    ttl = _ttl(ttl_seconds)
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(
                sql.RENEW_HOLD,
                {
                    "id": reservation_id,
                    "version": expected_version,
                    "ttl": ttl,
                    "now": now,
                    "traceparent": current_traceparent(),
                },
            )
            row = cur.fetchone()
        if row is None:
            _explain_refusal(reservation_id, expected_version, now)
        version, expires_at = row
        _write_event(
            OutboxEvent.Kind.RENEWED,
            reservation_id,
            version,
            {"expires_at": expires_at.isoformat()},
        )
    return Reservation.objects.get(pk=reservation_id)


def confirm(
    reservation_id: int, expected_version: int, *, now: datetime | None = None
) -> Reservation:
    """Turn an unexpired hold into a confirmed seat (the seat stays taken)."""
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute(
                sql.CONFIRM_HOLD, {"id": reservation_id, "version": expected_version, "now": now}
            )
            row = cur.fetchone()
        if row is None:
            _explain_refusal(reservation_id, expected_version, now)
        _write_event(OutboxEvent.Kind.CONFIRMED, reservation_id, row[0], {})
    return Reservation.objects.get(pk=reservation_id)


def _lock_offering_of(cur: object, reservation_id: int) -> int | None:
    """Lock the hold's offering (offerings before reservations) and return its id."""
    cur.execute(sql.LOCK_OFFERING_OF_HOLD, [reservation_id])  # type: ignore[attr-defined]
    row = cur.fetchone()  # type: ignore[attr-defined]
    return None if row is None else int(row[0])


def cancel(
    reservation_id: int, expected_version: int, *, now: datetime | None = None
) -> Reservation:
    """The learner gives the seat back. Allowed while held, expired or not."""
    with transaction.atomic():
        with connection.cursor() as cur:
            if _lock_offering_of(cur, reservation_id) is None:
                raise ReservationNotFound(f"hold {reservation_id} does not exist")
            cur.execute(sql.CANCEL_HOLD, {"id": reservation_id, "version": expected_version})
            row = cur.fetchone()
            if row is None:
                _explain_refusal(reservation_id, expected_version, now, check_expiry=False)
            cur.execute(sql.GIVE_SEAT_BACK, [row[1]])
        _write_event(OutboxEvent.Kind.CANCELLED, reservation_id, row[0], {})
    return Reservation.objects.get(pk=reservation_id)


# The release statement's side of its contract with an ``AttachedWrite`` (reservations/sql.py).
RELEASED_ROWS = sql.RELEASED_ROWS
RELEASED_COLUMNS = sql.RELEASED_COLUMNS
RELEASE_PARAMS = sql.RELEASE_PARAMS
_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


@functools.lru_cache(maxsize=64)
def _attached_write_problem(statement: str, params: frozenset[str]) -> str | None:
    if not re.search(rf"\bFROM\s+{RELEASED_ROWS}\b", statement):
        return f"it does not read FROM {RELEASED_ROWS}"
    used = set(_PLACEHOLDER.findall(statement))
    if used & RELEASE_PARAMS:
        return f"its placeholders {sorted(used & RELEASE_PARAMS)} are the release's own"
    if used - params:
        return f"its placeholders {sorted(used - params)} have no value"
    return None


@dataclass(frozen=True)
class AttachedWrite:
    """A write the caller commits atomically with a release, in the same statement.

    ``sql`` is one data-modifying statement that reads the CTE named by ``RELEASED_ROWS``
    (columns ``RELEASED_COLUMNS``: one row per hold this call released), e.g.
    ``INSERT … SELECT … FROM released_rows``. Its placeholders are named (``%(name)s``), each
    with a value in ``params``, and none is one of the release's own (``RELEASE_PARAMS``). The
    domain runs it and knows nothing else of it; a write that breaks this contract is refused
    when it is made (ValueError), not when the statement first runs.
    """

    sql: str
    params: Mapping[str, Any]

    def __post_init__(self) -> None:
        problem = _attached_write_problem(self.sql, frozenset(self.params))
        if problem is not None:
            raise ValueError(f"not an attached write: {problem}")


def release_holds(
    items: Sequence[tuple[int, int]],
    *,
    reason: str = "expired",
    now: datetime | None = None,
    attach: AttachedWrite | None = None,
    request_spans: dict[int, str] | None = None,
) -> dict[int, ReleaseOutcome]:
    """Release each ``(reservation_id, expected_version)`` that is still held at that version
    and has expired; return every hold's outcome, in the outcome order of docs/PIPELINE.md.
    ``request_spans``, when given, receives each released hold's request traceparent (the
    request that took or last renewed it), for the holds that recorded one.

    Safe to call any number of times: only one call can move a hold to released. A hold listed
    twice is decided once (its first version). One statement: outside a transaction it needs
    no BEGIN/COMMIT, so releasing one hold costs one round trip; only holds that were not
    released cost a second statement, which says why.
    """
    wanted: dict[int, int] = {}
    for reservation_id, version in items:
        wanted.setdefault(reservation_id, version)
    if not wanted:
        return {}
    ids = sorted(wanted)
    params: dict[str, Any] = {
        "ids": ids,
        "versions": [wanted[i] for i in ids],
        "reason": reason,
        "now": now,
    }
    if attach is not None:
        params.update(attach.params)
    statement = sql.release_statement(None if attach is None else attach.sql)
    outcomes: dict[int, ReleaseOutcome] = {}
    for released_id, traceparent in fetch_prepared(statement, params):
        outcomes[released_id] = ReleaseOutcome.RELEASED
        if traceparent and request_spans is not None:
            request_spans[released_id] = traceparent
    rest = [i for i in ids if i not in outcomes]
    if rest:
        with connection.cursor() as cur:
            # A new statement (a new snapshot under READ COMMITTED) says why.
            cur.execute(sql.RELEASE_REFUSALS, {"ids": rest, "now": now})
            rows = {row[0]: row[1:] for row in cur.fetchall()}
            for reservation_id in rest:
                outcomes[reservation_id] = classify_no_release(
                    rows.get(reservation_id), wanted[reservation_id]
                )
    return outcomes


def release_if_expired(
    reservation_id: int,
    expected_version: int,
    *,
    reason: str = "expired",
    now: datetime | None = None,
) -> ReleaseOutcome:
    """``release_holds`` for one hold."""
    return release_holds([(reservation_id, expected_version)], reason=reason, now=now)[
        reservation_id
    ]


def classify_no_release(row: Sequence[object] | None, expected_version: int) -> ReleaseOutcome:
    """The outcome order (docs/PIPELINE.md) for a hold that was not released by this call.

    ``row`` is (status, version, released_version, expired). A version above the hold's own
    reads ``unknown_version``; a version that moved while the hold is held or released reads
    ``renewed``; a confirmed or cancelled hold reads ``no_longer_held`` at any version it had
    (confirm and cancel bump it too).
    """
    if row is None:
        return ReleaseOutcome.NOT_FOUND
    status, version, released_version, expired = row
    if status == Reservation.Status.RELEASED and released_version == expected_version:
        return ReleaseOutcome.ALREADY_HANDLED
    # Versions only grow: no sweep can have sent one above the hold's own, so a message for it
    # is forged and may not leave a receipt (one per version a hold really had is the bound).
    if expected_version > cast(int, version):
        return ReleaseOutcome.UNKNOWN_VERSION
    if status in (Reservation.Status.CONFIRMED, Reservation.Status.CANCELLED):
        return ReleaseOutcome.NO_LONGER_HELD
    if version != expected_version:
        return ReleaseOutcome.RENEWED
    if not expired:
        return ReleaseOutcome.NOT_EXPIRED
    # Held, same version, expired, yet the update matched nothing: it changed in between.
    # Reporting it as renewed would be a lie; the caller treats this as transient and retries.
    raise TransientConflict(f"hold {row} changed during release; retry")


class TransientConflict(Exception):
    """A concurrent change raced a conditional update; retrying gives a definite answer."""


def seat_conservation_violations() -> list[tuple[int, int, int, int, int]]:
    """Offerings where capacity != seats_available + held + confirmed (empty when conserved)."""
    with connection.cursor() as cur:
        cur.execute(sql.SEAT_CONSERVATION_VIOLATIONS)
        return [tuple(row) for row in cur.fetchall()]  # type: ignore[misc]


@dataclass(frozen=True)
class Backlog:
    """The eligible holds of some buckets, as the gauges, the health page and the autoscaler
    read them: two bounded statements, never an aggregate over the whole backlog."""

    oldest_age_seconds: float  # now - the oldest eligible hold's expires_at; 0 when none
    eligible: int  # counted up to the cap
    capped: bool  # more than the cap


def eligible_backlog(buckets: Sequence[int], cap: int) -> Backlog:
    """The backlog of ``buckets`` (in the caller's transaction, if any)."""
    with connection.cursor() as cur:
        cur.execute(sql.OLDEST_ELIGIBLE_AGE, [list(buckets)])
        row = cur.fetchone()
        age = max(0.0, float(row[0])) if row and row[0] is not None else 0.0
    counted = eligible_count(buckets, cap + 1)
    return Backlog(age, min(counted, cap), counted > cap)


def eligible_count(buckets: Sequence[int], bound: int) -> int:
    """The eligible holds of ``buckets``, counted up to ``bound`` (a bounded index scan)."""
    with connection.cursor() as cur:
        cur.execute(sql.ELIGIBLE_COUNT, [list(buckets), bound])
        return int(cur.fetchone()[0])


def availability(offering_id: int) -> dict[str, int]:
    """Seats a learner can get now: free seats plus the offering's eligible holds."""
    with connection.cursor() as cur:
        cur.execute(sql.AVAILABILITY, [offering_id])
        row = cur.fetchone()
    if row is None:
        raise OfferingNotFound(f"offering {offering_id} does not exist")
    capacity, free, held, eligible, confirmed = row
    return {
        "offering_id": offering_id,
        "capacity": capacity,
        "seats_available": free,
        "held": held,
        "eligible": eligible,
        "confirmed": confirmed,
        "available": free + eligible,
    }
