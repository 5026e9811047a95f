"""The health page's chart points: one sample a minute (``cleanup.sample_health``, on the
maintenance queue), pruned after a day. Written by a worker, read by the health page."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

from cleanup.broker.readers import queue_stats
from cleanup.conf import cleanup_settings
from cleanup.models import CleanupReceipt, HealthSample
from cleanup.release.claim import shard_buckets
from cleanup.release.schedule import current_schedule, installed_shards
from reservations.services import eligible_backlog

SAMPLE_RETENTION = timedelta(days=1)


def read_shards(shards: int, cap: int) -> list[tuple[float, int, bool]]:
    """(oldest eligible age, eligible count up to cap, capped) per shard, as /metrics reads
    them: one bounded statement each."""

    readings = []
    for k in range(shards):
        backlog = eligible_backlog(shard_buckets(k, shards), cap)
        readings.append((backlog.oldest_age_seconds, backlog.eligible, backlog.capped))
    return readings


def take_sample() -> HealthSample:
    """One chart point: worst oldest-eligible age and total eligible over the shards, release
    queue depth (None when the broker does not answer), releases in the last minute."""

    schedule = current_schedule()
    shards = schedule.shards if schedule else (installed_shards() or 1)
    cap = cleanup_settings().eligible_count_cap
    readings = read_shards(shards, cap)
    depth: int | None
    try:
        stats = queue_stats(cleanup_settings().release_queue)
        depth = stats.depth if stats.readable else None
    except Exception:  # noqa: BLE001 - a gap in the chart, not a failed sample
        depth = None
    released = CleanupReceipt.objects.filter(
        outcome="released", created_at__gte=timezone.now() - timedelta(minutes=1)
    ).count()
    return HealthSample.objects.create(
        taken_at=timezone.now(),
        oldest_eligible_age_seconds=max((r[0] for r in readings), default=0.0),
        eligible=sum(r[1] for r in readings),
        queue_depth=depth,
        released_last_minute=released,
    )


def prune_samples(now: datetime | None = None) -> int:
    cutoff = (now or timezone.now()) - SAMPLE_RETENTION
    deleted, _ = HealthSample.objects.filter(taken_at__lt=cutoff).delete()
    return int(deleted)
