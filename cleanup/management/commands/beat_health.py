"""``python manage.py beat_health``: exit 0 when some beat holds the leader lock (so sweeps are
being scheduled), 1 otherwise. For docker-compose and Kubernetes probes of the beat service:

    healthcheck: {test: ["CMD", "python", "manage.py", "beat_health"]}

The lock is the PostgreSQL session advisory lock
``cleanup.release.locks.beat_lock(CLEANUP_BEAT_LOCK_ID)`` that ``cleanup.release.schedule.
LeaderDatabaseScheduler`` takes before it sends anything; ``pg_locks`` shows it as an advisory
lock with classid/objid = the two keys (objsubid 2: the two-key form). A standby beat is healthy
while a leader exists; when no beat holds the lock, nothing is being scheduled and every beat
reports unhealthy.
"""

from __future__ import annotations

from typing import Any

from cleanup import sql
from cleanup.conf import cleanup_settings
from cleanup.release import locks
from reservations.commands import ProjectCommand
from reservations.db import rows


def leaders() -> int:
    """Sessions of this database holding the beat lock (1 when a beat leads)."""
    return len(
        rows(sql.ADVISORY_LOCK_HOLDERS, list(locks.beat_lock(cleanup_settings().beat_lock_id)))
    )


class Command(ProjectCommand):
    help = "Exit 0 when a beat holds the leader lock (sweeps are being scheduled), else 1."

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            count = leaders()
        except Exception as exc:  # noqa: BLE001 - no database is "unhealthy"
            self.stderr.write(f"unhealthy: cannot read pg_locks: {exc!r}")
            raise SystemExit(1) from None
        if count:
            self.stdout.write("ok: a beat holds the leader lock")
            return
        self.stderr.write("unhealthy: no beat holds the leader lock; nothing is scheduled")
        raise SystemExit(1)
