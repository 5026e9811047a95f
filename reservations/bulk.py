"""Set-wise release for the batched cleanup mode: the same conditional transition as
``services.release_if_expired``, applied to many holds in one transaction.

Each hold gets exactly the outcome it would get on its own (DESIGN steps 3–8). Locks are taken
in the design's order: the offerings involved first, ascending id; then the holds, ascending
id; seat give-backs are aggregated per offering.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.db import connection, transaction

from .services import _NOW, E, O, R, ReleaseOutcome, classify_no_release

_LOCK_OFFERINGS = f"""
SELECT o.id FROM {O} o
WHERE o.id IN (SELECT DISTINCT offering_id FROM {R} WHERE id = ANY(%(ids)s))
ORDER BY o.id
FOR UPDATE
"""

_RELEASE_MANY = f"""
WITH wanted AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(versions)s::int[]) AS w(id, version)
), locked AS (
    SELECT r.id FROM {R} r WHERE r.id = ANY(%(ids)s) ORDER BY r.id FOR UPDATE
), rel AS (
    UPDATE {R} r
    SET status = 'released', released_version = r.version, released_at = now(),
        release_reason = %(reason)s, updated_at = now()
    FROM wanted, locked
    -- "(status = 'held') IS TRUE": stay on the primary key (see services._RELEASE_SQL).
    WHERE r.id = wanted.id AND locked.id = r.id AND r.version = wanted.version
      AND (r.status = 'held') IS TRUE AND r.expires_at <= {_NOW}
    RETURNING r.id, r.offering_id, r.version, r.expires_at
), seat AS (
    UPDATE {O} o SET seats_available = o.seats_available + g.n
    FROM (SELECT offering_id, count(*) AS n FROM rel GROUP BY offering_id) g
    WHERE o.id = g.offering_id
    RETURNING o.id
), ev AS (
    INSERT INTO {E} (kind, reservation_id, version, payload, created_at)
    SELECT 'reservation.released', rel.id, rel.version,
           jsonb_build_object('offering_id', rel.offering_id, 'expires_at', rel.expires_at,
                              'reason', %(reason)s::text),
           now()
    FROM rel
    RETURNING reservation_id
)
SELECT id FROM rel
"""


def release_many_if_expired(
    items: Sequence[tuple[int, int]],
    *,
    reason: str = "expired",
    now: datetime | None = None,
) -> dict[int, ReleaseOutcome]:
    """Release each (reservation_id, expected_version) that is held at that version and has
    expired; return every hold's outcome. A hold listed twice is decided once (first version).
    """
    wanted: dict[int, int] = {}
    for reservation_id, version in items:
        wanted.setdefault(reservation_id, version)
    if not wanted:
        return {}
    ids = sorted(wanted)
    versions = [wanted[i] for i in ids]
    outcomes: dict[int, ReleaseOutcome] = {}
    with transaction.atomic(savepoint=False):
        with connection.cursor() as cur:
            cur.execute(_LOCK_OFFERINGS, {"ids": ids})
            cur.execute(
                _RELEASE_MANY,
                {"ids": ids, "versions": versions, "reason": reason, "now": now},
            )
            for (released_id,) in cur.fetchall():
                outcomes[released_id] = ReleaseOutcome.RELEASED
            rest = [i for i in ids if i not in outcomes]
            if rest:
                cur.execute(
                    f"SELECT id, status, version, released_version, expires_at <= {_NOW} "
                    f"FROM {R} WHERE id = ANY(%(ids)s)",
                    {"ids": rest, "now": now},
                )
                rows = {row[0]: row[1:] for row in cur.fetchall()}
                for reservation_id in rest:
                    outcomes[reservation_id] = classify_no_release(
                        rows.get(reservation_id), wanted[reservation_id]
                    )
    return outcomes
