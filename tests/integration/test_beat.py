"""Real ``celery beat`` processes (cleanup.schedule:LeaderDatabaseScheduler) sending sweeps to
real workers.

6. Beat stopped for several intervals while holds expire → the next runs catch up completely;
   edits saved on the schedule's models (as the admin change form saves them) take effect
   without restarting beat.
9. Two beats → only the lease holder sends; SIGKILL the leader → the other takes over within a
   bounded time, and holds keep being released.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from cleanup.schedule import SWEEP_PREFIX, install_schedule, sweep_entry_name

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

SHARDS = 4


@pytest.fixture
def beat_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("beat")


@pytest.fixture
def schedule(clean: None) -> Iterator[None]:
    install_schedule(shards=SHARDS, every=1)
    yield


def _save_sweep_entries(**changes: object) -> None:
    """Change every sweep entry the way the admin change form does: set fields, ``save()``."""
    for entry in PeriodicTask.objects.filter(name__startswith=SWEEP_PREFIX):
        for name, value in changes.items():
            setattr(entry, name, value)
        entry.save()


def _leader(bs: list[Beat]) -> Beat | None:
    leaders = [b for b in bs if b.is_leader() and b.alive()]
    return leaders[0] if len(leaders) == 1 else None


def test_beat_paused_for_several_intervals_catches_up(workers, schedule, beat_logs):
    with beats(beat_logs, 1) as (beat,):
        wait_until(beat.is_leader, timeout=60, what="beat lease acquired")
        first = create_eligible_holds(100, offerings=2)
        wait_until(lambda: released_count(first) == len(first), timeout=60, what="first batch")
        # when: beat stops; holds expire for several intervals with nobody sending sweeps
        beat.stop()
        assert not beat.alive()
        time.sleep(1.5)  # let an already-sent sweep finish
        paused = create_eligible_holds(300, offerings=3)
        time.sleep(5)
        assert released_count(paused) == 0
        assert set(claim_counts(paused).values()) == {0}
        # and beat comes back
        restarted = time.monotonic()
        beat.start()
        wait_until(lambda: released_count(paused) == len(paused), timeout=90, what="catch-up")
        catch_up = time.monotonic() - restarted
    ids = first + paused
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts() == {"released": len(ids)}
    print(f"\nbeat restarted: {len(paused)} waiting holds released in {catch_up:.1f}s")


def test_schedule_edits_take_effect_without_restarting_beat(workers, schedule, beat_logs):
    with beats(beat_logs, 1) as (beat,):
        wait_until(beat.is_leader, timeout=60, what="beat lease acquired")
        # every=1: about one send per second per shard
        wait_until(lambda: beat.sends() >= SHARDS, timeout=30, what="first sends")
        before = beat.sends()
        time.sleep(6)
        fast = beat.sends() - before
        # when: the interval becomes 3 s (the admin change form saves the entry)
        slow_every, _ = IntervalSchedule.objects.get_or_create(
            every=3, period=IntervalSchedule.SECONDS
        )
        _save_sweep_entries(interval=slow_every)
        time.sleep(3)  # beat notices within max_interval (1 s) and its next due times pass
        before = beat.sends()
        time.sleep(6)
        slow = beat.sends() - before
        # then
        assert fast >= SHARDS * 4, f"{fast} sends in 6 s at every=1"
        assert slow <= SHARDS * 3, f"{slow} sends in 6 s at every=3"
        assert slow < fast
        # when: the sweep entries are disabled
        _save_sweep_entries(enabled=False)
        time.sleep(3)
        disabled_at = beat.sends()
        held = create_eligible_holds(100, offerings=2)
        time.sleep(5)
        # then: nothing is sent, nothing swept
        assert beat.sends() == disabled_at
        assert set(claim_counts(held).values()) == {0}
        assert released_count(held) == 0
        # when: enabled again
        _save_sweep_entries(enabled=True)
        wait_until(lambda: released_count(held) == len(held), timeout=60, what="re-enabled")
    assert invariant_violations(expected_released=held) == []
    assert outcome_counts() == {"released": len(held)}
    print(f"\nsends in 6 s: every=1 → {fast}, every=3 → {slow}, disabled → 0")


def test_two_beats_only_the_leader_sends_and_the_other_takes_over(workers, schedule, beat_logs):
    with beats(beat_logs, 2) as pair:
        leader = wait_until(lambda: _leader(pair), timeout=60, what="exactly one leader")
        standby = next(b for b in pair if b is not leader)
        wait_until(lambda: leader.sends() >= SHARDS, timeout=30, what="first sends")
        # when: both run for 6 s
        before = {b.name: b.sends() for b in pair}
        time.sleep(6)
        sent = {b.name: b.sends() - before[b.name] for b in pair}
        # then: only the leader sends, about once per second per shard (not twice)
        assert standby.sends() == 0
        assert not standby.is_leader()
        assert SHARDS * 4 <= sent[leader.name] <= SHARDS * 8, sent
        holds = create_eligible_holds(100, offerings=2)
        wait_until(lambda: released_count(holds) == len(holds), timeout=60, what="released")
        # when: the leader is SIGKILLed
        killed_at = time.monotonic()
        leader.kill()
        wait_until(standby.is_leader, timeout=30, interval=0.05, what="standby takes over")
        takeover = time.monotonic() - killed_at
        # then: the standby sends and holds keep being released
        wait_until(lambda: standby.sends() >= SHARDS, timeout=30, what="standby sends")
        after = create_eligible_holds(100, offerings=2)
        wait_until(lambda: released_count(after) == len(after), timeout=60, what="released")
    assert takeover < 10, f"takeover took {takeover:.1f}s"
    ids = holds + after
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts() == {"released": len(ids)}
    assert sweep_entry_name(0, SHARDS) in "\n".join(standby.lines("Sending due task"))
    print(f"\nbeat takeover after SIGKILL of the leader: {takeover:.2f}s")
