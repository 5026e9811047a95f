"""The sweep's claim (cleanup.release.claim): every bucket and every hold in exactly one shard;
a claim takes only held, expired, due holds of its shard, oldest first and a batch at most,
leases them and counts the claim, sets aside a hold claimed too often, and rescheduling makes
it due again."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction

from cleanup.release.claim import ClaimedReservation, claim_expired, reschedule_claim, shard_buckets
from cleanup.release.schedule import (
    install_schedule,
)
from reservations import services
from reservations.models import BUCKETS, Reservation
from reservations.services import ReleaseOutcome
from tests.support.holds import MISSING_ID, events, released_events, row
from tests.support.schedule import sweep_entries
from tools.seed import seed_holds


@pytest.mark.django_db
@pytest.mark.parametrize("shards", [1, 3, 4, 5, 7, BUCKETS])
def test_every_bucket_belongs_to_exactly_one_shard(shards):
    # the buckets the sweep's claim reads (claim_expired) and the SLO gauge reports per shard
    owners: dict[int, list[int]] = {}
    for k in range(shards):
        for b in shard_buckets(k, shards):
            owners.setdefault(b, []).append(k)
    assert sorted(owners) == list(range(BUCKETS))
    assert all(len(found) == 1 for found in owners.values())
    # and the schedule's entries name exactly the shards 0..N-1 of N
    if shards <= 8:
        install_schedule(shards=shards, every=1)
        kwargs = [json.loads(e.kwargs) for e in sweep_entries()]
        assert sorted(kw["shard"] for kw in kwargs) == list(range(shards))
        assert {kw["shards"] for kw in kwargs} == {shards}


@pytest.mark.django_db
@pytest.mark.parametrize(("shard", "shards"), [(0, 0), (-1, 4), (4, 4)])
def test_an_impossible_shard_is_refused(shard, shards):
    with pytest.raises(ValueError):
        shard_buckets(shard, shards)


@pytest.mark.django_db(transaction=True)
def test_every_hold_is_claimed_by_exactly_one_shard_under_any_shard_count():
    # given: holds covering all 1024 buckets, already expired
    with transaction.atomic():
        seed_holds(BUCKETS + 10, offerings=1, expires_in=-60.0, name="buckets")
    ids = set(Reservation.objects.values_list("id", flat=True))
    buckets = set(Reservation.objects.values_list("bucket", flat=True))
    assert buckets == set(range(BUCKETS))
    for shards in (3, 4, 5):
        # the ORM's shard filter partitions the holds
        seen: list[int] = []
        for k in range(shards):
            seen.extend(Reservation.objects.in_shard(k, shards).values_list("id", flat=True))
        assert sorted(seen) == sorted(ids)
        # and so does the sweep's claim statement (lease 0: due again at once for the next N)
        claimed: list[int] = []
        for k in range(shards):
            with transaction.atomic():
                got = claim_expired(k, shards, batch_size=5000, lease_seconds=0, max_claims=100)
            assert all(c.bucket % shards == k for c in got)
            claimed.extend(c.reservation_id for c in got)
        assert sorted(claimed) == sorted(ids)


def claim(now: datetime, **overrides: object) -> list[ClaimedReservation]:
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


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
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


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
def test_a_claim_leases_the_hold_and_counts_it_without_bumping_the_version(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)

    (claimed,) = claim(later, lease_seconds=30, trace_id="trace-abc")

    assert claimed == ClaimedReservation(
        reservation_id=hold.pk,
        version=1,
        expires_at=t0 + timedelta(seconds=60),
        bucket=hold.pk % 1024,
        claim_count=1,
        set_aside=False,
        offering_id=offering.pk,
    )
    state = row(hold.pk)
    assert state["next_attempt_at"] == later + timedelta(seconds=30)
    assert state["claim_count"] == 1
    assert state["version"] == 1
    assert state["last_trace_id"] == "trace-abc"
    assert state["has_last_claimed_at"]
    assert events(hold.pk) == [("reservation.held", 1)]


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
def test_a_claimed_hold_is_not_claimed_again_until_its_lease_passes(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)
    claim(later, lease_seconds=30)

    assert claim(later) == []
    assert claim(later + timedelta(seconds=29)) == []
    (again,) = claim(later + timedelta(seconds=30))

    assert again.reservation_id == hold.pk
    assert again.claim_count == 2


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
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


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
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


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
def test_rescheduling_ignores_holds_that_are_no_longer_held_and_empty_input(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.cancel(hold.pk, 1, now=t0)

    assert reschedule_claim([hold.pk, MISSING_ID]) == 0
    assert reschedule_claim([]) == 0


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
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


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
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


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
@pytest.mark.parametrize(("shard", "shards"), [(-1, 2), (2, 2), (0, 0)])
def test_a_claim_outside_the_shard_range_raises_value_error(db, shard, shards):
    with pytest.raises(ValueError, match="outside"):
        claim_expired(shard, shards, batch_size=1, lease_seconds=1, max_claims=1)


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
def test_a_claimed_hold_is_still_released_by_its_message(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)
    (claimed,) = claim(later)

    outcome = services.release_if_expired(claimed.reservation_id, claimed.version, now=later)

    assert outcome == ReleaseOutcome.RELEASED
    assert len(released_events(hold.pk)) == 1


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
def test_a_renewed_hold_is_not_claimed_until_it_expires_again(offering, t0):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60, now=t0)
    services.renew(hold.pk, 1, ttl_seconds=600, now=t0 + timedelta(seconds=30))

    assert claim(t0 + timedelta(seconds=120)) == []
    (claimed,) = claim(t0 + timedelta(seconds=630))
    assert claimed.version == 2


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
def test_a_set_aside_hold_reclaimed_by_a_new_hold_can_still_be_read(make_offering, t0):
    full = make_offering(capacity=1)
    hold = services.hold_seat(full.pk, "learner-1", ttl_seconds=60, now=t0)
    later = t0 + timedelta(seconds=120)
    (claimed,) = claim(later, max_claims=0)
    assert claimed.set_aside

    services.hold_seat(full.pk, "learner-2", ttl_seconds=60, now=later)

    released = Reservation.objects.get(pk=hold.pk)  # 'infinity' loads (reservations.db)
    assert released.status == Reservation.Status.RELEASED
    assert released.next_attempt_at == datetime.max.replace(tzinfo=UTC)


@pytest.mark.django_db
@pytest.mark.usefixtures("seats_are_conserved_after_every_test")
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
