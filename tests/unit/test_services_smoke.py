from datetime import timedelta

from django.utils import timezone

from reservations import services
from reservations.models import OutboxEvent, Reservation
from reservations.services import ReleaseOutcome


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
