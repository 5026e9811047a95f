"""The "Cleanup schedule" admin object drives a real beat (cleanup.schedule's
LeaderDatabaseScheduler) sending to real workers: a change saved through the admin change form
is followed without restarting beat (within its max loop interval), a disabled schedule stops
sweeps, and a restart's ``install_cleanup_schedule`` keeps the operator's edit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from cleanup.models import CleanupSchedule

from .fleet import (
    Beat,
    beats,
    claim_counts,
    create_eligible_holds,
    invariant_violations,
    outcome_counts,
    released_count,
    wait_until,
)

pytestmark = [pytest.mark.workers]


@pytest.fixture
def beat_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("schedule-beat")


def _save_in_admin(client: Client, shards: int, every: int, enabled: bool) -> None:
    """What an operator does: the Cleanup schedule change form, saved."""
    schedule = CleanupSchedule.objects.get()
    response = client.post(
        reverse("admin:cleanup_cleanupschedule_change", args=[schedule.pk]),
        {"shards": str(shards), "every_seconds": str(every), "enabled": "on" if enabled else ""},
    )
    assert response.status_code == 302, response.content.decode()[:2000]


def _sends(beat: Beat, shards: int | None = None) -> int:
    if shards is None:
        return beat.sends()
    return len([line for line in beat.lines("Sending due task") if f" of {shards} " in line])


def test_a_real_beat_follows_schedule_edits_saved_in_the_admin(workers, clean, beat_logs):
    # given: the schedule as `make run` installs it, then an operator at the admin
    call_command("install_cleanup_schedule", "--shards", "4", "--every", "1")
    operator = Client()
    operator.force_login(User.objects.create_superuser("op", "op@example.com", "pw"))
    with beats(beat_logs, 1) as (beat,):
        wait_until(beat.is_leader, timeout=60, what="beat lease acquired")
        wait_until(lambda: _sends(beat, 4) >= 4, timeout=30, what="first sends of 4 shards")
        # when: 2 shards every 1 s
        _save_in_admin(operator, shards=2, every=1, enabled=True)
        time.sleep(3)  # beat's max loop interval is 1 s in tests
        before_4, before_2 = _sends(beat, 4), _sends(beat, 2)
        time.sleep(6)
        # then: only the two new entries are sent, about once a second each
        assert _sends(beat, 4) == before_4
        fast = _sends(beat, 2) - before_2
        assert 2 * 4 <= fast <= 2 * 8, fast
        # when: every 3 s
        _save_in_admin(operator, shards=2, every=3, enabled=True)
        time.sleep(4)
        before = _sends(beat, 2)
        time.sleep(6)
        slow = _sends(beat, 2) - before
        assert slow <= 2 * 3, slow
        assert slow < fast
        # when: disabled
        _save_in_admin(operator, shards=2, every=3, enabled=False)
        time.sleep(4)
        stopped_at = beat.sends()
        held = create_eligible_holds(60, offerings=2)
        # and the platform restarts its one-off step (what `make run` and compose run)
        call_command("install_cleanup_schedule", "--shards", "4", "--every", "1")
        time.sleep(6)
        # then: nothing is sent, no hold is claimed, the edit stood
        assert beat.sends() == stopped_at
        assert set(claim_counts(held).values()) == {0}
        assert released_count(held) == 0
        schedule = CleanupSchedule.objects.get()
        assert (schedule.shards, schedule.every_seconds, schedule.enabled) == (2, 3, False)
        # when: enabled again
        _save_in_admin(operator, shards=2, every=1, enabled=True)
        wait_until(lambda: released_count(held) == len(held), timeout=60, what="re-enabled")
    assert invariant_violations(expected_released=held) == []
    assert outcome_counts() == {"released": len(held)}
    print(f"\nadmin edits: 2 shards every 1 s → {fast} sends in 6 s, every 3 s → {slow}, off → 0")
