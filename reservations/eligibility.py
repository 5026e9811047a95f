"""What "eligible for release" means: held, and past ``expires_at`` by the database clock.

Written by hand in two places only: here in SQL (``eligible_sql``) and in the ORM
(``reservations.models.ELIGIBLE``, behind ``Reservation.objects.eligible()``). The claim, the
reclaim of ``hold_seat``, the release statement, ``availability`` and the backlog statements
(reservations/sql.py: read by ``services.eligible_backlog`` for the web process's gauges, the
admin health page and the pool autoscaler), the burst drill and the bench all build on
``eligible_sql``; ``tests/unit/reservations/test_eligibility.py`` seeds a table and checks that they
agree. The partial indexes (``status = 'held'``) serve it but do not define it.
"""

from __future__ import annotations


def eligible_sql(
    alias: str = "", now: str = "statement_timestamp()", *, off_the_held_index: bool = False
) -> str:
    """The SQL condition on a reservation row (``alias.`` before each column when given),
    ``now`` the clock's expression (by default the statement's time, as the ORM's ``Now()``
    reads it on PostgreSQL). ``off_the_held_index`` writes the status test as
    ``(status = 'held') IS TRUE``, which the planner cannot match to the partial held-index: the
    release statement uses it to stay on the primary key (reservations/sql.py)."""
    column = f"{alias}." if alias else ""
    held = f"{column}status = 'held'"
    if off_the_held_index:
        held = f"({held}) IS TRUE"
    return f"{held} AND {column}expires_at <= {now}"
