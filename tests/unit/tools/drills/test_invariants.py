"""The invariant check itself (tools.drills.invariants): it passes on a correct history and names
each kind of violation, including a hold released by a message whose version it no longer had."""

from __future__ import annotations

import pytest

from cleanup.models import CleanupReceipt
from cleanup.release.messages import build, validate
from cleanup.release.release import Attempt, release
from reservations import services
from reservations.models import Offering, Reservation
from tests.support.holds import expire
from tools.drills.invariants import invariant_violations

pytestmark = pytest.mark.django_db

ATTEMPT = Attempt(attempt=1, worker="test", task_id="t", queue_age_seconds=None)


def message_for(hold_id: int) -> dict:
    hold = Reservation.objects.get(pk=hold_id)
    return build(hold.pk, hold.version, hold.expires_at, 0, "inv")


def test_a_correct_history_has_no_violation(offering: Offering) -> None:
    released = services.hold_seat(offering.pk, "a", 60)
    renewed = services.hold_seat(offering.pk, "b", 60)
    expire(released.pk)
    stale = message_for(renewed.pk)
    services.renew(renewed.pk, 1, 600)
    # when
    outcomes = [release(validate(message_for(released.pk)), ATTEMPT)]
    outcomes.append(release(validate(stale), ATTEMPT))
    # then
    assert outcomes == ["released", "renewed"]
    assert invariant_violations([released.pk], [renewed.pk]) == []


def test_a_hold_released_by_a_message_older_than_its_version_is_reported(
    offering: Offering,
) -> None:
    # given: a message made at v1; the learner renews (v2); the hold expires again at v2
    hold = services.hold_seat(offering.pk, "a", 60)
    stale = message_for(hold.pk)
    services.renew(hold.pk, 1, 600)
    expire(hold.pk)
    # when: the v1 message is handled
    outcome = release(validate(stale), ATTEMPT)
    # then: a correct release refuses it (renewed) and the check finds nothing; were the old
    # message to release the hold, the version check alone would report it
    assert invariant_violations() == []
    assert invariant_violations(expected_not_released=[hold.pk]) == []
    assert outcome == "renewed"
    # and a history where the v1 message did release it (receipt v1, released at v2) is named
    services.release_if_expired(hold.pk, 2)
    CleanupReceipt.objects.filter(idempotency_key=stale["idempotency_key"]).update(
        outcome="released"
    )
    problems = invariant_violations()
    assert problems == [
        f"1 holds released at a version they no longer had (id, message version, released "
        f"version): [({hold.pk}, 1, 2)]"
    ]


def test_expected_not_released_names_a_released_hold(offering: Offering) -> None:
    hold = services.hold_seat(offering.pk, "a", 60)
    expire(hold.pk)
    assert release(validate(message_for(hold.pk)), ATTEMPT) == "released"
    assert invariant_violations(expected_released=[hold.pk]) == []
    assert invariant_violations(expected_not_released=[hold.pk]) == [
        "1 of 1 renewed/confirmed holds released"
    ]


def test_expected_released_names_a_hold_still_held(offering: Offering) -> None:
    hold = services.hold_seat(offering.pk, "a", 60)
    assert invariant_violations(expected_released=[hold.pk]) == ["1 of 1 holds not released"]


def test_seats_not_conserved_are_reported(offering: Offering) -> None:
    services.hold_seat(offering.pk, "a", 60)
    Offering.objects.filter(pk=offering.pk).update(seats_available=3)
    assert invariant_violations() == [f"seats not conserved for offerings [({offering.pk},)]"]
