"""Random sequences of hold / renew / confirm / cancel / release / claim, checked against a
plain Python model after every step.

No real time passes: the machine owns a clock it advances and passes as ``now=`` to every
service call. The clock starts a day ahead of the database clock, so ``reschedule_claim`` (which
uses the database's ``now()``) makes a hold due at once by the machine's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from django.db import connection
from django.db.models import Count
from django.utils import timezone
from hypothesis import HealthCheck, event, settings
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
from reservations import services
from reservations.errors import NoSeatsAvailable, NotHeld, ReservationExpired, StaleVersion
from reservations.models import Offering, OutboxEvent, Reservation
from reservations.services import ReleaseOutcome

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
        settings=settings(
            max_examples=50,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
