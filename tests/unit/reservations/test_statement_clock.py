"""Expiry is decided by the time a statement runs, not by its transaction's start.

PostgreSQL's ``now()`` is the transaction's start. A renew or a confirm that runs in a
transaction opened earlier (a request that waited on another request's Idempotency-Key, or did
other work first) must still see a lease that ended before the statement as ended.
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from reservations import idempotency, services
from reservations.errors import ReservationExpired
from reservations.models import Offering, Reservation

pytestmark = pytest.mark.django_db(transaction=True)

LEASE_SECONDS = 1


def _hold_then_open_a_transaction_past_its_lease(offering: Offering) -> Reservation:
    """A committed hold of ``LEASE_SECONDS``; the caller is inside a transaction that started
    before the lease ended (``now()`` pinned there) and it has ended by the time this returns."""
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=LEASE_SECONDS)
    with connection.cursor() as cur:
        cur.execute("SELECT now() < %s", [hold.expires_at])
        (started_before_expiry,) = cur.fetchone()
        assert started_before_expiry
        cur.execute("SELECT pg_sleep(%s)", [LEASE_SECONDS + 0.3])
        cur.execute("SELECT clock_timestamp() > %s", [hold.expires_at])
        assert cur.fetchone()[0]
    return hold


@pytest.mark.parametrize("action", ["renew", "confirm"])
def test_a_lease_ended_before_the_statement_is_refused_in_an_older_transaction(
    offering: Offering, action: str
) -> None:
    with transaction.atomic():
        hold = _hold_then_open_a_transaction_past_its_lease(offering)
        with pytest.raises(ReservationExpired):
            getattr(services, action)(hold.pk, hold.version)
    hold.refresh_from_db()
    assert hold.status == Reservation.Status.HELD
    assert hold.version == 1


def test_a_renew_under_an_idempotency_key_sees_the_lease_ended(offering: Offering) -> None:
    def produce() -> idempotency.Response:
        try:
            renewed = services.renew(hold.pk, hold.version)
        except ReservationExpired:
            return idempotency.Response(409, {"error": "expired"}, {})
        return idempotency.Response(200, {"version": renewed.version}, {})

    with transaction.atomic():
        hold = _hold_then_open_a_transaction_past_its_lease(offering)
        response = idempotency.run_once(None, "renew-after-expiry", "fingerprint", produce)
    assert response.status == 409
    hold.refresh_from_db()
    assert hold.version == 1
