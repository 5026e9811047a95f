"""Real parallel connections racing the seat services on one PostgreSQL database.

Each client is a thread with its own Django connection (closed when the thread ends). All
clients connect first and then start together at a barrier, so their transactions overlap.
A deadlock or serialization failure would surface here as an unexpected error.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import pytest
from django.db import connection
from django.utils import timezone

from reservations import services
from reservations.errors import NoSeatsAvailable, NotHeld
from reservations.models import Offering, OutboxEvent, Reservation
from reservations.services import ReleaseOutcome

pytestmark = pytest.mark.django_db(transaction=True)

CLIENTS = 16


@dataclass
class Result:
    value: object = None
    error: BaseException | None = None


def race(calls: Sequence[Callable[[], object]]) -> list[Result]:
    """Run every call in its own thread, all released at once; return results in call order."""
    barrier = threading.Barrier(len(calls))
    results = [Result() for _ in calls]

    def client(i: int) -> None:
        try:
            connection.ensure_connection()
            barrier.wait(timeout=30)
            results[i].value = calls[i]()
        except BaseException as err:  # noqa: BLE001 - every failure is reported to the test
            results[i].error = err
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client is stuck (lock wait?)"
    return results


def unexpected(results: Sequence[Result], *allowed: type[BaseException]) -> list[BaseException]:
    return [r.error for r in results if r.error is not None and not isinstance(r.error, allowed)]


def expire_in_db(*reservation_ids: int) -> None:
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE reservations_reservation SET expires_at = now() - interval '1 minute', "
            "next_attempt_at = now() - interval '1 minute' WHERE id = ANY(%s)",
            [list(reservation_ids)],
        )


def offering_with(free: int, eligible: int, live: int, confirmed: int) -> tuple[Offering, list]:
    """An offering with ``free`` free seats, ``eligible`` expired-unreleased holds, ``live``
    unexpired holds and ``confirmed`` seats; returns it and its eligible holds."""
    offering = services.create_offering("race", capacity=free + eligible + live + confirmed)
    stale = [
        services.hold_seat(offering.pk, f"stale-{i}", ttl_seconds=600) for i in range(eligible)
    ]
    for i in range(live):
        services.hold_seat(offering.pk, f"live-{i}", ttl_seconds=600)
    for i in range(confirmed):
        hold = services.hold_seat(offering.pk, f"paid-{i}", ttl_seconds=600)
        services.confirm(hold.pk, 1)
    expire_in_db(*(h.pk for h in stale))
    return offering, stale


def released_event_counts() -> Counter[int]:
    return Counter(
        OutboxEvent.objects.filter(kind=OutboxEvent.Kind.RELEASED).values_list(
            "reservation_id", flat=True
        )
    )


@pytest.mark.parametrize(
    ("free", "eligible"),
    [(1, 2), (0, 5), (3, 0)],
    ids=["free-and-eligible", "only-eligible", "only-free"],
)
def test_clients_racing_for_the_last_seats_get_exactly_the_free_and_eligible_ones(free, eligible):
    # given
    offering, stale = offering_with(free=free, eligible=eligible, live=3, confirmed=2)
    assert services.availability(offering.pk)["available"] == free + eligible

    # when
    results = race(
        [
            partial(services.hold_seat, offering.pk, f"client-{i}", ttl_seconds=600)
            for i in range(CLIENTS)
        ]
    )

    # then: exactly the available seats were granted, none oversold, no deadlock
    assert unexpected(results, NoSeatsAvailable) == []
    granted = [r.value for r in results if r.error is None]
    assert len(granted) == free + eligible
    assert sum(isinstance(r.error, NoSeatsAvailable) for r in results) == CLIENTS - len(granted)
    offering.refresh_from_db()
    assert offering.seats_available == 0
    assert services.availability(offering.pk)["available"] == 0
    assert services.seat_conservation_violations() == []
    # every eligible hold was reclaimed once, with its one released event
    counts = released_event_counts()
    for hold in stale:
        hold.refresh_from_db()
        assert hold.status == Reservation.Status.RELEASED
        assert hold.release_reason == "reclaimed"
        assert counts[hold.pk] == 1
    assert set(counts) == {h.pk for h in stale}


def test_new_holds_cleanup_releases_and_cancels_racing_on_two_offerings_conserve_seats():
    # given: two full offerings with eligible holds and live holds
    first, first_stale = offering_with(free=0, eligible=4, live=4, confirmed=1)
    second, second_stale = offering_with(free=0, eligible=4, live=4, confirmed=1)
    live = list(
        Reservation.objects.filter(
            status=Reservation.Status.HELD, holder__startswith="live-"
        ).values_list("pk", flat=True)
    )
    calls: list[Callable[[], object]] = []
    for i in range(12):
        target = first if i % 2 else second
        calls.append(partial(services.hold_seat, target.pk, f"c{i}", ttl_seconds=600))
    for hold in first_stale + second_stale:  # the cleanup's messages for the eligible holds
        calls.append(partial(services.release_if_expired, hold.pk, 1))
    for pk in live:
        calls.append(partial(services.cancel, pk, 1))
    random.Random(7).shuffle(calls)

    # when
    results = race(calls)

    # then
    assert unexpected(results, NoSeatsAvailable) == []
    assert services.seat_conservation_violations() == []
    counts = released_event_counts()
    assert all(n == 1 for n in counts.values())
    assert set(counts) == {h.pk for h in first_stale + second_stale}
    outcomes = Counter(r.value for r in results if isinstance(r.value, ReleaseOutcome))
    assert set(outcomes) <= {ReleaseOutcome.RELEASED, ReleaseOutcome.ALREADY_HANDLED}
    # 4 eligible seats per offering are always there to take; the other clients raced the
    # cancels (8 more seats), so 8..12 were granted and the rest of the 16 seats are free
    granted = sum(
        isinstance(r.value, Reservation) and r.value.holder.startswith("c") for r in results
    )
    refused = sum(isinstance(r.error, NoSeatsAvailable) for r in results)
    assert 8 <= granted <= 12
    assert granted + refused == 12
    free = sum(
        Offering.objects.filter(pk__in=[first.pk, second.pk]).values_list(
            "seats_available", flat=True
        )
    )
    assert free == 16 - granted


def test_racing_cancel_and_release_of_expired_holds_lets_exactly_one_win_each():
    offering = services.create_offering("race", capacity=12)
    ids = [services.hold_seat(offering.pk, f"h{i}", ttl_seconds=600).pk for i in range(12)]
    expire_in_db(*ids)
    calls: list[Callable[[], object]] = []
    for pk in ids:
        calls.append(partial(services.release_if_expired, pk, 1))
        calls.append(partial(services.cancel, pk, 1))

    results = race(calls)

    assert unexpected(results, NotHeld) == []
    for pk, release, cancel in zip(ids, results[0::2], results[1::2], strict=True):
        hold = Reservation.objects.get(pk=pk)
        if release.value == ReleaseOutcome.RELEASED:
            assert isinstance(cancel.error, NotHeld) and cancel.error.status == "released"
            assert hold.status == Reservation.Status.RELEASED
        else:
            assert release.value == ReleaseOutcome.NO_LONGER_HELD
            assert cancel.error is None
            assert hold.status == Reservation.Status.CANCELLED
    offering.refresh_from_db()
    assert offering.seats_available == 12
    assert services.seat_conservation_violations() == []
    assert all(n == 1 for n in released_event_counts().values())


@pytest.mark.parametrize("change", ["renew", "confirm"])
def test_racing_a_renew_or_confirm_against_a_release_never_releases_the_changed_hold(change):
    # The release message is processed with a clock an hour ahead, so both transitions pass
    # their own expiry check and only the row lock and the version decide who wins: the worst
    # case of two transactions that disagree about "now".
    offering = services.create_offering("race", capacity=12)
    ids = [services.hold_seat(offering.pk, f"h{i}", ttl_seconds=600).pk for i in range(12)]
    skewed = timezone.now() + timedelta(hours=1)
    calls: list[Callable[[], object]] = []
    for pk in ids:
        calls.append(partial(services.release_if_expired, pk, 1, now=skewed))
        if change == "renew":
            calls.append(partial(services.renew, pk, 1, ttl_seconds=600))
        else:
            calls.append(partial(services.confirm, pk, 1))

    results = race(calls)

    assert unexpected(results, NotHeld) == []
    lost = ReleaseOutcome.RENEWED if change == "renew" else ReleaseOutcome.NO_LONGER_HELD
    for pk, release, learner in zip(ids, results[0::2], results[1::2], strict=True):
        hold = Reservation.objects.get(pk=pk)
        if learner.error is None:
            # the learner's change won: the message saw version 1 and must not release
            assert release.value == lost
            assert hold.version == 2
            assert hold.status != Reservation.Status.RELEASED
            assert hold.released_version is None
        else:
            assert isinstance(learner.error, NotHeld) and learner.error.status == "released"
            assert release.value == ReleaseOutcome.RELEASED
            assert (hold.status, hold.version, hold.released_version) == ("released", 1, 1)
    released = sum(r.value == ReleaseOutcome.RELEASED for r in results[0::2])
    offering.refresh_from_db()
    assert offering.seats_available == released
    assert services.seat_conservation_violations() == []
    assert all(n == 1 for n in released_event_counts().values())
