"""Receipts (one per handled release message) and dead letters (what could not be handled)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class CleanupReceipt(models.Model):
    """The unique idempotency row of a release message: ``release:<id>:<version>``.

    Written in the same transaction as the hold's transition, so a redelivered message finds it
    and ends ``already_handled``.
    """

    idempotency_key = models.CharField(max_length=120, unique=True)
    reservation_id = models.BigIntegerField()
    version = models.PositiveIntegerField()
    outcome = models.CharField(max_length=32)
    attempt = models.PositiveIntegerField(default=1)
    worker = models.CharField(max_length=200, blank=True, default="")
    task_id = models.CharField(max_length=64, blank=True, default="")
    trace_id = models.CharField(max_length=64, blank=True, default="")
    queue_age_seconds = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["reservation_id"], name="cleanup_receipt_hold_idx"),
            models.Index(fields=["created_at"], name="cleanup_receipt_created_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.idempotency_key} → {self.outcome}"


class DeadLetter(models.Model):
    """A message or hold set aside with the reason, the error and the raw payload."""

    class Reason(models.TextChoices):
        MALFORMED = "malformed", "Malformed message"
        UNKNOWN_TASK = "unknown_task", "Unknown task name"
        REJECTED = "rejected", "Rejected before reaching the task (encoding/content type)"
        RETRIES_EXHAUSTED = "retries_exhausted", "Transient errors outlasted the retries"
        DELIVERIES_EXHAUSTED = "deliveries_exhausted", "Delivered too many times (poison)"
        CLAIMS_EXHAUSTED = "claims_exhausted", "Hold claimed too many times without release"
        TIME_LIMIT = "time_limit", "Hit the hard time limit"
        FAILED = "failed", "Unexpected error"
        # A sweep, relay, prune or health upkeep that raised: beat sends it again at its next
        # tick, whose success settles the letter (there is no message to requeue).
        PERIODIC_FAILED = "periodic_failed", "Periodic task failed (retried at its next tick)"
        # Read from a queue other than its task's route (never run: the pause stops only the
        # release queue, so a release read elsewhere would bypass it).
        MISROUTED = "misrouted", "Read from a queue its task is not routed to"
        # A release message without the project's signature (cleanup.broker.signing): never
        # run, never counted against the hold it names.
        UNSIGNED = "unsigned", "Release message not signed by the project"

    reason = models.CharField(max_length=32, choices=Reason.choices)
    error = models.TextField(blank=True, default="")
    task_name = models.CharField(max_length=200, blank=True, default="")
    task_id = models.CharField(max_length=64, blank=True, default="")
    idempotency_key = models.CharField(max_length=120, blank=True, default="")
    reservation_id = models.BigIntegerField(null=True, blank=True)
    version = models.PositiveIntegerField(null=True, blank=True)
    trace_id = models.CharField(max_length=64, blank=True, default="")
    delivery_count = models.PositiveIntegerField(default=0)
    payload = models.TextField(blank=True, default="")  # raw, truncated
    message = models.JSONField(null=True, blank=True)  # the parsed release message, if any
    created_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    # What resolved it (republished, rescheduled, discarded, released_later, succeeded_later,
    # summarised), who (an admin user's name, the operator of a command, or "cleanup" for the
    # automatic ones) and why (the text the operator gave; for the automatic ones, what happened).
    resolution = models.CharField(max_length=32, blank=True, default="")
    resolved_by = models.CharField(max_length=150, blank=True, default="")
    resolution_note = models.TextField(blank=True, default="")
    # A summary letter stands for this many older open letters of its reason and task that
    # were summarised when the open letters reached CLEANUP_DEAD_LETTER_OPEN_CAP (0: an
    # ordinary letter), created between these two times.
    summarised_count = models.PositiveIntegerField(default=0)
    summarised_first_at = models.DateTimeField(null=True, blank=True)
    summarised_last_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["reservation_id"], name="cleanup_dl_hold_idx"),
            models.Index(
                fields=["reason", "created_at"],
                name="cleanup_dl_open_idx",
                condition=Q(resolved_at__isnull=True),
            ),
            # The open-letter cap walks the open letters newest first.
            models.Index(
                fields=["-id"], name="cleanup_dl_open_id_idx", condition=Q(resolved_at__isnull=True)
            ),
        ]

    def __str__(self) -> str:
        if self.summarised_count:
            return f"dead letter #{self.pk} {self.reason} (summary of {self.summarised_count})"
        return f"dead letter #{self.pk} {self.reason}"


class DeliveryCount(models.Model):
    """Redeliveries per idempotency key (cleanup.release.delivery_cap): kept here, where a
    broker writer cannot write, and pruned a day after their last change.

    Written in autocommit before any work, so a delivery that kills its worker still counts.
    """

    idempotency_key = models.CharField(max_length=120, primary_key=True)
    count = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.idempotency_key}: {self.count}"


class CleanupSchedule(models.Model):
    """The one "Cleanup schedule": it drives the per-shard sweep entries of the beat schedule.

    Saving it (admin or ``cleanup.release.schedule.apply_schedule``) rewrites the managed
    ``PeriodicTask`` rows in one transaction. ``install_cleanup_schedule`` creates it only when
    none exists, so a restart never reverts an operator's edit (``--force`` resets it).
    """

    shards = models.PositiveSmallIntegerField(
        default=4, help_text="Number of shards N: one sweep entry per shard (1–1024)."
    )
    every_seconds = models.PositiveIntegerField(
        default=10, help_text="Each shard is swept every this many seconds."
    )
    enabled = models.BooleanField(
        default=True, help_text="When off, beat sends no sweep: expired holds stay held."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "cleanup schedule"
        verbose_name_plural = "cleanup schedule"
        constraints = [
            models.CheckConstraint(
                condition=Q(shards__gte=1) & Q(shards__lte=1024),
                name="cleanup_schedule_shards_range",
            ),
            models.CheckConstraint(
                condition=Q(every_seconds__gte=1), name="cleanup_schedule_every_positive"
            ),
        ]

    def __str__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"{self.shards} shard(s) every {self.every_seconds}s, {state}"


class SweepRecord(models.Model):
    """The last sweep of each shard (one row per shard number, overwritten by each sweep)."""

    shard = models.PositiveSmallIntegerField(primary_key=True)
    shards = models.PositiveSmallIntegerField()
    finished_at = models.DateTimeField()
    claimed = models.PositiveIntegerField(default=0)
    published = models.PositiveIntegerField(default=0)  # holds
    messages = models.PositiveIntegerField(default=0)  # release messages carrying them
    largest_message = models.PositiveIntegerField(default=0)  # most holds in one message
    sizing_reason = models.CharField(max_length=16, blank=True, default="")
    set_aside = models.PositiveIntegerField(default=0)
    backpressure = models.BooleanField(default=False)
    skipped_locked = models.BooleanField(default=False)
    duration_ms = models.FloatField(default=0)
    trace_id = models.CharField(max_length=64, blank=True, default="")

    def __str__(self) -> str:
        return f"shard {self.shard} of {self.shards} at {self.finished_at:%H:%M:%S}"


class QueueRoom(models.Model):
    """Room under the release queue's cap that a sweep took for the batch it claims and
    publishes after letting go of the publish lock (far from the cap: cleanup.release.admission
    decides, cleanup.release.sweep writes it). One row per shard lock, overwritten by each
    batch. A row counts only while the session that wrote it (``pid``) holds that shard lock: a
    sweep that died leaves a row nobody counts."""

    lock_key = models.BigIntegerField(primary_key=True)  # the shard lock's second key
    pid = models.IntegerField()  # the sweep's PostgreSQL backend
    holds = models.PositiveIntegerField(default=0)

    class Meta:
        db_table = "cleanup_roomclaim"  # its name before the model was renamed

    def __str__(self) -> str:
        return f"{self.holds} holds of room taken by backend {self.pid}"


class HealthSample(models.Model):
    """One periodic reading for the health page's chart (task ``cleanup.sample_health``)."""

    taken_at = models.DateTimeField(db_index=True)
    oldest_eligible_age_seconds = models.FloatField()
    eligible = models.PositiveIntegerField()
    queue_depth = models.PositiveIntegerField(null=True, blank=True)
    released_last_minute = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"sample {self.taken_at:%H:%M:%S}"


class BacklogReading(models.Model):
    """The fleet's last reading of the eligible backlog per shard (one row, pk 1): taken by one
    scrape per ``CLEANUP_ELIGIBLE_READING_SECONDS`` under a lease, exported by every scrape of
    every web process (cleanup.operations.console.backlog_reading)."""

    shards = models.PositiveIntegerField()
    count_cap = models.PositiveIntegerField()
    # [[oldest eligible age in seconds, eligible (up to the cap), capped], ...] by shard
    readings = models.JSONField()
    read_at = models.DateTimeField(null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"backlog reading of {self.shards} shards at {self.read_at}"


class RestoreLease(models.Model):
    """Which worker scans kombu's unacknowledged Redis messages for the fleet, and until when
    (one row, pk 1; cleanup.worker.redis_transport). Kept here, not in the broker, where anyone
    who can write to Redis could hold it; and a lease, not a lock, so that a holder stalled on
    Redis (a node cut off from the broker but not from the database) loses it when it ends."""

    holder = models.CharField(max_length=200)
    until = models.DateTimeField()

    def __str__(self) -> str:
        return f"restore lease of {self.holder} until {self.until:%H:%M:%S}"


class ReleasePause(models.Model):
    """The operator's "pause releases" switch (one row, pk 1): while paused, workers stop
    consuming the release queue (cleanup.worker.pause_step); sweeps, their backpressure and every
    gauge go on, so the backlog stays visible. Changes go through cleanup.release.pause, which
    the console audits."""

    paused = models.BooleanField(default=False)
    since = models.DateTimeField(null=True, blank=True)
    changed_by = models.CharField(max_length=150, blank=True)
    reason = models.CharField(max_length=500, blank=True)

    class Meta:
        verbose_name = "release pause"
        verbose_name_plural = "release pause"

    def __str__(self) -> str:
        if not self.paused:
            return "releases running"
        return f"releases paused since {self.since:%Y-%m-%d %H:%M:%S} UTC by {self.changed_by}"
