"""The Cleanup schedule: install_cleanup_schedule creates it only when missing (--force resets
it), saving it rewrites the sweep entries; every bucket in exactly one shard under any N."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone
from django_celery_beat.models import IntervalSchedule, PeriodicTask, PeriodicTasks

from cleanup.models import CleanupSchedule
from cleanup.release import claim
from cleanup.release.claim import shard_buckets
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
from reservations.models import BUCKETS, Reservation
from tools.seed import seed_holds

pytestmark = [pytest.mark.django_db]


def _sweep_entries() -> list[PeriodicTask]:
    return list(PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX).order_by("name"))


def test_install_schedule_creates_one_sweep_entry_per_shard():
    # when
    report = install_schedule(shards=4, every=2)
    # then
    entries = _sweep_entries()
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


def _command(*args: str) -> str:
    out = StringIO()
    call_command("install_cleanup_schedule", *args, stdout=out)
    return out.getvalue()


def _sweeps_as_beat_sees_them() -> list[tuple[str, int, bool, dict[str, int]]]:
    return [
        (e.name, e.interval.every if e.interval else 0, e.enabled, json.loads(e.kwargs))
        for e in _sweep_entries()
    ]


def test_the_command_creates_the_schedule_only_when_none_exists():
    # when: first start
    out = _command("--shards", "4", "--every", "10")
    # then
    assert "created: 4 shard(s) every 10s, enabled" in out
    schedule = CleanupSchedule.objects.get()
    assert (schedule.shards, schedule.every_seconds, schedule.enabled) == (4, 10, True)
    assert len(_sweep_entries()) == 4
    # given: an operator's edit (what the admin's save does)
    save_schedule(shards=2, every=3, enabled=False)
    edited = _sweeps_as_beat_sees_them()
    marker = PeriodicTasks.last_change()
    # when: a restart runs the same command line again
    out = _command("--shards", "4", "--every", "10")
    # then: the edit stands, and beat is not even told that something changed
    assert "kept (exists; --force resets it): 2 shard(s) every 3s, DISABLED" in out
    assert _sweeps_as_beat_sees_them() == edited
    assert [(e[1], e[2]) for e in edited] == [(3, False), (3, False)]
    assert PeriodicTasks.last_change() == marker
    assert CleanupSchedule.objects.count() == 1


def test_the_command_keeps_an_edited_relay_entry_and_force_resets_everything():
    _command("--shards", "4", "--every", "10")
    relay = PeriodicTask.objects.get(name=RELAY_NAME)
    relay.interval, _ = IntervalSchedule.objects.get_or_create(
        every=30, period=IntervalSchedule.SECONDS
    )
    relay.save()
    save_schedule(shards=3, every=20, enabled=False)
    # when: restarted without --force
    _command("--shards", "4", "--every", "10")
    # then
    assert PeriodicTask.objects.get(name=RELAY_NAME).interval.every == 30
    # when: --force
    out = _command("--shards", "4", "--every", "10", "--force")
    # then
    assert "reset to 4 shard(s) every 10s, enabled" in out
    assert PeriodicTask.objects.get(name=RELAY_NAME).interval.every == 5
    assert [(e[1], e[2]) for e in _sweeps_as_beat_sees_them()] == [(10, True)] * 4


def test_a_deleted_sweep_entry_comes_back_on_the_next_start():
    _command("--shards", "2", "--every", "5")
    PeriodicTask.objects.get(name=sweep_entry_name(1, 2)).delete()
    # when
    _command("--shards", "2", "--every", "5")
    # then
    assert [e.name for e in _sweep_entries()] == [sweep_entry_name(0, 2), sweep_entry_name(1, 2)]


def test_saving_the_schedule_disables_and_reenables_every_sweep_entry_and_tells_beat():
    save_schedule(shards=3, every=2, enabled=True)
    before = PeriodicTasks.last_change()
    # when
    save_schedule(shards=3, every=2, enabled=False)
    # then
    assert {e.enabled for e in _sweep_entries()} == {False}
    assert PeriodicTasks.last_change() > before
    # when
    save_schedule(shards=3, every=2, enabled=True)
    assert {e.enabled for e in _sweep_entries()} == {True}


def test_an_invalid_schedule_changes_nothing():
    save_schedule(shards=2, every=4)
    for shards, every in ((0, 4), (1025, 4), (2, 0)):
        with pytest.raises(ValueError):
            save_schedule(shards=shards, every=every)
    assert [(e[1], e[3]["shards"]) for e in _sweeps_as_beat_sees_them()] == [(4, 2), (4, 2)]


@pytest.mark.parametrize(("first", "second"), [(4, 3), (3, 5), (5, 4)])
def test_a_new_shard_count_rewrites_the_sweep_entries(first, second):
    install_schedule(shards=first, every=1)
    before = PeriodicTasks.last_change()
    # when
    report = install_schedule(shards=second, every=1)
    # then
    entries = _sweep_entries()
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
    for entry in _sweep_entries():
        assert entry.interval is not None and entry.interval.every == 7
        assert entry.expire_seconds == 7


@pytest.mark.parametrize("shards", [1, 3, 4, 5, 7, BUCKETS])
def test_every_bucket_belongs_to_exactly_one_shard(shards):
    # the buckets the sweep's claim reads (claim_expired) and the SLO gauge reports per shard
    owners: dict[int, list[int]] = {}
    for k in range(shards):
        for b in shard_buckets(k, shards):
            owners.setdefault(b, []).append(k)
    assert sorted(owners) == list(range(BUCKETS))
    assert all(len(found) == 1 for found in owners.values())
    # and the schedule's entries name exactly the shards 0..N-1 of N
    if shards <= 8:
        install_schedule(shards=shards, every=1)
        kwargs = [json.loads(e.kwargs) for e in _sweep_entries()]
        assert sorted(kw["shard"] for kw in kwargs) == list(range(shards))
        assert {kw["shards"] for kw in kwargs} == {shards}


@pytest.mark.parametrize(("shard", "shards"), [(0, 0), (-1, 4), (4, 4)])
def test_an_impossible_shard_is_refused(shard, shards):
    with pytest.raises(ValueError):
        shard_buckets(shard, shards)


@pytest.mark.django_db(transaction=True)
def test_every_hold_is_claimed_by_exactly_one_shard_under_any_shard_count():
    # given: holds covering all 1024 buckets, already expired
    with transaction.atomic():
        seed_holds(BUCKETS + 10, offerings=1, expires_in=-60.0, name="buckets")
    ids = set(Reservation.objects.values_list("id", flat=True))
    buckets = set(Reservation.objects.values_list("bucket", flat=True))
    assert buckets == set(range(BUCKETS))
    for shards in (3, 4, 5):
        # the ORM's shard filter partitions the holds
        seen: list[int] = []
        for k in range(shards):
            seen.extend(Reservation.objects.in_shard(k, shards).values_list("id", flat=True))
        assert sorted(seen) == sorted(ids)
        # and so does the sweep's claim statement (lease 0: due again at once for the next N)
        claimed: list[int] = []
        for k in range(shards):
            with transaction.atomic():
                got = claim.claim_expired(
                    k, shards, batch_size=5000, lease_seconds=0, max_claims=100
                )
            assert all(c.bucket % shards == k for c in got)
            claimed.extend(c.reservation_id for c in got)
        assert sorted(claimed) == sorted(ids)


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
    out = _command("--shards", "4", "--every", "10")
    # then
    assert "created: 3 shard(s) every 20s, DISABLED" in out
    assert [(e[1], e[2]) for e in _sweeps_as_beat_sees_them()] == [(20, False)] * 3


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
            scheduler.tick()
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
    lease = scheduler._lease_conn
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
    assert "beat lease lost before a send; not sent" in caplog.text
