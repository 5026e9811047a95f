"""``manage.py install_cleanup_schedule``: it creates the schedule only when none exists and keeps
an operator's edits on the next start (``--force`` resets them), and a deleted sweep entry comes
back."""

from __future__ import annotations

import pytest
from django_celery_beat.models import IntervalSchedule, PeriodicTask, PeriodicTasks

from cleanup.models import CleanupSchedule
from cleanup.release.schedule import (
    RELAY_NAME,
    save_schedule,
    sweep_entry_name,
)
from tests.support.schedule import install_command, sweep_entries, sweeps_as_beat_sees_them

pytestmark = [pytest.mark.django_db]


def test_the_command_creates_the_schedule_only_when_none_exists():
    # when: first start
    out = install_command("--shards", "4", "--every", "10")
    # then
    assert "created: 4 shard(s) every 10s, enabled" in out
    schedule = CleanupSchedule.objects.get()
    assert (schedule.shards, schedule.every_seconds, schedule.enabled) == (4, 10, True)
    assert len(sweep_entries()) == 4
    # given: an operator's edit (what the admin's save does)
    save_schedule(shards=2, every=3, enabled=False)
    edited = sweeps_as_beat_sees_them()
    marker = PeriodicTasks.last_change()
    # when: a restart runs the same command line again
    out = install_command("--shards", "4", "--every", "10")
    # then: the edit stands, and beat is not even told that something changed
    assert "kept (exists; --force resets it): 2 shard(s) every 3s, DISABLED" in out
    assert sweeps_as_beat_sees_them() == edited
    assert [(e[1], e[2]) for e in edited] == [(3, False), (3, False)]
    assert PeriodicTasks.last_change() == marker
    assert CleanupSchedule.objects.count() == 1


def test_the_command_keeps_an_edited_relay_entry_and_force_resets_everything():
    install_command("--shards", "4", "--every", "10")
    relay = PeriodicTask.objects.get(name=RELAY_NAME)
    relay.interval, _ = IntervalSchedule.objects.get_or_create(
        every=30, period=IntervalSchedule.SECONDS
    )
    relay.save()
    save_schedule(shards=3, every=20, enabled=False)
    # when: restarted without --force
    install_command("--shards", "4", "--every", "10")
    # then
    assert PeriodicTask.objects.get(name=RELAY_NAME).interval.every == 30
    # when: --force
    out = install_command("--shards", "4", "--every", "10", "--force")
    # then
    assert "reset to 4 shard(s) every 10s, enabled" in out
    assert PeriodicTask.objects.get(name=RELAY_NAME).interval.every == 5
    assert [(e[1], e[2]) for e in sweeps_as_beat_sees_them()] == [(10, True)] * 4


def test_a_deleted_sweep_entry_comes_back_on_the_next_start():
    install_command("--shards", "2", "--every", "5")
    PeriodicTask.objects.get(name=sweep_entry_name(1, 2)).delete()
    # when
    install_command("--shards", "2", "--every", "5")
    # then
    assert [e.name for e in sweep_entries()] == [sweep_entry_name(0, 2), sweep_entry_name(1, 2)]
