"""The reservation domain services against a real PostgreSQL: hold_seat, renew, confirm,
cancel, release_if_expired and release_holds, and random sequences of them checked against a
model. (The sweep's claim of expired holds: cleanup/release/test_claim.py.)

Expiry is driven two ways: an explicit ``now=`` (services accept it for unit tests only) and
holds whose ``expires_at`` / ``next_attempt_at`` are moved into the past with an UPDATE, so the
database clock (``now()``) sees them as eligible.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.db.models import Count
from django.utils import timezone
from hypothesis import HealthCheck, event
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cleanup.release import claim
from cleanup.release.claim import claim_expired
from reservations import errors, services
from reservations.errors import NoSeatsAvailable, NotHeld, ReservationExpired, StaleVersion
from reservations.models import Offering, OutboxEvent, Reservation
from reservations.services import ReleaseOutcome
from reservations.services import release_holds as release_many_if_expired
from tests.support.holds import MISSING_ID, events, expire, released_events, row

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.usefixtures("seats_are_conserved_after_every_test"),
]


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

    with pytest.raises(errors.ReservationExpired, match=f"hold {hold.pk} has expired") as err:
        services.renew(hold.pk, 1, ttl_seconds=60, now=later)

    assert err.value.code == "hold_expired"
    state = row(hold.pk)
    assert (state["status"], state["version"]) == (Reservation.Status.HELD, 1)
    assert state["expires_at"] == t0 + timedelta(seconds=60)
    assert events(hold.pk) == [("reservation.held", 1)]


def test_renewing_a_hold_expired_by_the_database_clock_is_refused_with_hold_expired(offering):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=600)
    expire(hold.pk)

    with pytest.raises(errors.ReservationExpired):
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

    with pytest.raises(errors.ReservationExpired, match=str(hold.pk)):
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


# --- release_holds: a batch, each hold decided as it would be alone ----------------------------


def _scenario(offering_capacity: int = 10):
    """Holds in every state the outcome order distinguishes; returns (offering, items)."""
    offering = services.create_offering("bulk", offering_capacity)
    expired = [services.hold_seat(offering.pk, f"h{i}", 60) for i in range(6)]
    fresh = services.hold_seat(offering.pk, "fresh", 600)
    services.renew(expired[1].pk, 1, 120)  # now v2; a v1 message is stale
    renewed = services.renew(expired[5].pk, 1, 120)  # v2, expires within the later clock
    services.confirm(expired[2].pk, 1)
    services.cancel(expired[3].pk, 1)
    items = [
        (expired[0].pk, 1),  # released
        (expired[1].pk, 1),  # renewed (version moved while held)
        (expired[2].pk, 1),  # no_longer_held (confirmed)
        (expired[3].pk, 1),  # no_longer_held (cancelled)
        (fresh.pk, 1),  # not_expired at the later clock? no: fresh expires in 600 s
        (999_999, 1),  # not_found
        (expired[4].pk, 1),  # released
        (renewed.pk, 2),  # renewed hold at its new version, expired by the clock → released
    ]
    return offering, items


def test_bulk_release_gives_each_hold_the_outcome_it_would_get_alone(db):
    # given two identical worlds, judged at a clock past the short holds but not the fresh one
    later = timezone.now() + timedelta(seconds=300)
    _, bulk_items = _scenario()
    _, single_items = _scenario()
    # when
    bulk = release_many_if_expired(bulk_items, now=later)
    single = [services.release_if_expired(rid, v, now=later) for rid, v in single_items]
    # then: same outcome, position by position
    assert [bulk[rid] for rid, _ in bulk_items] == single
    assert [bulk[rid] for rid, _ in bulk_items] == [
        ReleaseOutcome.RELEASED,
        ReleaseOutcome.RENEWED,
        ReleaseOutcome.NO_LONGER_HELD,
        ReleaseOutcome.NO_LONGER_HELD,
        ReleaseOutcome.NOT_EXPIRED,
        ReleaseOutcome.NOT_FOUND,
        ReleaseOutcome.RELEASED,
        ReleaseOutcome.RELEASED,
    ]
    # and a second pass finds them released at this version
    again = release_many_if_expired(bulk_items, now=later)
    assert again[bulk_items[0][0]] == ReleaseOutcome.ALREADY_HANDLED
    assert services.seat_conservation_violations() == []


# --- hold_seat's reclaim cap ----------------------------------------------------------------


@pytest.mark.usefixtures("api_token")
@pytest.mark.django_db
def test_a_full_offering_reclaims_at_most_the_cap_of_eligible_holds_per_request():
    # given: a full offering whose holds are all eligible, more of them than the cap
    extra = 10
    capacity = services.RECLAIM_LIMIT + extra
    offering = services.create_offering("reclaim-cap", capacity=capacity)
    held = [services.hold_seat(offering.pk, f"l{i}", 60).pk for i in range(capacity)]
    expire(*held)
    # when: one learner asks for a seat
    new = services.hold_seat(offering.pk, "newcomer", 60)
    # then: exactly the cap was released (the lowest ids: the lock order), one went to the
    # newcomer, the rest stay free; the other eligible holds are left to the cleanup
    released = sorted(
        Reservation.objects.filter(pk__in=held, status="released").values_list("pk", flat=True)
    )
    assert released == sorted(held)[: services.RECLAIM_LIMIT]
    assert Reservation.objects.filter(pk__in=held, status="held").count() == extra
    assert set(
        OutboxEvent.objects.filter(kind="reservation.released").values_list(
            "payload__reason", flat=True
        )
    ) == {"reclaimed"}
    assert OutboxEvent.objects.filter(kind="reservation.released").count() == len(released)
    assert Offering.objects.get(pk=offering.pk).seats_available == services.RECLAIM_LIMIT - 1
    assert new.status == "held"
    assert services.seat_conservation_violations() == []


# --- a smoke test -----------------------------------------------------------------------------


def test_a_hold_that_expired_is_released_once_and_its_seat_returns(offering):
    # given
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60)
    later = timezone.now() + timedelta(seconds=120)
    # when
    first = services.release_if_expired(hold.pk, hold.version, now=later)
    second = services.release_if_expired(hold.pk, hold.version, now=later)
    # then
    assert first == ReleaseOutcome.RELEASED
    assert second == ReleaseOutcome.ALREADY_HANDLED
    hold.refresh_from_db()
    offering.refresh_from_db()
    assert hold.status == Reservation.Status.RELEASED
    assert hold.released_version == 1
    assert offering.seats_available == offering.capacity
    assert OutboxEvent.objects.filter(reservation=hold, kind="reservation.released").count() == 1
    assert services.seat_conservation_violations() == []


# --- random sequences of hold / renew / confirm / cancel / release / claim ------------------
#
# Checked against a plain Python model after every step. No real time passes: the machine owns a
# clock it advances and passes as ``now=`` to every service call. The clock starts a day ahead of
# the database clock, so ``reschedule_claim`` (which uses the database's ``now()``) makes a hold
# due at once by the machine's clock.

HELD, CONFIRMED, CANCELLED, RELEASED = "held", "confirmed", "cancelled", "released"
MAX_CLAIMS = 1


@dataclass
class Hold:
    id: int
    offering_id: int
    status: str
    version: int
    expires_at: datetime
    next_attempt_at: datetime | None  # None: set aside (infinity)
    claim_count: int = 0
    released_version: int | None = None


@dataclass(frozen=True)
class Message:
    """A release message as the sweep would build it: the id and the version it saw."""

    reservation_id: int
    version: int


class ReservationMachine(RuleBasedStateMachine):
    messages = Bundle("messages")

    def __init__(self) -> None:
        super().__init__()
        # Each example starts from empty tables and ids from 1: a hold's bucket (id % 1024),
        # and so its shard, must be the same when Hypothesis replays an example, or the
        # claim rule's results (and the rules drawn after it) differ between runs, which
        # Hypothesis reports as FlakyStrategyDefinition.
        with connection.cursor() as cur:
            for model in (OutboxEvent, Reservation, Offering):
                table = model._meta.db_table
                cur.execute(f"DELETE FROM {table}")
                cur.execute("SELECT setval(pg_get_serial_sequence(%s, 'id'), 1, false)", [table])
        self.clock = timezone.now() + timedelta(days=1)
        self.capacity: dict[int, int] = {}
        self.free: dict[int, int] = {}
        self.holds: dict[int, Hold] = {}

    # --- setup -----------------------------------------------------------------------------

    @initialize(capacities=st.lists(st.integers(1, 3), min_size=2, max_size=3))
    def create_offerings(self, capacities: list[int]) -> None:
        for i, capacity in enumerate(capacities):
            offering = services.create_offering(f"offering {i}", capacity=capacity)
            self.capacity[offering.pk] = capacity
            self.free[offering.pk] = capacity

    # --- model helpers ---------------------------------------------------------------------

    def _expired(self, hold: Hold, at: datetime) -> bool:
        return hold.expires_at <= at

    def _model_release(self, hold: Hold) -> None:
        hold.status = RELEASED
        hold.released_version = hold.version
        self.free[hold.offering_id] += 1

    def _expected_release(self, hold: Hold | None, version: int, at: datetime) -> ReleaseOutcome:
        if hold is None:
            return ReleaseOutcome.NOT_FOUND
        if hold.status == RELEASED and hold.released_version == version:
            return ReleaseOutcome.ALREADY_HANDLED
        if hold.status in (CONFIRMED, CANCELLED):
            return ReleaseOutcome.NO_LONGER_HELD
        if hold.version != version:
            return ReleaseOutcome.RENEWED
        if not self._expired(hold, at):
            return ReleaseOutcome.NOT_EXPIRED
        return ReleaseOutcome.RELEASED

    def _pick(self, data: st.DataObject) -> Hold:
        return self.holds[data.draw(st.sampled_from(sorted(self.holds)))]

    def _expected_refusal(self, hold: Hold, version: int, check_expiry: bool) -> type | None:
        if hold.status != HELD:
            return NotHeld
        if hold.version != version:
            return StaleVersion
        if check_expiry and self._expired(hold, self.clock):
            return ReservationExpired
        return None

    # --- rules -----------------------------------------------------------------------------

    @rule(data=st.data(), ttl=st.integers(1, 120), created_ago=st.sampled_from([0, 0, 200]))
    def hold(self, data: st.DataObject, ttl: int, created_ago: int) -> None:
        offering_id = data.draw(st.sampled_from(sorted(self.capacity)))
        # created_ago > ttl: the hold is created already expired by the machine's clock
        at = self.clock - timedelta(seconds=created_ago)
        reclaimable = []
        if self.free[offering_id] == 0:
            reclaimable = sorted(
                h.id
                for h in self.holds.values()
                if h.offering_id == offering_id and h.status == HELD and self._expired(h, at)
            )[: services.RECLAIM_LIMIT]
        try:
            created = services.hold_seat(offering_id, "learner", ttl_seconds=ttl, now=at)
        except NoSeatsAvailable:
            assert self.free[offering_id] == 0 and not reclaimable
            return
        for rid in reclaimable:
            self._model_release(self.holds[rid])
        if reclaimable:
            event("hold: reclaimed eligible holds")
        assert self.free[offering_id] > 0
        self.free[offering_id] -= 1
        expires = at + timedelta(seconds=ttl)
        assert created.expires_at == expires
        self.holds[created.pk] = Hold(created.pk, offering_id, HELD, 1, expires, expires)
        for rid in reclaimable:  # each reclaimed through release_if_expired, once
            (released,) = OutboxEvent.objects.filter(
                reservation_id=rid, kind=OutboxEvent.Kind.RELEASED
            )
            assert released.payload["reason"] == "reclaimed"

    @rule(data=st.data(), ttl=st.integers(1, 120), stale=st.booleans())
    @precondition(lambda self: bool(self.holds))
    def renew(self, data: st.DataObject, ttl: int, stale: bool) -> None:
        hold = self._pick(data)
        version = hold.version - 1 if stale else hold.version
        expected = self._expected_refusal(hold, version, check_expiry=True)
        try:
            renewed = services.renew(hold.id, version, ttl_seconds=ttl, now=self.clock)
        except (NotHeld, StaleVersion, ReservationExpired) as err:
            assert type(err) is expected, (err, expected)
            event(f"renew: {type(err).__name__}")
            return
        assert expected is None
        event("renew: ok")
        hold.version += 1
        hold.expires_at = hold.next_attempt_at = self.clock + timedelta(seconds=ttl)
        assert (renewed.version, renewed.expires_at) == (hold.version, hold.expires_at)

    @rule(data=st.data(), stale=st.booleans())
    @precondition(lambda self: bool(self.holds))
    def confirm(self, data: st.DataObject, stale: bool) -> None:
        hold = self._pick(data)
        version = hold.version - 1 if stale else hold.version
        expected = self._expected_refusal(hold, version, check_expiry=True)
        try:
            services.confirm(hold.id, version, now=self.clock)
        except (NotHeld, StaleVersion, ReservationExpired) as err:
            assert type(err) is expected, (err, expected)
            return
        assert expected is None
        hold.version += 1
        hold.status = CONFIRMED

    @rule(data=st.data(), stale=st.booleans())
    @precondition(lambda self: bool(self.holds))
    def cancel(self, data: st.DataObject, stale: bool) -> None:
        hold = self._pick(data)
        version = hold.version - 1 if stale else hold.version
        expected = self._expected_refusal(hold, version, check_expiry=False)
        try:
            services.cancel(hold.id, version, now=self.clock)
        except (NotHeld, StaleVersion) as err:
            assert type(err) is expected, (err, expected)
            return
        assert expected is None
        hold.version += 1
        hold.status = CANCELLED
        self.free[hold.offering_id] += 1

    @rule(target=messages, data=st.data())
    @precondition(lambda self: bool(self.holds))
    def build_message(self, data: st.DataObject) -> Message:
        hold = self._pick(data)
        return Message(hold.id, hold.version)

    @rule(
        target=messages,
        shards=st.sampled_from([1, 2]),
        data=st.data(),
        batch=st.integers(1, 4),
        lease=st.integers(1, 60),
    )
    def claim(self, shards: int, data: st.DataObject, batch: int, lease: int) -> object:
        shard = data.draw(st.integers(0, shards - 1))
        due = sorted(
            (
                h
                for h in self.holds.values()
                if h.status == HELD
                and h.next_attempt_at is not None
                and h.next_attempt_at <= self.clock
                and self._expired(h, self.clock)
                and (h.id % 1024) % shards == shard
            ),
            key=lambda h: (h.expires_at, h.id),  # oldest expiry first
        )[:batch]
        claimed = claim.claim_expired(
            shard,
            shards,
            batch_size=batch,
            lease_seconds=lease,
            max_claims=MAX_CLAIMS,
            now=self.clock,
        )
        assert {c.reservation_id for c in claimed} == {h.id for h in due}
        assert [c.expires_at for c in claimed] == sorted(c.expires_at for c in claimed)
        for c in claimed:
            hold = self.holds[c.reservation_id]
            hold.claim_count += 1
            assert (c.version, c.claim_count) == (hold.version, hold.claim_count)
            assert c.set_aside == (hold.claim_count > MAX_CLAIMS)
            event(f"claim: set_aside={c.set_aside}")
            hold.next_attempt_at = None if c.set_aside else self.clock + timedelta(seconds=lease)
        return multiple(*(Message(c.reservation_id, c.version) for c in claimed))

    @rule(message=messages)
    def release(self, message: Message) -> None:
        hold = self.holds.get(message.reservation_id)
        expected = self._expected_release(hold, message.version, self.clock)
        outcome = services.release_if_expired(
            message.reservation_id, message.version, now=self.clock
        )
        assert outcome == expected, (message, hold, outcome, expected)
        event(f"release: {outcome}")
        if hold is not None and hold.version != message.version:
            # the hold moved after the message was built: never released by it
            assert outcome != ReleaseOutcome.RELEASED
        if outcome == ReleaseOutcome.RELEASED:
            assert hold is not None
            self._model_release(hold)

    @rule(data=st.data(), stale=st.booleans())
    @precondition(lambda self: bool(self.holds))
    def release_current(self, data: st.DataObject, stale: bool) -> None:
        """A message built just now (or one version behind), delivered at once."""
        hold = self._pick(data)
        self.release(Message(hold.id, hold.version - 1 if stale else hold.version))

    @rule(data=st.data())
    @precondition(lambda self: bool(self.holds))
    def reschedule(self, data: st.DataObject) -> None:
        hold = self._pick(data)
        count = claim.reschedule_claim([hold.id])
        assert count == (1 if hold.status == HELD else 0)
        if hold.status == HELD:
            hold.claim_count = 0
            hold.next_attempt_at = Reservation.objects.values_list(
                "next_attempt_at", flat=True
            ).get(pk=hold.id)
            assert hold.next_attempt_at <= self.clock

    @rule(seconds=st.integers(1, 150))
    def advance_clock(self, seconds: int) -> None:
        self.clock += timedelta(seconds=seconds)

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def seats_are_conserved(self) -> None:
        assert services.seat_conservation_violations() == []
        free = dict(Offering.objects.values_list("id", "seats_available"))
        assert free == self.free

    @invariant()
    def every_hold_matches_the_model(self) -> None:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT id, status, version, released_version, claim_count, "
                "CASE WHEN isfinite(next_attempt_at) THEN next_attempt_at END "
                "FROM reservations_reservation"
            )
            rows = {r[0]: r[1:] for r in cur.fetchall()}
        assert set(rows) == set(self.holds)
        for rid, (status, version, released_version, claim_count, next_attempt) in rows.items():
            hold = self.holds[rid]
            assert (status, version, released_version) == (
                hold.status,
                hold.version,
                hold.released_version,
            ), hold
            if status == HELD:
                assert claim_count == hold.claim_count
                assert next_attempt == hold.next_attempt_at

    @invariant()
    def every_hold_has_at_most_one_released_event_and_released_holds_exactly_one(self) -> None:
        counts = dict(
            OutboxEvent.objects.filter(kind=OutboxEvent.Kind.RELEASED)
            .values_list("reservation_id")
            .annotate(n=Count("id"))
            .values_list("reservation_id", "n")
        )
        assert all(n == 1 for n in counts.values())
        assert set(counts) == {h.id for h in self.holds.values() if h.status == RELEASED}
        versions = dict(
            OutboxEvent.objects.filter(kind=OutboxEvent.Kind.RELEASED).values_list(
                "reservation_id", "version"
            )
        )
        for rid, version in versions.items():
            assert version == self.holds[rid].released_version


@pytest.mark.django_db
def test_random_sequences_of_hold_changes_keep_every_invariant() -> None:
    run_state_machine_as_test(
        ReservationMachine,
        settings=hypothesis_settings(
            max_examples=50,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
