"""explain_hold: the story and its verdict for a released, a renewed, a set-aside and a stuck
hold (real PostgreSQL; sweeps publish to the tests' own Redis database, emptied afterwards)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from cleanup.models import DeadLetter
from cleanup.operations.console.story import explain
from cleanup.release.messages import build, validate
from cleanup.release.release import Attempt, release
from cleanup.release.sweep import sweep_shard
from reservations import services
from reservations.models import Offering, Reservation
from tests.support.holds import expire

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("broker")]


def test_released_hold_names_the_task_and_trace(offering: Offering) -> None:
    hold = services.hold_seat(offering.pk, "ada", ttl_seconds=60)
    expire(hold.pk)
    hold.refresh_from_db()
    message = validate(build(hold.pk, 1, hold.expires_at, 0, "trace-abc"))
    assert release(message, Attempt(1, "w1@host", "task-123", 0.5)) == "released"

    story = explain(hold.pk)

    assert story.verdict == "released at v1 by task task-123 (trace trace-abc) on w1@host"
    text = story.text()
    assert "reservation.held v1" in text and "reservation.released v1" in text
    assert f"receipt release:{hold.pk}:1 → released" in text
    assert "ada" not in text  # the holder is never shown


def test_renewed_hold_is_held_until_its_new_expiry(offering: Offering) -> None:
    hold = services.hold_seat(offering.pk, "bob", ttl_seconds=60)
    services.renew(hold.pk, 1, ttl_seconds=600)

    story = explain(hold.pk)

    assert story.verdict.startswith("held, not expired until ")
    assert "(renewed 1 times, now v2)" in story.verdict
    assert "reservation.renewed v2" in story.text()


def test_stuck_hold_reports_claims_trace_and_next_attempt(offering: Offering) -> None:
    hold = services.hold_seat(offering.pk, "cy", ttl_seconds=60)
    expire(hold.pk, ago=timedelta(seconds=312))
    result = sweep_shard(0, 1, trace_id="sweep-trace-1")
    assert result.published == 1  # the message is queued; no worker consumes it here

    story = explain(hold.pk)

    assert story.verdict.startswith("eligible for ")
    assert "claimed 1 times, last trace sweep-trace-1, next attempt at " in story.verdict
    eligible_for = int(story.verdict.split()[2])
    assert 311 <= eligible_for <= 330
    assert story.deliveries == {f"release:{hold.pk}:1": 0}
    assert "sweep-trace-1" in story.trace_ids


def test_set_aside_hold_points_at_its_dead_letter(offering: Offering, settings) -> None:
    hold = services.hold_seat(offering.pk, "dee", ttl_seconds=60)
    expire(hold.pk)
    Reservation.objects.filter(pk=hold.pk).update(claim_count=settings.CLEANUP_MAX_CLAIMS)
    result = sweep_shard(0, 1, trace_id="sweep-trace-2")
    assert result.set_aside == 1
    letter = DeadLetter.objects.get(reservation_id=hold.pk)

    story = explain(hold.pk)

    assert story.verdict == (
        f"set aside after {settings.CLEANUP_MAX_CLAIMS + 1} claims: dead letter #{letter.pk} "
        f"— run requeue_dead_letters --id {letter.pk}"
    )
    assert f"dead letter #{letter.pk} claims_exhausted" in story.text()


def test_never_claimed_and_unknown_holds(offering: Offering) -> None:
    hold = services.hold_seat(offering.pk, "eve", ttl_seconds=60)
    expire(hold.pk)
    assert "never claimed" in explain(hold.pk).verdict
    assert explain(999_999).verdict == "no hold #999999"
