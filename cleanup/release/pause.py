"""The "pause releases" switch: read it (workers, the health page, /metrics) and set it (the
console). One row, locked while it changes; ``since`` is PostgreSQL's clock, like every other
time the pipeline compares."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models.functions import Now

from cleanup.models import ReleasePause

ROW = 1


@dataclass(frozen=True)
class PauseState:
    paused: bool
    since: datetime | None
    changed_by: str
    reason: str


def state() -> PauseState:
    row = ReleasePause.objects.filter(pk=ROW).first()
    if row is None:
        return PauseState(False, None, "", "")
    return PauseState(row.paused, row.since, row.changed_by, row.reason)


def set_paused(paused: bool, changed_by: str, reason: str = "") -> ReleasePause | None:
    """Pause or resume; the row when it changed, None when it already was so (a second click
    from another tab is not a second change, and is not audited twice)."""
    with transaction.atomic():
        row, _ = ReleasePause.objects.select_for_update().get_or_create(pk=ROW)
        if row.paused == paused:
            return None
        row.paused = paused
        row.since = Now() if paused else None  # type: ignore[assignment]
        row.changed_by = changed_by[:150]
        row.reason = reason.strip()[:500]
        row.save()
        row.refresh_from_db()
        return row
