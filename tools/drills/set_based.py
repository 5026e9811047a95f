"""The database's own ceiling for a drain: the product's release statement (receipts attached, as
a release task writes them) run once over a whole set of expired holds. The bench compares its
drains with it (``bench/database.py``) and the burst drill its drain, in the same database right
after the drain (``--set-based``)."""

from __future__ import annotations

import time
from typing import Any

from django.db import transaction

from cleanup import sql as cleanup_sql
from cleanup.release.messages import idempotency_key
from reservations import sql as reservation_sql
from reservations.db import rows
from tools.seed import seed_holds

RELEASE_WITH_RECEIPTS = reservation_sql.release_statement(cleanup_sql.RELEASED_RECEIPTS)


def release_params(holds: list[tuple[int, int]], worker: str) -> dict[str, Any]:
    """The release statement's parameters (with its receipts attached) for ``holds`` as
    (id, version) pairs: what is measured is the statement the workers run, not a copy."""
    ids = [rid for rid, _ in holds]
    versions = [version for _, version in holds]
    return {
        "ids": ids,
        "versions": versions,
        "reason": "expired",
        "now": None,
        "attempt": 1,
        "worker": worker,
        "task": "",
        "age": None,
        "pre_ms": 0.0,
        "r_ids": ids,
        "r_keys": [idempotency_key(rid, version) for rid, version in holds],
        "r_traces": [""] * len(holds),
        "r_versions": versions,
    }


def release_all(holds: list[tuple[int, int]], worker: str) -> tuple[int, float]:
    """Release ``holds`` in one statement and one transaction: (released, seconds)."""
    started = time.perf_counter()
    with transaction.atomic():
        released = len(rows(RELEASE_WITH_RECEIPTS, release_params(holds, worker)))
    return released, time.perf_counter() - started


def measure(holds: int, offerings: int) -> dict[str, Any]:
    """Seed ``holds`` expired holds over ``offerings`` (seats accounted) and release them all at
    once: the rate a drain of the same database is compared with."""
    ids = seed_holds(holds, offerings=offerings, expires_in=-60.0, name="set-based")
    pairs = [
        (int(rid), int(version))
        for rid, version in rows(
            "SELECT id, version FROM reservations_reservation WHERE id = ANY(%s)", [ids]
        )
    ]
    released, seconds = release_all(pairs, "drill-set-based")
    return {
        "holds": holds,
        "released": released,
        "seconds": round(seconds, 3),
        "rows_per_s": round(released / seconds, 1) if seconds else None,
    }
