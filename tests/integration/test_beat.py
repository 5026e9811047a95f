"""Real ``celery beat`` processes (cleanup.release.schedule:LeaderDatabaseScheduler) sending
sweeps to real workers.

6. Beat stopped for several intervals while holds expire → the next runs catch up completely;
   edits saved on the schedule's models (as the admin change form saves them) take effect
   without restarting beat.
9. Two beats → only the lease holder sends; SIGKILL the leader → the other takes over, and
   holds keep being released; a frozen leader loses its lease to the server's idle-session
   timeout and, once it wakes, sends nothing.
The "Cleanup schedule" admin object drives a real beat: a change saved through its admin change
form is followed without restarting beat (within its max loop interval), a disabled schedule
stops sweeps, and a restart's ``install_cleanup_schedule`` keeps the operator's edit.
Timings (takeover, send gaps) are printed, not asserted as speeds: only lower bounds that
say "never early, never twice" are checked.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db.models import Max
from django.test import Client
from django.urls import reverse
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from cleanup.broker import readers as broker
from cleanup.conf import cleanup_settings
from cleanup.models import CleanupSchedule, HealthSample
from cleanup.release.schedule import (
    RELAY_NAME,
    SWEEP_PREFIX,
    install_schedule,
    sweep_entry_name,
)
from cleanup.tasks import sample_health_task
from tests.support.fleet import (
    Beat,
    beats,
    claim_counts,
    create_eligible_holds,
    invariant_violations,
    outcome_counts,
    released_count,
    wait_until,
)
from tests.support.staff import logged_in

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


def _health_samples_while_beat_is_down(span: float) -> list[HealthSample]:
    """Send the health sample task to its own queue, each once the workers have recorded the
    previous one, until the samples they took span ``span`` seconds by their own clock; those
    samples. The sweep queue stays empty all along (a task read from another task's queue is a
    ``misrouted`` dead letter, so the samples cannot go there)."""
    newer_than = HealthSample.objects.aggregate(last=Max("pk"))["last"] or 0

    def after(pk: int) -> Callable[[], HealthSample | None]:
        return lambda: HealthSample.objects.filter(pk__gt=pk).order_by("pk").first()

    samples: list[HealthSample] = []
    while len(samples) < 2 or (samples[-1].taken_at - samples[0].taken_at).total_seconds() < span:
        sample_health_task.apply_async(queue=cleanup_settings().maintenance_queue)
        assert broker.queue_depth("sweep") == 0
        samples.append(
            wait_until(
                after(samples[-1].pk if samples else newer_than),
                timeout=60,
                interval=0.5,
                what="the workers to take a health sample",
            )
        )
    return samples


def test_beat_paused_for_several_intervals_catches_up(workers, schedule, beat_logs):
    with beats(beat_logs, 1) as (beat,):
        wait_until(beat.is_leader, timeout=60, what="beat lock acquired")
        first = create_eligible_holds(100, offerings=2)
        wait_until(lambda: released_count(first) == len(first), timeout=60, what="first batch")
        # when: beat stops; holds expire for several intervals with nobody sending sweeps
        beat.stop()
        assert not beat.alive()
        # let sweeps already sent finish: none waiting, none running
        wait_until(
            lambda: broker.queue_depth("sweep") == 0 and broker.unacked_count("sweep") == 0,
            timeout=60,
            what="sweep queue drained",
        )
        paused = create_eligible_holds(300, offerings=3)
        # the workers go on consuming for five of the sweeps' 1 s intervals with no sweep in the
        # sweep queue (a sweep sent by anything meanwhile would have claimed these holds), and
        # all along they see every hold due and unclaimed
        samples = _health_samples_while_beat_is_down(span=5.0)
        assert {sample.eligible for sample in samples} == {len(paused)}
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


def _sends(beat: Beat, prefix: str = SWEEP_PREFIX) -> dict[str, list[float]]:
    """Each sweep entry's sends (or those of the entries named ``prefix…``), as the beat logged
    them (epoch seconds, in order)."""
    by_entry: dict[str, list[float]] = {}
    for line in beat.lines(f"Sending due task {prefix}"):
        stamp = re.search(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)[.,](\d{3})", line)
        entry = re.search(r"Sending due task (.+?) \(", line)
        assert stamp and entry, line
        when = datetime.fromisoformat(f"{stamp[1]}T{stamp[2]}.{stamp[3]}")
        by_entry.setdefault(entry[1], []).append(when.replace(tzinfo=UTC).timestamp())
    return by_entry


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def _never_twice_within(sent: dict[str, list[float]], every: float) -> bool:
    """No entry sent twice within its interval. The gaps are read from the beat's log stamps,
    which carry the process's scheduling and logging jitter on a loaded machine (a first send
    logged 0.21 s late made a 1 s gap read 0.79 s), so the bound is half the interval: a second
    send within the interval shows as a gap near zero, and the old interval after an edit
    (1 s against 3 s) stays below it."""
    return min(g for times in sent.values() for g in _gaps(times)) >= every / 2


def _log_clock_offset(beat: Beat) -> float:
    """Seconds to add to time.time() to compare with the beat's log stamps (UTC or local)."""
    line = beat.lines("beat lock acquired")[0]
    stamp = re.search(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)", line)
    assert stamp, line
    logged = datetime.fromisoformat(f"{stamp[1]}T{stamp[2]}").replace(tzinfo=UTC).timestamp()
    # the log stamp is UTC or local wall time: round the difference to whole quarter hours
    return round((logged - time.time()) / 900) * 900


def _relayed_since(beat: Beat, after: float) -> int:
    """Sends of the outbox relay entry (every 5 s) after ``after``: proof that beat is ticking
    and has read the schedule since then, without sleeping for a window."""
    return len([t for t in _sends(beat, RELAY_NAME).get(RELAY_NAME, []) if t > after])


def _all_sent_at_least(beat: Beat, times: int, after: float = 0.0) -> bool:
    names = [sweep_entry_name(k, SHARDS) for k in range(SHARDS)]
    return _all_sent_at_least_of(beat, names, times, after)


def _all_sent_at_least_of(beat: Beat, names: list[str], times: int, after: float = 0.0) -> bool:
    sends = _sends(beat)
    return all(len([t for t in sends.get(n, []) if t > after]) >= times for n in names)


def _assert_quiet_since(beat: Beat, quiet_from: float, held: list[int]) -> None:
    """Once beat has sent its relay entry (every 5 s) twice after ``quiet_from``, any enabled
    sweep entry would have been sent too: none was, and no hold of ``held`` was touched."""
    wait_until(lambda: _relayed_since(beat, quiet_from) >= 2, timeout=30, what="two relays")
    late = [t for ts in _sends(beat).values() for t in ts if t > quiet_from]
    assert late == []
    assert set(claim_counts(held).values()) == {0}
    assert released_count(held) == 0


def _median_gaps(fast: dict[str, list[float]], slow: dict[str, list[float]]) -> str:
    """The median gap between sends of one entry at every=1 and at every=3, for the log."""
    return (
        f"every=1 → median {_median([g for ts in fast.values() for g in _gaps(ts)]):.2f}s, "
        f"every=3 → median {_median([g for ts in slow.values() for g in _gaps(ts)]):.2f}s"
    )


def test_schedule_edits_take_effect_without_restarting_beat(workers, schedule, beat_logs):
    with beats(beat_logs, 1) as (beat,):
        wait_until(beat.is_leader, timeout=60, what="beat lock acquired")
        offset = _log_clock_offset(beat)
        # every=1: each entry is sent again and again, never twice within its interval
        wait_until(lambda: _all_sent_at_least(beat, 3), timeout=60, what="sends at every=1")
        fast = _sends(beat)
        assert _never_twice_within(fast, every=1), fast
        # when: the interval becomes 3 s (the admin change form saves the entry)
        slow_every, _ = IntervalSchedule.objects.get_or_create(
            every=3, period=IntervalSchedule.SECONDS
        )
        _save_sweep_entries(interval=slow_every)
        changed_at = time.time() + offset
        # then: after beat notices (within its max_interval), no entry is sent again within
        # 3 s of its previous send
        noticed = changed_at + 2 * float(beat_max_interval())
        wait_until(
            lambda: _all_sent_at_least(beat, 3, after=noticed), timeout=90, what="sends at every=3"
        )
        slow = {n: [t for t in ts if t > noticed] for n, ts in _sends(beat).items()}
        assert _never_twice_within(slow, every=3), slow
        # when: the sweep entries are disabled
        _save_sweep_entries(enabled=False)
        disabled_at = time.time() + offset
        held = create_eligible_holds(100, offerings=2)
        # a window in which nothing may happen: from when beat has surely noticed, until it
        # has sent its relay entry (every 5 s) twice more, while the sweep entries (every 3 s)
        # would have been due more than once each
        quiet_from = disabled_at + float(beat_max_interval()) + 1
        # then: nothing is sent once beat noticed, nothing swept
        _assert_quiet_since(beat, quiet_from, held)
        # when: enabled again
        _save_sweep_entries(enabled=True)
        wait_until(lambda: released_count(held) == len(held), timeout=60, what="re-enabled")
    assert invariant_violations(expected_released=held) == []
    assert outcome_counts() == {"released": len(held)}
    print(f"\nsend gaps per entry: {_median_gaps(fast, slow)}")


def beat_max_interval() -> int:
    """The scheduler's tick bound (LeaderDatabaseScheduler: half the idle-session timeout)."""
    return max(1, cleanup_settings().beat_idle_session_timeout // 2)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def test_two_beats_only_the_leader_sends_and_the_other_takes_over(workers, schedule, beat_logs):
    with beats(beat_logs, 2) as pair:
        leader = wait_until(lambda: _leader(pair), timeout=60, what="exactly one leader")
        standby = next(b for b in pair if b is not leader)
        # when: both run while the leader sends each entry several times
        wait_until(lambda: _all_sent_at_least(leader, 4), timeout=60, what="leader sends")
        # then: only the leader sends, each entry once per interval (never twice)
        assert standby.sends() == 0
        assert not standby.is_leader()
        sent = _sends(leader)
        assert _never_twice_within(sent, every=1), sent
        holds = create_eligible_holds(100, offerings=2)
        wait_until(lambda: released_count(holds) == len(holds), timeout=60, what="released")
        # when: the leader is SIGKILLed
        killed_at = time.monotonic()
        leader.kill()
        # a deadline generous enough to mean "stuck", not a speed limit
        wait_until(standby.is_leader, timeout=90, interval=0.05, what="standby takes over")
        takeover = time.monotonic() - killed_at
        # then: the standby sends and holds keep being released
        wait_until(lambda: _all_sent_at_least(standby, 1), timeout=60, what="standby sends")
        after = create_eligible_holds(100, offerings=2)
        wait_until(lambda: released_count(after) == len(after), timeout=60, what="released")
    ids = holds + after
    assert invariant_violations(expected_released=ids) == []
    assert outcome_counts() == {"released": len(ids)}
    print(f"\nbeat takeover after SIGKILL of the leader: {takeover:.2f}s")


def test_a_leader_that_stops_pinging_loses_its_lease_and_sends_nothing_after(
    workers, schedule, beat_logs
):
    """A leader frozen past the server's idle-session timeout (SIGSTOP stands in for a hung
    process or a partition) has its lease session dropped by PostgreSQL; the standby takes
    over; when the old leader wakes, its ping fails, it logs the loss and sends nothing."""
    with beats(beat_logs, 2) as pair:
        leader = wait_until(lambda: _leader(pair), timeout=60, what="exactly one leader")
        standby = next(b for b in pair if b is not leader)
        wait_until(lambda: _all_sent_at_least(leader, 1), timeout=60, what="leader sends")
        # when: the leader freezes
        os.killpg(leader.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            wait_until(standby.is_leader, timeout=90, interval=0.1, what="standby takes over")
            takeover = time.monotonic() - frozen_at
            sends_while_frozen = leader.sends()
        finally:
            os.killpg(leader.pid, signal.SIGCONT)
        # then: the old leader notices it lost the lease and never sends again
        wait_until(lambda: leader.lines("beat lock lost"), timeout=60, what="old leader notices")
        wait_until(lambda: _all_sent_at_least(standby, 2), timeout=60, what="standby sends")
        holds = create_eligible_holds(100, offerings=2)
        wait_until(lambda: released_count(holds) == len(holds), timeout=60, what="released")
        assert leader.sends() == sends_while_frozen
        assert leader.alive() and standby.alive()
        assert len(leader.lines("beat lock acquired")) == 1  # it never took the lease back
    assert takeover >= beat_idle_timeout() - 1  # the server, not a ping, ended the lease
    assert invariant_violations(expected_released=holds) == []
    print(f"\nfrozen leader: standby took over after {takeover:.2f}s")


def beat_idle_timeout() -> int:
    return cleanup_settings().beat_idle_session_timeout


# --- the Cleanup schedule admin object drives beat ---------------------------------------


def _save_in_admin(client: Client, shards: int, every: int, enabled: bool) -> None:
    """What an operator does: the Cleanup schedule change form, saved."""
    schedule = CleanupSchedule.objects.get()
    response = client.post(
        reverse("admin:cleanup_cleanupschedule_change", args=[schedule.pk]),
        {"shards": str(shards), "every_seconds": str(every), "enabled": "on" if enabled else ""},
    )
    assert response.status_code == 302, response.content.decode()[:2000]


def _sends_of(beat: Beat, shards: int) -> int:
    """Sends of the sweep entries of a schedule with ``shards`` shards."""
    suffix = f" of {shards}"
    return sum(len(times) for name, times in _sends(beat).items() if name.endswith(suffix))


def test_a_real_beat_follows_schedule_edits_saved_in_the_admin(workers, clean, beat_logs):
    # given: the schedule as `make run` installs it, then an operator at the admin
    call_command("install_cleanup_schedule", "--shards", "4", "--every", "1")
    operator = logged_in(User.objects.create_superuser("op", "op@example.com", "pw"))
    with beats(beat_logs, 1) as (beat,):
        wait_until(beat.is_leader, timeout=60, what="beat lock acquired")
        wait_until(lambda: _sends_of(beat, 4) >= 4, timeout=30, what="first sends of 4 shards")
        offset = _log_clock_offset(beat)
        # when: 2 shards every 1 s
        _save_in_admin(operator, shards=2, every=1, enabled=True)
        # then: beat follows: each of the two new entries is sent again and again, never twice
        # within its interval, and no entry of the 4-shard schedule once the new ones are sent
        new_entries = [sweep_entry_name(k, 2) for k in range(2)]
        wait_until(
            lambda: all(len(_sends(beat).get(n, [])) >= 4 for n in new_entries),
            timeout=30,
            what="4 sends of each 2-shard entry",
        )
        fast = {n: _sends(beat)[n] for n in new_entries}
        first_new = min(t for ts in fast.values() for t in ts)
        old_after = [
            t for n, ts in _sends(beat).items() if n.endswith(" of 4") for t in ts if t > first_new
        ]
        assert old_after == []
        assert _never_twice_within(fast, every=1), fast
        # when: every 3 s
        _save_in_admin(operator, shards=2, every=3, enabled=True)
        noticed = time.time() + offset + 2 * float(beat_max_interval())
        # then: each entry is sent again, never within 3 s of its previous send
        wait_until(
            lambda: _all_sent_at_least_of(beat, new_entries, 3, after=noticed),
            timeout=60,
            what="3 sends of each 2-shard entry at every=3",
        )
        slow = {n: [t for t in _sends(beat)[n] if t > noticed] for n in new_entries}
        assert _never_twice_within(slow, every=3), slow
        # when: disabled
        _save_in_admin(operator, shards=2, every=3, enabled=False)
        held = create_eligible_holds(60, offerings=2)
        # and the platform restarts its one-off step (what `make run` and compose run)
        call_command("install_cleanup_schedule", "--shards", "4", "--every", "1")
        # a window from when beat has surely noticed both, until it has sent its relay entry
        # (every 5 s) twice more: any enabled sweep entry would have been sent meanwhile
        quiet_from = time.time() + offset + float(beat_max_interval()) + 1
        # then: nothing is sent, no hold is claimed, the edit stood
        _assert_quiet_since(beat, quiet_from, held)
        schedule = CleanupSchedule.objects.get()
        assert (schedule.shards, schedule.every_seconds, schedule.enabled) == (2, 3, False)
        # when: enabled again
        _save_in_admin(operator, shards=2, every=1, enabled=True)
        wait_until(lambda: released_count(held) == len(held), timeout=60, what="re-enabled")
    assert invariant_violations(expected_released=held) == []
    assert outcome_counts() == {"released": len(held)}
    print(f"\nadmin edits: send gaps per entry: {_median_gaps(fast, slow)}, off → none")
