"""The sweep's claim: take a shard's due holds, oldest expiry first, and lease them.

A shard is the buckets ``bucket % shards == shard``; a claim leases each hold it takes
(``next_attempt_at = now + lease``) so a lost message or a dead worker only delays it until a
later sweep claims it again. A hold claimed more than ``max_claims`` times is set aside
(``next_attempt_at = infinity``) for the sweep to dead-letter; ``reschedule_claim`` puts it
back. The statements are ``cleanup.sql.CLAIM_EXPIRED`` and ``OLDEST_DUE_BY_SHARD``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.db.models.functions import Now

from cleanup import sql
from reservations.models import BUCKETS, Reservation


@dataclass(frozen=True)
class ClaimedReservation:
    reservation_id: int
    version: int
    expires_at: datetime
    bucket: int
    claim_count: int
    set_aside: bool  # claimed too many times: taken out of the sweep, to be dead-lettered
    offering_id: int


def claim_expired(
    shard: int,
    shards: int,
    *,
    batch_size: int,
    lease_seconds: int,
    max_claims: int,
    trace_id: str = "",
    now: datetime | None = None,
) -> list[ClaimedReservation]:
    """Claim up to ``batch_size`` eligible, due holds of a shard, oldest expiry first.

    A claim leases the hold: ``next_attempt_at = now() + lease``, so a lost message or a dead
    worker only delays it until a later sweep claims it again. A hold claimed more than
    ``max_claims`` times is set aside (``next_attempt_at = infinity``) and returned with
    ``set_aside=True`` for the caller to dead-letter; ``reschedule_claim`` puts it back.
    Must run inside the caller's transaction so the leases commit with the publish decision.
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is outside 0..{shards - 1}")
    buckets = shard_buckets(shard, shards)
    # Twice the even share per bucket, so a batch fills even when buckets are uneven.
    per_bucket = max(2, -(-2 * batch_size // len(buckets)))
    with connection.cursor() as cur:
        cur.execute(
            sql.CLAIM_EXPIRED,
            {
                "buckets": buckets,
                "per_bucket": per_bucket,
                "batch": batch_size,
                "lease": lease_seconds,
                "max_claims": max_claims,
                "trace": trace_id,
                "now": now,
            },
        )
        rows = cur.fetchall()
    claimed = [
        ClaimedReservation(
            reservation_id=rid,
            version=version,
            expires_at=expires_at,
            bucket=bucket,
            claim_count=count,
            set_aside=count > max_claims,
            offering_id=offering_id,
        )
        for rid, version, expires_at, bucket, count, offering_id in rows
    ]
    claimed.sort(key=lambda c: (c.expires_at, c.reservation_id))
    return claimed


def oldest_due_by_shard(shards: int, *, now: datetime | None = None) -> dict[int, float]:
    """The age in seconds of each shard's oldest due hold (eligible, not leased), for the
    shards that have one: the hold its next claim would take first. One probe per bucket on
    reservations_held_bucket_idx (reservations/sql.py), a few milliseconds whatever the
    backlog (docs/PERFORMANCE.md, "Turns")."""
    if shards < 1:
        raise ValueError(f"{shards} shards")
    with connection.cursor() as cur:
        cur.execute(sql.OLDEST_DUE_BY_SHARD, {"shards": shards, "buckets": BUCKETS, "now": now})
        return {int(shard): float(age) for shard, age in cur.fetchall()}


def shard_buckets(shard: int, shards: int) -> list[int]:
    """The buckets of a shard: ``bucket % shards == shard``. Every bucket is in exactly one
    shard for any ``shards``, so changing the shard count never strands a hold."""
    if shards < 1 or not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards} is not a valid shard")
    return [b for b in range(BUCKETS) if b % shards == shard]


def reschedule_claim(reservation_ids: Iterable[int]) -> int:
    """Make set-aside holds due again now, with a fresh claim budget (dead-letter requeue)."""
    ids = list(reservation_ids)
    if not ids:
        return 0
    return Reservation.objects.filter(pk__in=ids, status=Reservation.Status.HELD).update(
        next_attempt_at=Now(), claim_count=0
    )
