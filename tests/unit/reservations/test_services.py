"""The reservation domain services against a real PostgreSQL.

Expiry is driven two ways: an explicit ``now=`` (services accept it for unit tests only) and
holds whose ``expires_at`` / ``next_attempt_at`` are moved into the past with an UPDATE, so the
database clock (``now()``) sees them as eligible.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from cleanup.release.claim import ClaimedHold, claim_expired, reschedule_claim
from reservations import errors, services
from reservations.models import Offering, OutboxEvent, Reservation
from reservations.services import ReleaseOutcome
from tests.support.holds import expire

pytestmark = pytest.mark.django_db

MISSING_ID = 2_000_000_000


@pytest.fixture(autouse=True)
def seats_are_conserved_after_every_test(db: None) -> Iterator[None]:
    yield
    assert services.seat_conservation_violations() == []


@pytest.fixture
def t0() -> datetime:
    return timezone.now()


def events(reservation_id: int) -> list[tuple[str, int]]:
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


def seats(offering: Offering) -> int:
    offering.refresh_from_db()
    return offering.seats_available


def ended_hold(offering: Offering, t0: datetime, final_status: str) -> tuple[int, int]:
    """A hold taken at ``t0``, then confirmed, cancelled or released (at its expiry) as
    ``final_status`` says: its id and its version now."""
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    if final_status == "confirmed":
        services.confirm(hold.pk, 1, now=t0)
    elif final_status == "cancelled":
        services.cancel(hold.pk, 1, now=t0)
    else:
        services.release_if_expired(hold.pk, 1, now=t0 + timedelta(seconds=60))
    return hold.pk, Reservation.objects.values_list("version", flat=True).get(pk=hold.pk)


# --- hold_seat -------------------------------------------------------------------------------


def test_holding_a_seat_takes_one_seat_and_writes_one_held_event(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)

    assert hold.status == Reservation.Status.HELD
    assert hold.version == 1
    assert hold.holder == "learner-1"
    assert hold.expires_at == t0 + timedelta(seconds=60)
    assert hold.next_attempt_at == hold.expires_at
    assert hold.claim_count == 0
    assert hold.bucket == hold.pk % 1024
    assert seats(offering) == offering.capacity - 1
    assert events(hold.pk) == [("reservation.held", 1)]
    payload = OutboxEvent.objects.get(reservation=hold).payload
    assert payload["offering_id"] == offering.pk


def test_a_hold_without_a_ttl_lasts_the_default_ttl_from_settings(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", now=t0)

    default = settings.RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS
    assert hold.expires_at == t0 + timedelta(seconds=default)


def test_a_hold_on_a_missing_offering_raises_offering_not_found_naming_it(db):
    with pytest.raises(
        errors.OfferingNotFound, match=f"offering {MISSING_ID} does not exist"
    ) as err:
        services.hold_seat(MISSING_ID, "learner-1", ttl_seconds=60)
    assert err.value.code == "offering_not_found"
    assert Reservation.objects.count() == 0
    assert OutboxEvent.objects.count() == 0


def test_a_hold_on_a_full_offering_without_eligible_holds_raises_no_seats_available(
    make_offering,
):
    full = make_offering(capacity=1)
    services.hold_seat(full.pk, "learner-1", ttl_seconds=60)

    with pytest.raises(errors.NoSeatsAvailable, match=f"offering {full.pk} has no seats") as err:
        services.hold_seat(full.pk, "learner-2", ttl_seconds=60)
    assert err.value.code == "no_seats_available"
    assert seats(full) == 0
    assert Reservation.objects.filter(offering=full).count() == 1


def test_a_zero_capacity_offering_refuses_every_hold(make_offering):
    empty = make_offering(capacity=0)

    with pytest.raises(errors.NoSeatsAvailable):
        services.hold_seat(empty.pk, "learner-1", ttl_seconds=60)


@pytest.mark.parametrize("ttl", [0, -1, 86400 + 1, 1.5, True, "60"])
def test_a_ttl_outside_one_second_to_the_maximum_or_not_an_integer_raises_invalid_ttl(
    offering, ttl
):
    with pytest.raises(errors.InvalidTtl, match="ttl_seconds must be") as err:
        services.hold_seat(offering.pk, "learner-1", ttl_seconds=ttl)
    assert err.value.code == "invalid_ttl"
    assert seats(offering) == offering.capacity
    assert Reservation.objects.count() == 0


def test_the_shortest_and_longest_ttls_are_accepted(offering, t0):
    shortest = services.hold_seat(offering.pk, "a", ttl_seconds=1, now=t0)
    longest = services.hold_seat(
        offering.pk, "b", ttl_seconds=settings.RESERVATIONS_MAX_HOLD_TTL_SECONDS, now=t0
    )

    assert shortest.expires_at == t0 + timedelta(seconds=1)
    assert longest.expires_at == t0 + timedelta(seconds=settings.RESERVATIONS_MAX_HOLD_TTL_SECONDS)


def test_a_full_offering_reclaims_its_eligible_holds_once_each_before_refusing(make_offering, t0):
    # given: a full offering with two eligible holds and one live hold, and a second offering
    # with an eligible hold of its own
    full = make_offering(capacity=3)
    other = make_offering(capacity=1)
    stale_a = services.hold_seat(full.pk, "a", ttl_seconds=60, now=t0)
    stale_b = services.hold_seat(full.pk, "b", ttl_seconds=60, now=t0)
    live = services.hold_seat(full.pk, "c", ttl_seconds=3600, now=t0)
    elsewhere = services.hold_seat(other.pk, "d", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)

    # when
    granted = services.hold_seat(full.pk, "e", ttl_seconds=60, now=later)

    # then: both eligible holds were released through release_if_expired, once each
    for stale in (stale_a, stale_b):
        state = row(stale.pk)
        assert state["status"] == Reservation.Status.RELEASED
        assert state["released_version"] == 1
        assert state["version"] == 1
        assert state["release_reason"] == "reclaimed"
        (event,) = released_events(stale.pk)
        assert event.version == 1
        assert event.payload["reason"] == "reclaimed"
        assert event.payload["offering_id"] == full.pk
    assert row(live.pk)["status"] == Reservation.Status.HELD
    assert row(elsewhere.pk)["status"] == Reservation.Status.HELD
    assert granted.status == Reservation.Status.HELD
    # one reclaimed seat went to the new hold, the other is free
    assert seats(full) == 1
    assert seats(other) == 0
    # and a release message built before the reclaim now reads already_handled
    assert services.release_if_expired(stale_a.pk, 1, now=later) == ReleaseOutcome.ALREADY_HANDLED
    assert len(released_events(stale_a.pk)) == 1


def test_a_full_offering_whose_holds_expired_by_the_database_clock_grants_a_new_hold(
    make_offering,
):
    full = make_offering(capacity=2)
    stale = services.hold_seat(full.pk, "a", ttl_seconds=600)
    live = services.hold_seat(full.pk, "b", ttl_seconds=600)
    expire(stale.pk)

    assert services.availability(full.pk)["available"] == 1

    granted = services.hold_seat(full.pk, "c", ttl_seconds=600)

    assert granted.status == Reservation.Status.HELD
    assert row(stale.pk)["status"] == Reservation.Status.RELEASED
    assert row(live.pk)["status"] == Reservation.Status.HELD
    assert [e.payload["reason"] for e in released_events(stale.pk)] == ["reclaimed"]
    with pytest.raises(errors.NoSeatsAvailable):
        services.hold_seat(full.pk, "d", ttl_seconds=600)


def test_an_offering_with_free_seats_leaves_its_eligible_holds_to_cleanup(make_offering):
    offering = make_offering(capacity=2)
    stale = services.hold_seat(offering.pk, "a", ttl_seconds=600)
    expire(stale.pk)

    services.hold_seat(offering.pk, "b", ttl_seconds=600)

    assert row(stale.pk)["status"] == Reservation.Status.HELD
    assert released_events(stale.pk) == []


def test_availability_counts_eligible_holds_as_available_seats(make_offering):
    offering = make_offering(capacity=5)
    stale = [services.hold_seat(offering.pk, f"s{i}", ttl_seconds=600) for i in range(2)]
    services.hold_seat(offering.pk, "live", ttl_seconds=600)
    confirmed = services.hold_seat(offering.pk, "c", ttl_seconds=600)
    services.confirm(confirmed.pk, 1)
    for hold in stale:
        expire(hold.pk)

    assert services.availability(offering.pk) == {
        "offering_id": offering.pk,
        "capacity": 5,
        "seats_available": 1,
        "held": 3,
        "eligible": 2,
        "confirmed": 1,
        "available": 3,
    }


def test_availability_of_a_missing_offering_raises_offering_not_found(db):
    with pytest.raises(errors.OfferingNotFound, match=str(MISSING_ID)):
        services.availability(MISSING_ID)


# --- renew -----------------------------------------------------------------------------------


def test_renewing_bumps_the_version_extends_the_hold_and_writes_a_renewed_event(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    soon = t0 + timedelta(seconds=30)

    renewed = services.renew(hold.pk, 1, ttl_seconds=600, now=soon)

    assert renewed.version == 2
    assert renewed.status == Reservation.Status.HELD
    assert renewed.expires_at == soon + timedelta(seconds=600)
    assert renewed.next_attempt_at == renewed.expires_at
    assert seats(offering) == offering.capacity - 1
    assert events(hold.pk) == [("reservation.held", 1), ("reservation.renewed", 2)]


def test_renewing_twice_needs_the_latest_version_each_time(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.renew(hold.pk, 1, ttl_seconds=60, now=t0)

    with pytest.raises(
        errors.StaleVersion, match=f"hold {hold.pk} is at version 2, not the expected 1"
    ):
        services.renew(hold.pk, 1, ttl_seconds=60, now=t0)

    assert services.renew(hold.pk, 2, ttl_seconds=60, now=t0).version == 3


def test_renewing_with_a_stale_version_raises_stale_version_with_both_versions(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)

    with pytest.raises(errors.StaleVersion) as err:
        services.renew(hold.pk, 7, ttl_seconds=60, now=t0)

    assert (err.value.expected, err.value.actual) == (7, 1)
    assert err.value.code == "stale_version"
    assert str(hold.pk) in str(err.value)
    assert row(hold.pk)["version"] == 1
    assert events(hold.pk) == [("reservation.held", 1)]


def test_renewing_an_expired_but_unreleased_hold_is_refused_with_hold_expired(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=60)  # expires_at <= now: eligible, its seat counts as free

    with pytest.raises(errors.HoldExpired, match=f"hold {hold.pk} has expired") as err:
        services.renew(hold.pk, 1, ttl_seconds=60, now=later)

    assert err.value.code == "hold_expired"
    state = row(hold.pk)
    assert (state["status"], state["version"]) == (Reservation.Status.HELD, 1)
    assert state["expires_at"] == t0 + timedelta(seconds=60)
    assert events(hold.pk) == [("reservation.held", 1)]


def test_renewing_a_hold_expired_by_the_database_clock_is_refused_with_hold_expired(offering):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=600)
    expire(hold.pk)

    with pytest.raises(errors.HoldExpired):
        services.renew(hold.pk, 1, ttl_seconds=600)


@pytest.mark.parametrize("final_status", ["confirmed", "cancelled", "released"])
def test_renewing_a_hold_that_is_no_longer_held_raises_not_held_naming_its_status(
    offering, t0, final_status
):
    hold_id, version = ended_hold(offering, t0, final_status)

    with pytest.raises(errors.NotHeld, match=f"hold {hold_id} is {final_status}, not held") as err:
        services.renew(hold_id, version, ttl_seconds=60, now=t0)

    assert err.value.status == final_status
    assert err.value.code == "not_held"


def test_renewing_a_missing_hold_raises_reservation_not_found_naming_it(db):
    with pytest.raises(
        errors.ReservationNotFound, match=f"hold {MISSING_ID} does not exist"
    ) as err:
        services.renew(MISSING_ID, 1, ttl_seconds=60)
    assert err.value.code == "reservation_not_found"


@pytest.mark.parametrize("ttl", [0, 86400 + 1])
def test_renewing_with_an_invalid_ttl_raises_invalid_ttl_and_changes_nothing(offering, ttl):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60)

    with pytest.raises(errors.InvalidTtl):
        services.renew(hold.pk, 1, ttl_seconds=ttl)

    assert row(hold.pk)["version"] == 1


# --- confirm ---------------------------------------------------------------------------------


def test_confirming_bumps_the_version_keeps_the_seat_and_writes_a_confirmed_event(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)

    confirmed = services.confirm(hold.pk, 1, now=t0 + timedelta(seconds=59))

    assert confirmed.status == Reservation.Status.CONFIRMED
    assert confirmed.version == 2
    assert seats(offering) == offering.capacity - 1
    assert events(hold.pk) == [("reservation.held", 1), ("reservation.confirmed", 2)]


def test_confirming_an_expired_hold_is_refused_with_hold_expired(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)

    with pytest.raises(errors.HoldExpired, match=str(hold.pk)):
        services.confirm(hold.pk, 1, now=t0 + timedelta(seconds=61))

    assert row(hold.pk)["status"] == Reservation.Status.HELD
    assert events(hold.pk) == [("reservation.held", 1)]


def test_confirming_with_a_stale_version_raises_stale_version(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.renew(hold.pk, 1, ttl_seconds=60, now=t0)

    with pytest.raises(errors.StaleVersion) as err:
        services.confirm(hold.pk, 1, now=t0)

    assert (err.value.expected, err.value.actual) == (1, 2)
    assert row(hold.pk)["status"] == Reservation.Status.HELD


def test_confirming_twice_raises_not_held_the_second_time(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.confirm(hold.pk, 1, now=t0)

    with pytest.raises(errors.NotHeld) as err:
        services.confirm(hold.pk, 2, now=t0)

    assert err.value.status == "confirmed"
    assert events(hold.pk) == [("reservation.held", 1), ("reservation.confirmed", 2)]


def test_confirming_a_missing_hold_raises_reservation_not_found(db):
    with pytest.raises(errors.ReservationNotFound, match=str(MISSING_ID)):
        services.confirm(MISSING_ID, 1)


# --- cancel ----------------------------------------------------------------------------------


def test_cancelling_bumps_the_version_returns_the_seat_and_writes_a_cancelled_event(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)

    cancelled = services.cancel(hold.pk, 1, now=t0)

    assert cancelled.status == Reservation.Status.CANCELLED
    assert cancelled.version == 2
    assert seats(offering) == offering.capacity
    assert events(hold.pk) == [("reservation.held", 1), ("reservation.cancelled", 2)]


def test_cancelling_an_expired_hold_is_allowed(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    expire(hold.pk)

    cancelled = services.cancel(hold.pk, 1, now=t0 + timedelta(hours=1))

    assert cancelled.status == Reservation.Status.CANCELLED
    assert seats(offering) == offering.capacity
    # a release message built before the cancel no longer applies
    assert services.release_if_expired(hold.pk, 1) == ReleaseOutcome.NO_LONGER_HELD


def test_cancelling_with_a_stale_version_raises_stale_version_and_keeps_the_seat(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)

    with pytest.raises(errors.StaleVersion) as err:
        services.cancel(hold.pk, 2, now=t0)

    assert (err.value.expected, err.value.actual) == (2, 1)
    assert seats(offering) == offering.capacity - 1
    assert row(hold.pk)["status"] == Reservation.Status.HELD


@pytest.mark.parametrize("final_status", ["confirmed", "cancelled", "released"])
def test_cancelling_a_hold_that_is_no_longer_held_raises_not_held(offering, t0, final_status):
    hold_id, version = ended_hold(offering, t0, final_status)
    free_before = seats(offering)

    with pytest.raises(errors.NotHeld) as err:
        services.cancel(hold_id, version, now=t0)

    assert err.value.status == final_status
    assert seats(offering) == free_before


def test_cancelling_a_missing_hold_raises_reservation_not_found(db):
    with pytest.raises(errors.ReservationNotFound, match=f"hold {MISSING_ID} does not exist"):
        services.cancel(MISSING_ID, 1)


def test_cancelling_a_hold_set_aside_by_the_sweep_succeeds_and_returns_it(offering, t0):
    # given: an expired hold claimed past its budget (next_attempt_at = infinity)
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)
    (claimed,) = claim_expired(0, 1, batch_size=10, lease_seconds=1, max_claims=0, now=later)
    assert claimed.set_aside

    # when: the learner cancels it (allowed for an expired hold)
    cancelled = services.cancel(hold.pk, 1, now=later)

    # then
    assert cancelled.status == Reservation.Status.CANCELLED
    assert seats(offering) == offering.capacity


# --- release_if_expired ----------------------------------------------------------------------


def test_releasing_an_expired_hold_returns_its_seat_without_bumping_the_version(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)

    outcome = services.release_if_expired(hold.pk, 1, now=t0 + timedelta(seconds=60))

    assert outcome == ReleaseOutcome.RELEASED
    state = row(hold.pk)
    assert state["status"] == Reservation.Status.RELEASED
    assert state["version"] == 1
    assert state["released_version"] == 1
    assert state["release_reason"] == "expired"
    assert state["has_released_at"]
    assert seats(offering) == offering.capacity
    assert events(hold.pk) == [("reservation.held", 1), ("reservation.released", 1)]
    (event,) = released_events(hold.pk)
    assert event.payload["reason"] == "expired"
    assert event.payload["offering_id"] == offering.pk


def test_releasing_by_the_database_clock_needs_no_explicit_now(offering):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=600)
    expire(hold.pk)

    assert services.release_if_expired(hold.pk, 1) == ReleaseOutcome.RELEASED
    assert seats(offering) == offering.capacity


def test_releasing_a_missing_hold_reads_not_found(db):
    assert services.release_if_expired(MISSING_ID, 1) == ReleaseOutcome.NOT_FOUND


def test_releasing_a_hold_released_at_this_version_reads_already_handled(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=60)
    services.release_if_expired(hold.pk, 1, now=later)

    outcomes = [services.release_if_expired(hold.pk, 1, now=later) for _ in range(3)]

    assert outcomes == [ReleaseOutcome.ALREADY_HANDLED] * 3
    assert len(released_events(hold.pk)) == 1
    assert seats(offering) == offering.capacity


def test_releasing_a_hold_renewed_since_the_message_was_built_reads_renewed(offering, t0):
    # given: the message saw version 1; the hold was renewed and has expired again since
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.renew(hold.pk, 1, ttl_seconds=60, now=t0 + timedelta(seconds=30))
    much_later = t0 + timedelta(hours=1)

    # when
    outcome = services.release_if_expired(hold.pk, 1, now=much_later)

    # then: the renewed hold is never released by the old message
    assert outcome == ReleaseOutcome.RENEWED
    assert row(hold.pk)["status"] == Reservation.Status.HELD
    assert released_events(hold.pk) == []
    # a message at the current version does release it
    assert services.release_if_expired(hold.pk, 2, now=much_later) == ReleaseOutcome.RELEASED
    assert row(hold.pk)["released_version"] == 2
    assert [e.version for e in released_events(hold.pk)] == [2]


@pytest.mark.parametrize("status", ["held", "released"])
def test_a_version_above_the_holds_own_reads_unknown_version(offering, t0, status):
    # given: a hold at version 2 (renewed once), still held or released at 2
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.renew(hold.pk, 1, ttl_seconds=60, now=t0)
    later = t0 + timedelta(hours=1)
    if status == "released":
        services.release_if_expired(hold.pk, 2, now=later)
    # when: a message names a version it never had (no sweep could have sent it)
    outcome = services.release_if_expired(hold.pk, 3, now=later)
    # then
    assert outcome == ReleaseOutcome.UNKNOWN_VERSION
    assert row(hold.pk)["status"] == status
    assert len(released_events(hold.pk)) == (1 if status == "released" else 0)


def test_releasing_a_hold_released_at_another_version_reads_renewed(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.renew(hold.pk, 1, ttl_seconds=60, now=t0)
    later = t0 + timedelta(hours=1)
    services.release_if_expired(hold.pk, 2, now=later)

    assert services.release_if_expired(hold.pk, 1, now=later) == ReleaseOutcome.RENEWED
    assert len(released_events(hold.pk)) == 1


@pytest.mark.parametrize("final_status", ["confirmed", "cancelled"])
@pytest.mark.parametrize(
    ("message_version", "expected"),
    [
        (1, ReleaseOutcome.NO_LONGER_HELD),  # the version it was held at
        (2, ReleaseOutcome.NO_LONGER_HELD),  # the version confirm or cancel gave it
        (3, ReleaseOutcome.UNKNOWN_VERSION),  # a version it never had
    ],
)
def test_releasing_a_confirmed_or_cancelled_hold_reads_no_longer_held_at_any_version_it_had(
    offering, t0, final_status, message_version, expected
):
    hold_id, _ = ended_hold(offering, t0, final_status)
    free_before = seats(offering)

    outcome = services.release_if_expired(hold_id, message_version, now=t0 + timedelta(hours=1))

    assert outcome == expected
    assert row(hold_id)["status"] == final_status
    assert released_events(hold_id) == []
    assert seats(offering) == free_before


def test_releasing_a_hold_that_has_not_expired_reads_not_expired(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)

    outcome = services.release_if_expired(hold.pk, 1, now=t0 + timedelta(seconds=59))

    assert outcome == ReleaseOutcome.NOT_EXPIRED
    assert row(hold.pk)["status"] == Reservation.Status.HELD
    assert released_events(hold.pk) == []
    assert seats(offering) == offering.capacity - 1


def test_releasing_by_the_database_clock_leaves_an_unexpired_hold_alone(offering):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=600)

    assert services.release_if_expired(hold.pk, 1) == ReleaseOutcome.NOT_EXPIRED


def test_releasing_with_a_custom_reason_records_it_on_the_hold_and_the_event(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)

    services.release_if_expired(hold.pk, 1, reason="admin", now=t0 + timedelta(seconds=61))

    assert row(hold.pk)["release_reason"] == "admin"
    assert released_events(hold.pk)[0].payload["reason"] == "admin"


# --- claim_expired / reschedule_claim --------------------------------------------------------


def claim(now: datetime, **overrides: object) -> list[ClaimedHold]:
    options: dict[str, object] = {
        "batch_size": 100,
        "lease_seconds": 300,
        "max_claims": 3,
        "trace_id": "trace-1",
    }
    options.update(overrides)
    shard = int(options.pop("shard", 0))  # type: ignore[call-overload]
    shards = int(options.pop("shards", 1))  # type: ignore[call-overload]
    return claim_expired(shard, shards, now=now, **options)  # type: ignore[arg-type]


def test_a_claim_takes_only_held_expired_due_holds_of_its_shard(make_offering, t0):
    offering = make_offering(capacity=20)
    expired = [services.hold_seat(offering.pk, f"e{i}", ttl_seconds=60, now=t0) for i in range(8)]
    live = services.hold_seat(offering.pk, "live", ttl_seconds=3600, now=t0)
    confirmed = services.hold_seat(offering.pk, "conf", ttl_seconds=60, now=t0)
    services.confirm(confirmed.pk, 1, now=t0)
    cancelled = services.hold_seat(offering.pk, "canc", ttl_seconds=60, now=t0)
    services.cancel(cancelled.pk, 1, now=t0)
    released = services.hold_seat(offering.pk, "rel", ttl_seconds=60, now=t0)
    services.release_if_expired(released.pk, 1, now=t0 + timedelta(seconds=60))
    later = t0 + timedelta(seconds=120)
    # one expired hold is not due yet (a sweep leased it a moment ago)
    not_due = expired[0]
    Reservation.objects.filter(pk=not_due.pk).update(next_attempt_at=later + timedelta(seconds=1))

    by_shard = {
        shard: {c.reservation_id for c in claim(later, shard=shard, shards=3)} for shard in range(3)
    }

    for shard, ids in by_shard.items():
        assert all(Reservation.objects.get(pk=i).bucket % 3 == shard for i in ids)
    assert set().union(*by_shard.values()) == {h.pk for h in expired[1:]}
    assert sum(len(ids) for ids in by_shard.values()) == 7
    assert row(live.pk)["claim_count"] == 0
    assert row(not_due.pk)["claim_count"] == 0


def test_a_claim_leases_the_hold_and_counts_it_without_bumping_the_version(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)

    (claimed,) = claim(later, lease_seconds=30, trace_id="trace-abc")

    assert claimed == ClaimedHold(
        reservation_id=hold.pk,
        version=1,
        expires_at=t0 + timedelta(seconds=60),
        bucket=hold.pk % 1024,
        claim_count=1,
        set_aside=False,
    )
    state = row(hold.pk)
    assert state["next_attempt_at"] == later + timedelta(seconds=30)
    assert state["claim_count"] == 1
    assert state["version"] == 1
    assert state["last_trace_id"] == "trace-abc"
    assert state["has_last_claimed_at"]
    assert events(hold.pk) == [("reservation.held", 1)]


def test_a_claimed_hold_is_not_claimed_again_until_its_lease_passes(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)
    claim(later, lease_seconds=30)

    assert claim(later) == []
    assert claim(later + timedelta(seconds=29)) == []
    (again,) = claim(later + timedelta(seconds=30))

    assert again.reservation_id == hold.pk
    assert again.claim_count == 2


def test_a_hold_claimed_more_than_max_claims_times_is_set_aside_and_not_claimed_again(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    clock = t0 + timedelta(seconds=120)
    counts = []
    for _ in range(3):
        (c,) = claim(clock, lease_seconds=10, max_claims=2)
        counts.append((c.claim_count, c.set_aside))
        clock += timedelta(seconds=10)

    assert counts == [(1, False), (2, False), (3, True)]
    assert row(hold.pk)["infinite"]
    assert claim(clock + timedelta(days=365), max_claims=2) == []
    assert row(hold.pk)["claim_count"] == 3


def test_rescheduling_a_set_aside_hold_makes_it_due_again_with_a_fresh_budget(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)
    claim(later, max_claims=0)
    assert claim(later, max_claims=0) == []

    assert reschedule_claim([hold.pk]) == 1

    state = row(hold.pk)
    assert not state["infinite"]
    assert state["claim_count"] == 0
    (again,) = claim(later, max_claims=1)
    assert (again.reservation_id, again.claim_count, again.set_aside) == (hold.pk, 1, False)


def test_rescheduling_ignores_holds_that_are_no_longer_held_and_empty_input(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.cancel(hold.pk, 1, now=t0)

    assert reschedule_claim([hold.pk, MISSING_ID]) == 0
    assert reschedule_claim([]) == 0


def test_claims_come_back_sorted_by_expiry(make_offering, t0):
    offering = make_offering(capacity=5)
    ttls = [300, 60, 240, 120, 180]
    holds = [
        services.hold_seat(offering.pk, f"h{i}", ttl_seconds=ttl, now=t0)
        for i, ttl in enumerate(ttls)
    ]
    # due order differs from expiry order: the shortest-lived hold was leased most recently
    Reservation.objects.filter(pk=holds[1].pk).update(next_attempt_at=t0 + timedelta(seconds=900))

    claimed = claim(t0 + timedelta(seconds=1000))

    assert [c.expires_at for c in claimed] == sorted(c.expires_at for c in claimed)
    assert [c.reservation_id for c in claimed] == [holds[i].pk for i in (1, 3, 4, 2, 0)]


def test_a_claim_takes_at_most_one_batch_in_due_order(make_offering, t0):
    offering = make_offering(capacity=5)
    holds = [
        services.hold_seat(offering.pk, f"h{i}", ttl_seconds=60 * (i + 1), now=t0) for i in range(5)
    ]
    later = t0 + timedelta(hours=1)

    first = claim(later, batch_size=2)
    second = claim(later, batch_size=2)
    third = claim(later, batch_size=2)

    assert [c.reservation_id for c in first] == [holds[0].pk, holds[1].pk]
    assert [c.reservation_id for c in second] == [holds[2].pk, holds[3].pk]
    assert [c.reservation_id for c in third] == [holds[4].pk]


@pytest.mark.parametrize(("shard", "shards"), [(-1, 2), (2, 2), (0, 0)])
def test_a_claim_outside_the_shard_range_raises_value_error(db, shard, shards):
    with pytest.raises(ValueError, match="outside"):
        claim_expired(shard, shards, batch_size=1, lease_seconds=1, max_claims=1)


def test_a_claimed_hold_is_still_released_by_its_message(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)
    (claimed,) = claim(later)

    outcome = services.release_if_expired(claimed.reservation_id, claimed.version, now=later)

    assert outcome == ReleaseOutcome.RELEASED
    assert len(released_events(hold.pk)) == 1


def test_a_renewed_hold_is_not_claimed_until_it_expires_again(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.renew(hold.pk, 1, ttl_seconds=600, now=t0 + timedelta(seconds=30))

    assert claim(t0 + timedelta(seconds=120)) == []
    (claimed,) = claim(t0 + timedelta(seconds=630))
    assert claimed.version == 2


def test_a_set_aside_hold_reclaimed_by_a_new_hold_can_still_be_read(make_offering, t0):
    full = make_offering(capacity=1)
    hold = services.hold_seat(full.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)
    (claimed,) = claim(later, max_claims=0)
    assert claimed.set_aside

    services.hold_seat(full.pk, "learner-2", ttl_seconds=60, now=later)

    released = Reservation.objects.get(pk=hold.pk)  # 'infinity' loads (common.db)
    assert released.status == Reservation.Status.RELEASED
    assert released.next_attempt_at == datetime.max.replace(tzinfo=UTC)


def test_a_set_aside_hold_can_still_be_read_through_the_orm(offering):
    # given: a hold set aside after too many claims (next_attempt_at = 'infinity')
    hold = services.hold_seat(offering.pk, "learner", ttl_seconds=60)
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE reservations_reservation SET next_attempt_at = 'infinity' WHERE id = %s",
            [hold.pk],
        )
    # when: the admin, explain_hold or a service reads the row
    loaded = Reservation.objects.get(pk=hold.pk)
    # then: infinity reads as the largest datetime instead of raising
    assert loaded.next_attempt_at.year == 9999
