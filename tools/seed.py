"""Many holds at once, for tests, benchmarks and drills (never the API): offerings whose seats
are all taken by held reservations expiring when the caller says, in bulk SQL through the same
INSERT ``hold_seat`` uses (``services.insert_holds``)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from django.db import connection

from reservations import sql
from reservations.services import insert_holds


def seed_holds(
    count: int,
    *,
    offerings: int = 4,
    expires_in: Callable[[int], float] | float = -60.0,
    extra_capacity: int = 0,
    name: str = "seed",
    interleave: bool = False,
    analyze: bool = True,
    anchor: datetime | None = None,
) -> list[int]:
    """``count`` held reservations over ``offerings`` offerings — in consecutive blocks, or
    with ``interleave`` hold ``p`` on offering ``p % offerings`` — seats accounted: each
    offering's capacity is its holds plus ``extra_capacity``, all free but the extra.
    ``expires_in`` is seconds from now, or a function of the hold's position ``p``
    (0 … count-1); negative means already expired. With ``anchor``, seconds from that instant
    instead of from each statement's time, so a long seeding does not spread the expiries.
    Returns the ids, ascending."""
    at = expires_in if callable(expires_in) else (lambda _p: float(expires_in))  # type: ignore[misc]
    ids: list[int] = []
    with connection.cursor() as cur:
        per = -(-count // offerings)
        for i in range(offerings):
            positions = (
                range(i, count, offerings)
                if interleave
                else range(i * per, min(count, (i + 1) * per))
            )
            if not positions:
                break
            cur.execute(
                sql.INSERT_OFFERING,
                [f"{name}-{i}", len(positions) + extra_capacity, extra_capacity],
            )
            offering_id = cur.fetchone()[0]
            rows = insert_holds(
                cur,
                offering_id,
                [f"{name}-{p}" for p in positions],
                [at(p) for p in positions],
                now=anchor,
            )
            ids.extend(row[0] for row in rows)
        if analyze:
            for statement in sql.ANALYZE_HOLDS_AND_OFFERINGS:
                cur.execute(statement)
    return sorted(ids)
