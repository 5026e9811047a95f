"""The beat schedule as the tests read it: the sweep entries in django-celery-beat's tables,
and ``install_cleanup_schedule`` run in this process."""

from __future__ import annotations

import json
from io import StringIO

from django.core.management import call_command
from django_celery_beat.models import PeriodicTask

from cleanup.release.schedule import SWEEP_PREFIX


def sweep_entries() -> list[PeriodicTask]:
    """The sweep entries, by name."""
    return list(PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX).order_by("name"))


def install_command(*args: str) -> str:
    """``manage.py install_cleanup_schedule args``: its output."""
    out = StringIO()
    call_command("install_cleanup_schedule", *args, stdout=out)
    return out.getvalue()


def sweeps_as_beat_sees_them() -> list[tuple[str, int, bool, dict[str, int]]]:
    """(name, interval, enabled, kwargs) of each sweep entry."""
    return [
        (e.name, e.interval.every if e.interval else 0, e.enabled, json.loads(e.kwargs))
        for e in sweep_entries()
    ]
