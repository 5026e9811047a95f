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


class ApiClient(models.Model):
    """A caller of the JSON API with its own tokens, scopes and rate limit (docs/API.md).

    Holds belong to the client that created them; another client's request for one is a 404.
    """

    name = models.CharField(max_length=100, unique=True)
    can_read = models.BooleanField(default=True, help_text="GET requests")
    can_write = models.BooleanField(
        default=False, help_text="POST requests: hold, renew, confirm, cancel"
    )
    all_offerings = models.BooleanField(
        default=False, help_text="every offering; otherwise only the offerings chosen below"
    )
    offerings = models.ManyToManyField(Offering, blank=True, related_name="api_clients")
    requests_per_minute = models.PositiveIntegerField(
        default=600, help_text="requests answered per minute; beyond it, 429 with Retry-After"
    )
    is_active = models.BooleanField(default=True, help_text="off: every token is refused")
    created_at = models.DateTimeField(auto_now_add=True)
    # Neither read nor written: the rate limit counts in Redis (reservations.ratelimit). Kept
    # while an older release may still run beside this one, which selects them.
    window_started_at = models.DateTimeField(null=True, blank=True, editable=False)
    window_count = models.PositiveIntegerField(default=0, editable=False)

    class Meta:
        verbose_name = "API client"
        constraints = [
            models.CheckConstraint(
                condition=Q(requests_per_minute__gte=1),
                name="reservations_apiclient_rate_limit_positive",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class ApiToken(models.Model):
    """A bearer token of a client. Only its SHA-256 digest is stored: the token is shown once,
    when it is issued (tokens are 256 random bits, so a fast hash is enough)."""

    client = models.ForeignKey(ApiClient, on_delete=models.CASCADE, related_name="tokens")
    # The token's first characters, to tell tokens apart in the admin and in logs.
    prefix = models.CharField(max_length=12)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.client})"


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
    # The API client that created the hold; null for holds made with the local development
    # token, the admin or a seeding command. Only that client can see or change it by API.
    # No index of its own: the two listing indexes below lead with it.
    client = models.ForeignKey(
        ApiClient,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="holds",
        db_index=False,
    )
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
    # The W3C traceparent of the request (API or admin) that took or last renewed the hold,
    # when tracing was on: the release's span links to it. A database default, so a process
    # one version back, which does not write the column, still inserts holds.
    request_traceparent = models.CharField(max_length=55, blank=True, db_default="")
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
            #   and LIMIT k (cleanup.release.claim.claim_expired). next_attempt_at is in no
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
            # The API's listings, in id order after a cursor:
            # WHERE client_id = c AND holder = h AND id > cursor ORDER BY id LIMIT n, and
            # WHERE client_id = c AND offering_id = o AND id > cursor ORDER BY id LIMIT n.
            models.Index(fields=["client", "holder", "id"], name="reservations_client_holder_idx"),
            models.Index(fields=["client", "offering", "id"], name="reservations_client_offer_idx"),
        ]

    def __str__(self) -> str:
        return f"hold #{self.pk} v{self.version} {self.status}"


# Eligible for release, in the ORM: held and past ``expires_at`` by the database clock (the SQL
# form is ``reservations.eligibility.eligible_sql``; tests/unit/reservations/test_eligibility.py
# holds them together).
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


class IdempotencyKey(models.Model):
    """The response a client's POST produced under an ``Idempotency-Key``, kept until
    ``expires_at`` so that a retry gets the same answer instead of a second effect.

    The row is inserted in the same transaction as the change it records: a concurrent
    request under the same key waits on the unique index until that transaction ends, then
    replays what it stored (reservations.idempotency).
    """

    client = models.ForeignKey(
        ApiClient, on_delete=models.CASCADE, null=True, blank=True, related_name="+"
    )
    key = models.CharField(max_length=255)
    # SHA-256 of the method, the path and the canonical JSON body.
    request_hash = models.CharField(max_length=64)
    response_status = models.PositiveSmallIntegerField()
    response_body = models.JSONField()
    response_headers = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [
            # One row per key and client; the local development token (no client) is one scope.
            models.UniqueConstraint(
                fields=["client", "key"],
                nulls_distinct=False,
                name="reservations_idempotencykey_one_per_client",
            ),
        ]
        indexes = [
            # The prune: WHERE expires_at <= now() ORDER BY expires_at LIMIT n
            models.Index(fields=["expires_at"], name="reservations_idem_expiry_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.response_status})"
