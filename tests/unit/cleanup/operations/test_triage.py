"""Dead-letter triage, the operator's side (cleanup.operations.triage): discard resolves each open
letter once with who and why, ages are parsed with their unit, and requeue sends the same
message again (or makes a set-aside hold due again), reporting what it cannot requeue.
(The commands: cleanup/management/commands/; the admin actions: cleanup/test_admin.py.)"""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from cleanup.broker.readers import priority_keys, queue_depth
from cleanup.models import DeadLetter
from cleanup.operations import triage
from cleanup.release import dead_letters
from cleanup.release.messages import build, build_batch
from cleanup.release.sweep import sweep_shard
from reservations import services
from reservations.models import Reservation
from tests.support.dead_letters import UNKNOWN, is_open, letter
from tests.support.planted import queued_bodies

# --- the services ------------------------------------------------------------------------------


def test_discard_resolves_each_open_letter_once_with_who_and_why(db):
    first, second = letter(), letter(UNKNOWN, "evil.task")
    done = triage.discard([first, second], by="alice", why="  garbage from a test client ")
    assert sorted(done) == ["discarded"]
    for x in (first, second):
        x.refresh_from_db()
        assert x.resolved_at is not None
        assert (x.resolution, x.resolved_by, x.resolution_note) == (
            "discarded",
            "alice",
            "garbage from a test client",
        )
    # a second discard (another operator, a double click) changes nothing
    again = triage.discard([first], by="bob", why="me too")
    assert {k: [x.pk for x in v] for k, v in again.items()} == {"already_resolved": [first.pk]}
    first.refresh_from_db()
    assert first.resolved_by == "alice"


@pytest.mark.parametrize(
    ("why", "words"), [("", "say why"), ("   ", "say why"), ("x" * 501, "at most 500")]
)
def test_discard_needs_a_reason_of_at_most_500_characters(db, why, words):
    x = letter()
    with pytest.raises(ValueError, match=words):
        triage.discard([x], by="alice", why=why)
    assert is_open(x) == [True]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("6h", 21600), ("7d", 604800), ("2w", 1209600)],
)
def test_ages_are_a_number_and_a_unit(text, seconds):
    assert triage.parse_age(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "7", "d", "-1d", "0h", "1y", "1.5h"])
def test_anything_else_is_not_an_age_and_the_message_says_what_is(text):
    with pytest.raises(ValueError, match="a positive number and a unit, s, m, h, d or w"):
        triage.parse_age(text)


# --- requeue ----------------------------------------------------------------------------------


def test_requeue_republishes_the_same_message_and_resolves_the_letter(db, broker, settings):
    message = build(42, 3, timezone.now(), 1, "trace-1")
    letter = dead_letters.record("retries_exhausted", error="db down", message=message)
    assert letter is not None
    out = StringIO()
    call_command("requeue_dead_letters", "--dry-run", stdout=out)
    assert "would requeue: republished: 1" in out.getvalue()
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    call_command("requeue_dead_letters", "--reason", "retries_exhausted", stdout=out)
    letter.refresh_from_db()
    assert letter.resolution == "republished" and letter.resolved_at is not None
    queued = queued_bodies(broker, settings.CLEANUP_RELEASE_QUEUE)
    assert queued[0][0][0]["idempotency_key"] == "release:42:3"  # same key: safe to redo


def test_a_malformed_letter_is_reported_not_requeued(db, broker, settings):
    letter = dead_letters.record("malformed", error="bad", payload="garbage")
    assert letter is not None
    result = triage.requeue([letter])
    assert sum(result.values()) == 1
    (what,) = result
    assert what.startswith("not_requeueable")
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    letter.refresh_from_db()
    assert letter.resolved_at is None and letter.resolution == ""


@pytest.mark.django_db(transaction=True)
def test_requeue_of_a_claims_exhausted_hold_makes_the_next_sweep_publish_it(broker, settings):
    # given: an expired hold that has used up its claim budget
    settings.CLEANUP_MAX_CLAIMS = 2
    offering = services.create_offering("exhausted", 2)
    hold = services.hold_seat(offering.pk, "a", 60)
    Reservation.objects.filter(pk=hold.pk).update(
        expires_at=timezone.now() - timedelta(minutes=1),
        next_attempt_at=timezone.now() - timedelta(minutes=1),
        claim_count=2,
    )
    # when: a sweep claims it a third time, it is set aside with a dead letter, not published
    first = sweep_shard(0, 1, trace_id="exhausted")
    assert (first.claimed, first.set_aside, first.published) == (1, 1, 0)
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
    letter = DeadLetter.objects.get(reason=DeadLetter.Reason.CLAIMS_EXHAUSTED)
    assert letter.reservation_id == hold.pk
    assert sweep_shard(0, 1).claimed == 0  # set aside: no sweep takes it
    # when: the letter is requeued
    assert triage.requeue([letter]) == {"rescheduled": 1}
    # then: the hold is due again with a fresh budget; the next sweep publishes its message
    letter.refresh_from_db()
    assert letter.resolution == "rescheduled" and letter.resolved_at is not None
    assert Reservation.objects.get(pk=hold.pk).claim_count == 0
    again = sweep_shard(0, 1, trace_id="after-requeue")
    assert (again.claimed, again.set_aside, again.published) == (1, 0, 1)
    queued = queued_bodies(broker, settings.CLEANUP_RELEASE_QUEUE)
    assert [q[0][0]["idempotency_key"] for q in queued] == [f"release:{hold.pk}:1"]
    # a second requeue of the same letter does nothing
    assert triage.requeue([DeadLetter.objects.get(pk=letter.pk)]) == {"already_resolved": 1}


def test_requeue_of_a_batch_message_republishes_the_batch_to_the_batched_task(db, broker, settings):
    now = timezone.now()
    message = build_batch([(41, 1, now), (42, 3, now)], 0, "batch-trace")
    letter = dead_letters.record("retries_exhausted", error="db down", message=message)
    assert letter is not None
    # when
    assert triage.requeue([letter]) == {"republished": 1}
    # then: the same batch, to cleanup.release_batch
    raw = [
        json.loads(item)
        for key in priority_keys(settings.CLEANUP_RELEASE_QUEUE)
        for item in broker.lrange(key, 0, -1)
    ]
    assert [r["headers"]["task"] for r in raw] == ["cleanup.release_batch"]
    (queued,) = queued_bodies(broker, settings.CLEANUP_RELEASE_QUEUE)
    assert queued[0][0] == message
    letter.refresh_from_db()
    assert letter.resolution == "republished"


def test_a_batch_letter_with_a_malformed_item_is_not_requeued(db, broker, settings):
    message = build_batch([(41, 1, timezone.now())], 0, "bad-batch")
    message["items"].append({"reservation_id": "x", "version": 1})
    letter = dead_letters.record("malformed", error="bad item", message=message)
    assert letter is not None
    result = triage.requeue([letter])
    assert list(result) == ["not_requeueable (1 malformed item(s))"]
    assert queue_depth(settings.CLEANUP_RELEASE_QUEUE) == 0
