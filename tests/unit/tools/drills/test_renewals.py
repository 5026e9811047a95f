"""The burst drill's renewals (tools.drills.burst): a hold of the renew set is renewed before it
expires, or counted missed once, whether it expired before the drill read it or between that
read and its renew."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models.functions import Now

from reservations import services
from reservations.models import Offering, Reservation
from tests.support.holds import expire
from tools.drills import burst
from tools.drills.state import BurstConfig, BurstState

pytestmark = pytest.mark.django_db


def test_each_hold_of_the_renew_set_is_renewed_or_missed_once(
    offering: Offering, monkeypatch: pytest.MonkeyPatch
) -> None:
    # given: three holds to renew: one expiring in a second, one that expires between the
    # drill's read and its renew, one that expired before the drill looked
    renewable, overtaken, gone = (
        services.hold_seat(offering.pk, name, ttl_seconds=60).pk
        for name in ("renewable", "overtaken", "gone")
    )
    Reservation.objects.filter(pk__in=[renewable, overtaken]).update(
        expires_at=Now() + timedelta(seconds=1)
    )
    expire(gone)
    state = BurstState(renew_set={renewable, overtaken, gone})
    state.renew_schedule = sorted(
        (hold.expires_at, hold.pk) for hold in Reservation.objects.filter(pk__in=state.renew_set)
    )
    renew = services.renew

    def expires_first(rid: int, *args: Any, **kwargs: Any) -> Any:
        if rid == overtaken:
            expire(overtaken)
        return renew(rid, *args, **kwargs)

    monkeypatch.setattr(services, "renew", expires_first)
    # when
    burst._renew_due(BurstConfig(renew_fraction=0.1), state)
    # then
    assert state.renewed == [renewable]
    assert state.renew_missed == 2
    assert state.renew_set == set()
    assert state.renew_window == []
