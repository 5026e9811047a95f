"""What a schedule change would do, without doing it: ``install_cleanup_schedule --dry-run`` and
the admin's "Preview the change" on the Cleanup schedule.

The change runs for real inside a transaction that is then rolled back, so the preview is what
the same code would write (the entries added, removed and changed, and the sweeps per second
before and after), not a second implementation of it that could disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.db import transaction
from django_celery_beat.models import PeriodicTask

from cleanup.wire import SWEEP_TASK


@dataclass(frozen=True)
class Entry:
    task: str
    every_seconds: float | None
    enabled: bool
    queue: str | None
    kwargs: str


@dataclass(frozen=True)
class SchedulePreview:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    sweeps_per_second_before: float
    sweeps_per_second_after: float

    @property
    def rate_before(self) -> str:
        return f"{self.sweeps_per_second_before:g}"

    @property
    def rate_after(self) -> str:
        return f"{self.sweeps_per_second_after:g}"

    @property
    def nothing_changes(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def lines(self) -> list[str]:
        rate = f"sweeps per second: {self.rate_before} -> {self.rate_after}"
        if self.nothing_changes:
            return ["no entry would change", rate]
        out = []
        for verb, names in (
            ("add", self.added),
            ("remove", self.removed),
            ("change", self.changed),
        ):
            out.append(f"would {verb} {len(names)} entr{'y' if len(names) == 1 else 'ies'}")
            out += [f"  {name}" for name in names]
        return [*out, rate]


def snapshot() -> dict[str, Entry]:
    entries = {}
    for task in PeriodicTask.objects.select_related("interval").order_by("name"):
        every = (
            task.interval.schedule.run_every.total_seconds() if task.interval is not None else None
        )
        entries[task.name] = Entry(task.task, every, task.enabled, task.queue, task.kwargs)
    return entries


def sweeps_per_second(entries: dict[str, Entry]) -> float:
    """Sweep messages beat sends per second: each enabled sweep entry once per interval."""
    return round(
        sum(
            1 / e.every_seconds
            for e in entries.values()
            if e.task == SWEEP_TASK and e.enabled and e.every_seconds
        ),
        6,
    )


class _RollBack(Exception):
    """Raised inside the preview's transaction so that nothing of the change is kept."""


def preview(change: Callable[[], object]) -> SchedulePreview:
    before = snapshot()
    after: dict[str, Entry] = {}
    try:
        with transaction.atomic():
            change()
            after = snapshot()
            raise _RollBack
    except _RollBack:
        pass
    return SchedulePreview(
        added=tuple(sorted(set(after) - set(before))),
        removed=tuple(sorted(set(before) - set(after))),
        changed=tuple(sorted(n for n in set(before) & set(after) if before[n] != after[n])),
        sweeps_per_second_before=sweeps_per_second(before),
        sweeps_per_second_after=sweeps_per_second(after),
    )
