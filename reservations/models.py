"""Offerings with seat capacity, holds (reservations) on them, and the domain outbox.

State changes happen only through ``reservations.services``; these models hold the shape,
the constraints and the indexes the services' queries rely on.
"""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now

BUCKETS = 1024


class Offering(models.Model):
    """A course section with a fixed number of seats."""

    name = models.CharField(max_length=200)
    capacity = models.PositiveIntegerField()
    # Maintained by the services: capacity - held - confirmed, always.
    seats_available = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(seats_available__gte=0) & Q(seats_available__lte=F("capacity")),
                name="reservations_offering_seats_within_capacity",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} (#{self.pk})"


class ReservationQuerySet(models.QuerySet["Reservation"]):
    def held(self) -> ReservationQuerySet:
        """Active holds, expired or not."""
        return self.filter(status=Reservation.Status.HELD)

    def eligible(self) -> ReservationQuerySet:
        """Held and past ``expires_at`` by the database clock, claimed or not."""
        return self.filter(ELIGIBLE)

    def in_shard(self, shard: int, shards: int) -> ReservationQuerySet:
        return self.annotate(_shard=F("bucket") % shards).filter(_shard=shard)


class Reservation(models.Model):
    """A seat hold. ``version`` moves on every change a learner makes (renew, confirm, cancel);
    a release is conditional on the version its message saw, so a renewed hold is never released.
    """

    class Status(models.TextChoices):
        HELD = "held", "Held"
        CONFIRMED = "confirmed", "Confirmed"
        RELEASED = "released", "Released"
        CANCELLED = "cancelled", "Cancelled"

    offering = models.ForeignKey(Offering, on_delete=models.PROTECT, related_name="reservations")
    holder = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.HELD)
    expires_at = models.DateTimeField()
    version = models.PositiveIntegerField(default=1)
    released_version = models.PositiveIntegerField(null=True, blank=True)
    # Permanent: a shard is a set of buckets, so changing the shard count never strands a hold.
    bucket = models.GeneratedField(
        expression=F("id") % BUCKETS,
        output_field=models.SmallIntegerField(),
        db_persist=True,
    )
    # Cleanup bookkeeping: when a sweep may take this hold (again), and how often it has.
    # Always >= expires_at while held: set to expires_at on hold/renew, to now()+lease on claim.
    next_attempt_at = models.DateTimeField()
    claim_count = models.PositiveIntegerField(default=0)
    last_claimed_at = models.DateTimeField(null=True, blank=True)
    last_trace_id = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    released_at = models.DateTimeField(null=True, blank=True)
    release_reason = models.CharField(max_length=32, blank=True, default="")

    objects = ReservationQuerySet.as_manager()

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(released_version__isnull=True)
                | Q(status="released", released_version__isnull=False),
                name="reservations_reservation_released_version_only_when_released",
            ),
        ]
        indexes = [
            # Per bucket, so an empty shard next to a huge backlog in other shards costs one
            # probe per bucket instead of a scan of everyone's backlog:
            # - the SLO gauge: WHERE status='held' AND bucket = b AND expires_at <= now()
            #   ORDER BY expires_at LIMIT 1  (reservations.eligibility);
            # - the sweep's claim, the same with next_attempt_at <= now() read from the row
            #   and LIMIT k (reservations.services.claim_expired). next_attempt_at is in no
            #   index on purpose: a claim then updates no indexed column (a HOT update).
            models.Index(
                fields=["bucket", "expires_at"],
                name="reservations_held_bucket_idx",
                condition=Q(status="held"),
            ),
            models.Index(
                fields=["offering", "expires_at"],
                name="reservations_offering_held_idx",
                condition=Q(status="held"),
            ),
        ]

    def __str__(self) -> str:
        return f"hold #{self.pk} v{self.version} {self.status}"


# Eligible for release, in the ORM: held and past ``expires_at`` by the database clock (the SQL
# form is ``reservations.eligibility.eligible_sql``; tests/unit/test_eligibility.py holds them
# together).
ELIGIBLE = Q(status=Reservation.Status.HELD, expires_at__lte=Now())


class OutboxEvent(models.Model):
    """A domain event written in the same transaction as the change it describes."""

    class Kind(models.TextChoices):
        HELD = "reservation.held"
        RENEWED = "reservation.renewed"
        CONFIRMED = "reservation.confirmed"
        CANCELLED = "reservation.cancelled"
        RELEASED = "reservation.released"

    kind = models.CharField(max_length=40, choices=Kind.choices)
    reservation = models.ForeignKey(
        Reservation, on_delete=models.CASCADE, related_name="outbox_events"
    )
    version = models.PositiveIntegerField()
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)
    published_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            # Every hold has at most one reservation.released event (docs/PIPELINE.md, invariant 3).
            models.UniqueConstraint(
                fields=["reservation"],
                condition=Q(kind="reservation.released"),
                name="reservations_outboxevent_one_release_per_hold",
            ),
        ]
        indexes = [
            # The relay: WHERE published_at IS NULL ORDER BY id LIMIT n
            models.Index(
                fields=["id"],
                name="reservations_outbox_unpub_idx",
                condition=Q(published_at__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} #{self.reservation_id} v{self.version}"
