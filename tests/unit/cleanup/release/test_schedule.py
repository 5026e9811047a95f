"""The beat schedule (cleanup.release.schedule): per-shard sweep entries installed once and
rewritten when the Cleanup schedule is saved, beat's run records never overwriting an edit, a
change noticed mid-heap never sending an entry twice, and a leader whose lease ended sending
nothing. (The command: cleanup/management/commands/test_install_cleanup_schedule.py.)"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django_celery_beat.models import PeriodicTask, PeriodicTasks

from cleanup.release.schedule import (
    PRUNE_NAME,
    RELAY_NAME,
    SAMPLE_NAME,
    SWEEP_PREFIX,
    LeaderDatabaseScheduler,
    install_schedule,
    installed_shards,
    save_schedule,
    sweep_entry_name,
)
from config.celery_app import app as celery_app
from tests.support.schedule import install_command, sweep_entries, sweeps_as_beat_sees_them

pytestmark = [pytest.mark.django_db]


def test_install_schedule_creates_one_sweep_entry_per_shard():
    # when
    report = install_schedule(shards=4, every=2)
    # then
    entries = sweep_entries()
    # 4 sweeps + relay + prune + sample
    assert report == {"shards": 4, "changed": 7, "removed": 0}
    assert [e.name for e in entries] == [sweep_entry_name(k, 4) for k in range(4)]
    for k, entry in enumerate(entries):
        assert json.loads(entry.kwargs) == {"shard": k, "shards": 4}
        assert entry.task == "cleanup.sweep_shard"
        assert entry.queue == "sweep"
        assert entry.expire_seconds == 2
        assert entry.interval is not None and entry.interval.every == 2
        assert entry.enabled
    assert PeriodicTask.objects.filter(name__in=[RELAY_NAME, PRUNE_NAME, SAMPLE_NAME]).count() == 3
    assert installed_shards() == 4


def test_install_schedule_is_idempotent_and_does_not_touch_beats_change_marker():
    install_schedule(shards=4, every=1)
    marker = PeriodicTasks.last_change()
    assert marker is not None
    # when
    report = install_schedule(shards=4, every=1)
    # then
    assert report == {"shards": 4, "changed": 0, "removed": 0}
    assert PeriodicTasks.last_change() == marker


def test_saving_the_schedule_disables_and_reenables_every_sweep_entry_and_tells_beat():
    save_schedule(shards=3, every=2, enabled=True)
    before = PeriodicTasks.last_change()
    # when
    save_schedule(shards=3, every=2, enabled=False)
    # then
    assert {e.enabled for e in sweep_entries()} == {False}
    assert PeriodicTasks.last_change() > before
    # when
    save_schedule(shards=3, every=2, enabled=True)
    assert {e.enabled for e in sweep_entries()} == {True}


def test_an_invalid_schedule_changes_nothing():
    save_schedule(shards=2, every=4)
    for shards, every in ((0, 4), (1025, 4), (2, 0)):
        with pytest.raises(ValueError):
            save_schedule(shards=shards, every=every)
    assert [(e[1], e[3]["shards"]) for e in sweeps_as_beat_sees_them()] == [(4, 2), (4, 2)]


@pytest.mark.parametrize(("first", "second"), [(4, 3), (3, 5), (5, 4)])
def test_a_new_shard_count_rewrites_the_sweep_entries(first, second):
    install_schedule(shards=first, every=1)
    before = PeriodicTasks.last_change()
    # when
    report = install_schedule(shards=second, every=1)
    # then
    entries = sweep_entries()
    assert [json.loads(e.kwargs) for e in entries] == [
        {"shard": k, "shards": second} for k in range(second)
    ]
    assert {e.name for e in entries} == {sweep_entry_name(k, second) for k in range(second)}
    assert report["removed"] == first
    assert report["changed"] == second
    assert installed_shards() == second
    assert PeriodicTasks.last_change() > before  # beat reloads without a restart


def test_a_new_interval_updates_interval_and_expiry():
    install_schedule(shards=2, every=1)
    # when
    report = install_schedule(shards=2, every=7)
    # then
    assert report["changed"] == 2
    for entry in sweep_entries():
        assert entry.interval is not None and entry.interval.every == 7
        assert entry.expire_seconds == 7


def test_beats_run_record_never_overwrites_an_edit_committed_meanwhile(monkeypatch):
    """django-celery-beat's ModelEntry.save reads the row and saves it whole; an edit that
    commits between the two was lost (seen with a real beat). Ours writes two columns only."""
    from django_celery_beat.schedulers import ModelEntry

    from cleanup.release.schedule import RunRecordingEntry

    manager = PeriodicTask._default_manager
    real_get = manager.get

    def get_then_operator_edits(*args, **kwargs):  # the edit lands right after beat's read
        row = real_get(*args, **kwargs)
        save_schedule(shards=2, every=3, enabled=False)
        return row

    for entry_class, survives in ((ModelEntry, False), (RunRecordingEntry, True)):
        save_schedule(shards=2, every=1)
        model = PeriodicTask.objects.get(name=sweep_entry_name(0, 2))
        monkeypatch.setattr(manager, "get", get_then_operator_edits)
        sent = next(entry_class(model))  # beat sent the entry: last_run_at, count + 1
        if entry_class is RunRecordingEntry:
            save_schedule(shards=2, every=3, enabled=False)  # no read to interleave with
        sent.save()
        monkeypatch.setattr(manager, "get", real_get)
        row = PeriodicTask.objects.get(pk=model.pk)
        assert row.last_run_at is not None
        edited = (row.interval.every, row.enabled) == (3, False)
        assert edited is survives, entry_class.__name__


def test_entries_installed_before_the_schedule_object_existed_are_adopted_not_reset():
    # given: sweep entries as an older release installed them, then edited in beat's admin
    from cleanup.release.schedule import _ensure

    for k in range(3):
        _ensure(
            sweep_entry_name(k, 3),
            "cleanup.sweep_shard",
            20,
            {"shard": k, "shards": 3},
            "sweep",
            enabled=False,
        )
    # when: the new release starts with its usual command line
    out = install_command("--shards", "4", "--every", "10")
    # then
    assert "created: 3 shard(s) every 20s, DISABLED" in out
    assert [(e[1], e[2]) for e in sweeps_as_beat_sees_them()] == [(20, False)] * 3


def test_beat_still_builds_entries_from_scheduler_entry_and_records_runs_through_save():
    """cleanup.release.schedule.RunRecordingEntry relies on django-celery-beat building entries
    with ``self.Entry`` and recording a run by calling the entry's ``save()`` from ``sync``; an
    upgrade that changes either would silently bring back the whole-row write."""
    import inspect

    from django_celery_beat.schedulers import DatabaseScheduler

    from cleanup.release.schedule import LeaderDatabaseScheduler, RunRecordingEntry

    assert "self.Entry(" in inspect.getsource(DatabaseScheduler.all_as_schedule)
    assert ".save()" in inspect.getsource(DatabaseScheduler.sync)
    assert LeaderDatabaseScheduler.Entry is RunRecordingEntry


@pytest.mark.django_db(transaction=True)
def test_a_change_noticed_while_beat_builds_its_heap_never_sends_an_entry_twice(broker, settings):
    """django-celery-beat reloads its entries when the schedule changed and flags its heap for
    a rebuild at the next tick. A change noticed while the heap is being built (right after
    taking the lease, when the heap is rebuilt anyway) leaves that flag set: the next tick
    rebuilt the heap from the scheduler's own entries, where the entry just sent still carried
    its previous run, so it was due again and sent twice, milliseconds apart (seen once with
    two real beats). ``LeaderDatabaseScheduler.reserve`` keeps those entries current."""
    settings.CLEANUP_BEAT_LOCK_ID = 900_000 + os.getpid() % 100_000  # no other beat's lease
    install_schedule(shards=4, every=60)
    an_hour_ago = timezone.now() - timedelta(hours=1)
    PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX).update(last_run_at=an_hour_ago)
    scheduler = LeaderDatabaseScheduler(app=celery_app)
    try:
        # another beat starting, or an admin save, after this beat last looked
        PeriodicTasks.update_changed()
        for _ in range(12):
            # as beat's loop does, waiting what the tick asks (the send bound's spacing)
            wait = scheduler.tick()
            if wait > 0:
                time.sleep(min(wait, 0.1))
    finally:
        scheduler.close()
    # what beat really sent: the sweep messages on the tests' own Redis, one per shard
    sent = [_sweep_shard_of(entry) for entry in broker.lrange(settings.CLEANUP_SWEEP_QUEUE, 0, -1)]
    assert Counter(sent) == {k: 1 for k in range(4)}, sent


def _sweep_shard_of(entry: bytes) -> int:
    """The shard a sweep message on a Redis list asks for (kombu's envelope, base64 body)."""
    import base64

    envelope = json.loads(entry)
    assert envelope["headers"]["task"] == "cleanup.sweep_shard", envelope["headers"]
    _args, kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
    return int(kwargs["shard"])


@pytest.mark.django_db(transaction=True)
def test_a_leader_whose_lease_the_server_ended_sends_nothing(
    broker, leading_beat, settings, caplog
):
    # given: beat holding its lease and a sweep entry due
    scheduler, entry = leading_beat
    lease = scheduler._lock_conn
    assert lease is not None
    # and the server ends the lease's session (beat was frozen past the idle timeout, say):
    # its lock is free for another beat, which may be sending already
    with connection.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(%s)", [lease.info.backend_pid])
    # when: this beat wakes and sends the entry it had found due
    with caplog.at_level(logging.WARNING, logger="cleanup.schedule"):
        scheduler.apply_entry(entry)
    # then: nothing is sent (two leaders would double every sweep), and it says why
    sent = broker.llen(settings.CLEANUP_SWEEP_QUEUE)
    assert sent == 0, f"{sent} sweep sent on a lease the server had ended"
    assert "beat lock lost before a send; not sent" in caplog.text
