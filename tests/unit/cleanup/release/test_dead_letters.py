"""Dead letters (cleanup.release.dead_letters): a letter is always stored, bounded, whatever the
message; the open letters beyond the cap are summarised per reason and task; a later release
or a later success of the same periodic run settles the letters it made moot."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from cleanup.models import DeadLetter
from cleanup.operations import triage
from cleanup.release import dead_letters
from cleanup.release.messages import build, validate
from cleanup.release.release import Attempt, release
from reservations import services
from reservations.models import Reservation
from tests.support.dead_letters import MALFORMED, UNKNOWN, is_open, letter
from tests.support.wire import GOOD
from tools.seed import seed_holds


def test_the_oldest_open_letters_beyond_the_cap_are_summarised_per_reason_and_task(db):
    # given: 8 malformed letters (task a), 3 unknown_task (task x), 2 claims_exhausted, cap 5
    old_malformed = [letter(MALFORMED, "a") for _ in range(6)]
    old_unknown = [letter(UNKNOWN, "x") for _ in range(2)]
    set_aside = [letter(DeadLetter.Reason.CLAIMS_EXHAUSTED) for _ in range(2)]
    kept = [letter(MALFORMED, "a"), letter(MALFORMED, "a"), letter(UNKNOWN, "x")]
    kept += [letter(UNKNOWN, "y"), letter(UNKNOWN, "y")]
    # when
    assert dead_letters.summarise_beyond_cap(5) == 8
    # then: the 5 newest candidates and the claims_exhausted letters stay open in full
    assert all(is_open(*kept, *set_aside))
    assert DeadLetter.objects.get(pk=kept[0].pk).payload == "x" * 2000
    # the 8 older ones are resolved as summarised, their payloads dropped
    for x in (*old_malformed, *old_unknown):
        x.refresh_from_db()
        assert (x.resolution, x.resolved_by, x.payload, x.message) == (
            "summarised",
            "cleanup",
            "",
            None,
        )
    # one open summary letter per reason and task, with the count and first/last times
    summaries = DeadLetter.objects.filter(summarised_count__gt=0, resolved_at__isnull=True)
    got = {
        (s.reason, s.task_name): (s.summarised_count, s.summarised_first_at, s.summarised_last_at)
        for s in summaries
    }
    assert got == {
        (MALFORMED, "a"): (6, old_malformed[0].created_at, old_malformed[-1].created_at),
        (UNKNOWN, "x"): (2, old_unknown[0].created_at, old_unknown[-1].created_at),
    }
    summary = summaries.get(reason=MALFORMED)
    assert "summary of 6 older open dead letter(s)" in summary.error
    assert f"summarised into dead letter #{summary.pk}" in old_malformed[0].resolution_note
    # nothing more to do; later letters beyond the cap go into the same summary
    assert dead_letters.summarise_beyond_cap(5) == 0
    letter(MALFORMED, "a")
    assert dead_letters.summarise_beyond_cap(5) == 1
    summary.refresh_from_db()
    assert summary.summarised_count == 7
    assert summaries.count() == 2


def test_the_health_upkeep_every_30_s_applies_the_cap(db, broker, settings):
    from cleanup.tasks import sample_health_task

    settings.CLEANUP_DEAD_LETTER_OPEN_CAP = 2
    letters = [letter() for _ in range(4)]
    result = sample_health_task.run()  # the task's body, as the worker runs it
    assert result["dead_letters_summarised"] == 2
    assert is_open(*letters) == [False, False, True, True]


def test_task_names_beyond_the_bound_per_reason_share_one_summary(db, monkeypatch):
    monkeypatch.setattr(dead_letters, "SUMMARY_TASKS_PER_REASON", 2)
    for task, n in (("t1", 3), ("t2", 2), ("t3", 1), ("t4", 1)):
        for _ in range(n):
            letter(UNKNOWN, task)
    letter(UNKNOWN, "newest")
    assert dead_letters.summarise_beyond_cap(1) == 7
    got = dict(
        DeadLetter.objects.filter(summarised_count__gt=0).values_list(
            "task_name", "summarised_count"
        )
    )
    assert got == {"t1": 3, "t2": 2, "(other tasks)": 2}


@pytest.mark.usefixtures("api_token")
@pytest.mark.django_db
def test_a_periodic_success_settles_only_the_letters_of_the_same_run() -> None:
    from cleanup.models import DeadLetter
    from cleanup.release import dead_letters
    from cleanup.tasks import relay_outbox_task, sweep_shard_task

    def key(task: Any, **kwargs: Any) -> str:
        return str(task.periodic_key((), kwargs))

    def letter(idempotency_key: str, reason: str = DeadLetter.Reason.PERIODIC_FAILED) -> Any:
        return dead_letters.record(reason, error="boom", idempotency_key=idempotency_key)

    shard0 = key(sweep_shard_task, shard=0, shards=4)
    assert shard0 == "periodic:cleanup.sweep_shard:shard=0,shards=4"
    mine = [letter(shard0), letter(shard0)]
    others = [
        letter(key(sweep_shard_task, shard=1, shards=4)),  # another shard still failing
        letter(key(sweep_shard_task, shard=0, shards=8)),  # shard 0 of another N
        letter(key(relay_outbox_task)),
        letter(shard0, DeadLetter.Reason.FAILED),  # not a periodic letter
    ]
    # when: shard 0 of 4 succeeds
    assert dead_letters.resolve_periodic(shard0) == 2
    # then: its two letters are settled, by the cleanup; nothing else
    for settled in mine:
        settled.refresh_from_db()
        assert (settled.resolution, settled.resolved_by) == ("succeeded_later", "cleanup")
    assert all(DeadLetter.objects.get(pk=o.pk).resolved_at is None for o in others), (
        "a success settled another run's letter"
    )
    # and requeue says why it will not send a periodic letter, changing nothing
    (action,) = triage.requeue([others[0]]).keys()
    assert action.startswith("not_requeueable (a periodic task: beat runs it again")
    assert DeadLetter.objects.get(pk=others[0].pk).resolved_at is None


@pytest.mark.usefixtures("api_token")
@pytest.mark.django_db
def test_a_sweep_that_skipped_its_locked_shard_settles_nothing() -> None:
    from cleanup.models import DeadLetter
    from cleanup.release import dead_letters
    from cleanup.tasks import sweep_shard_task

    kwargs = {"shard": 0, "shards": 2}
    key = sweep_shard_task.periodic_key((), kwargs)
    letter = dead_letters.record(
        DeadLetter.Reason.PERIODIC_FAILED, error="boom", idempotency_key=key
    )
    assert letter is not None
    # a sweep that found its shard locked by another one ran nothing: the letter stays open
    sweep_shard_task.on_success({"skipped_locked": True}, "t1", (), kwargs)
    assert DeadLetter.objects.get(pk=letter.pk).resolved_at is None
    # a sweep that ran settles it
    sweep_shard_task.on_success({"skipped_locked": False, "claimed": 0}, "t2", (), kwargs)
    assert DeadLetter.objects.get(pk=letter.pk).resolution == dead_letters.SUCCEEDED_LATER


@pytest.mark.django_db
@pytest.mark.parametrize(
    "message",
    [
        {**GOOD, "reservation_id": 2**64},
        {**GOOD, "version": 2**40},
        {**GOOD, "trace_id": "\ud800"},
        {**GOOD, "trace_id": "a\x00b", "idempotency_key": "\x00" * 500},
        {**GOOD, "trace_id": "x" * (2 * 1024 * 1024)},
        {"deep": json.loads("[" * 500 + "]" * 500)},
    ],
    ids=["id 2**64", "version 2**40", "lone surrogate", "NUL bytes", "2 MB", "deep"],
)
def test_record_stores_a_bounded_row_for_any_message(message: dict) -> None:
    letter = dead_letters.record(
        DeadLetter.Reason.MALFORMED, error="bad \x00 \ud800", message=message, payload=message
    )
    assert letter is not None
    stored = DeadLetter.objects.get(pk=letter.pk)
    assert stored.reason == "malformed"
    assert len(stored.payload) <= dead_letters.PAYLOAD_LIMIT
    assert stored.message is None or len(json.dumps(stored.message)) <= dead_letters.MESSAGE_LIMIT
    assert stored.reservation_id in (None, 1) and stored.version in (None, 1)
    assert "\x00" not in stored.error + stored.payload + stored.trace_id


@pytest.mark.django_db
def test_record_never_raises_and_keeps_the_reason_when_the_row_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(dead_letters, "_storable_message", lambda m: {"bad": "\x00"})
    letter = dead_letters.record(DeadLetter.Reason.FAILED, error="boom", message=dict(GOOD))
    assert letter is not None
    assert DeadLetter.objects.get(pk=letter.pk).error.startswith("boom [row rejected")


def test_letters_a_later_release_settled_are_resolved_and_the_rest_stay_open(db):
    # given: three expired holds whose releases were dead-lettered — two for slowness or
    # transient errors, one as malformed (its payload is evidence) — and a fourth hold, whose
    # dead-lettered release lost the race to a renewal
    ids = seed_holds(4, offerings=1, expires_in=lambda p: -60.0 if p < 3 else 60.0, name="settle")
    messages = {i: build(i, 1, timezone.now() - timedelta(minutes=1), 0, "t") for i in ids}
    reasons = [
        DeadLetter.Reason.TIME_LIMIT,
        DeadLetter.Reason.RETRIES_EXHAUSTED,
        DeadLetter.Reason.MALFORMED,
        DeadLetter.Reason.TIME_LIMIT,
    ]
    recorded = [
        dead_letters.record(reason, error="x", message=messages[i])
        for reason, i in zip(reasons, ids, strict=True)
    ]
    letters = [letter for letter in recorded if letter is not None]
    assert len(letters) == 4
    renewed = Reservation.objects.get(pk=ids[3])
    services.renew(renewed.pk, renewed.version, ttl_seconds=600)
    # and when later messages with the same keys are handled (a later sweep's, or the
    # interrupted statement that committed after all)
    attempt = Attempt(1, "w@h", "task-later", 0.1)
    outcomes = [release(validate(messages[i]), attempt) for i in ids]
    assert outcomes == ["released", "released", "released", "renewed"]
    # when
    assert dead_letters.resolve_released() == 2
    # then: the two a release settled are resolved; the malformed one and the one whose hold
    # was renewed (not released) stay open
    for written in letters:
        written.refresh_from_db()
    assert [(x.resolved_at is not None, x.resolution) for x in letters] == [
        (True, "released_later"),
        (True, "released_later"),
        (False, ""),
        (False, ""),
    ]
    # and a second pass changes nothing
    assert dead_letters.resolve_released() == 0
