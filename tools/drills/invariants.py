"""The pipeline's invariants (docs/PIPELINE.md), checked from SQL (used by the burst drill and
the integration tests).

An empty list from ``invariant_violations`` means every invariant holds.
"""

from __future__ import annotations

from datetime import datetime

from reservations.db import rows, scalar
from reservations.services import seat_conservation_violations
from tools.drills import sql


def invariant_violations(
    expected_released: list[int] | None = None,
    expected_not_released: list[int] | None = None,
    *,
    released_since: datetime | None = None,
) -> list[str]:
    """Seats conserved; at most one released event per hold and one for every released hold
    (with ``released_since``, every hold released since then: the retention has pruned the
    events of earlier ones, as in the soak drill);
    no hold released by a message carrying a version it no longer had (a renewed, confirmed
    or cancelled hold is never released by an older message); the ``expected_released`` holds
    released; none of ``expected_not_released`` released."""
    problems: list[str] = []
    # (offending rows, what the report says before the first ten of them)
    listed = [
        (
            [violation[:1] for violation in seat_conservation_violations()],  # (id,)
            "seats not conserved for offerings ",
        ),
        (rows(sql.HOLDS_RELEASED_TWICE_BY_EVENTS), "holds with more than one released event: "),
        (
            rows(sql.HOLDS_RELEASED_TWICE_BY_RECEIPTS),
            "holds with more than one 'released' receipt: ",
        ),
    ]
    problems += [f"{says}{found[:10]}" for found, says in listed if found]
    if released_since is None:
        no_event = scalar(sql.RELEASED_HOLDS_WITHOUT_EVENT)
    else:
        no_event = scalar(sql.RELEASED_SINCE_WITHOUT_EVENT, [released_since])
    if no_event:
        problems.append(f"{no_event} released holds without a released event")
    # A release message carries the version it saw; its 'released' receipt records that
    # version. A hold released by a message whose version it no longer had (renewed,
    # confirmed or cancelled in between) shows as a receipt version other than the version
    # the hold was released at. (Holds released without a message — reclaimed by hold_seat,
    # released by an operator — have no 'released' receipt and are not checked here.)
    wrong_version = rows(sql.RELEASED_AT_ANOTHER_VERSION)
    if wrong_version:
        problems.append(
            f"{len(wrong_version)} holds released at a version they no longer had "
            f"(id, message version, released version): {wrong_version[:10]}"
        )
    if expected_released is not None:
        not_released = scalar(sql.HOLDS_NOT_RELEASED, [expected_released])
        if not_released:
            problems.append(f"{not_released} of {len(expected_released)} holds not released")
    if expected_not_released:
        released = scalar(sql.HOLDS_RELEASED, [expected_not_released])
        if released:
            problems.append(
                f"{released} of {len(expected_not_released)} renewed/confirmed holds released"
            )
    return problems
