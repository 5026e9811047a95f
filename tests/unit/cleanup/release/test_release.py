"""The batched mode decides every hold exactly as the per-reservation mode would."""

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from cleanup.models import DeadLetter
from cleanup.release.messages import MalformedMessage, build_batch, validate_batch
from cleanup.release.publish import RELEASE_BATCH_TASK
from reservations import services
from reservations.models import Reservation
from reservations.services import ReleaseOutcome
from reservations.services import release_holds as release_many_if_expired
from tests.support.holds import expire


def _scenario(offering_capacity: int = 10):
    """Holds in every state the outcome order distinguishes; returns (offering, items)."""
    offering = services.create_offering("bulk", offering_capacity)
    expired = [services.hold_seat(offering.pk, f"h{i}", 60) for i in range(6)]
    fresh = services.hold_seat(offering.pk, "fresh", 600)
    services.renew(expired[1].pk, 1, 120)  # now v2; a v1 message is stale
    renewed = services.renew(expired[5].pk, 1, 120)  # v2, expires within the later clock
    services.confirm(expired[2].pk, 1)
    services.cancel(expired[3].pk, 1)
    items = [
        (expired[0].pk, 1),  # released
        (expired[1].pk, 1),  # renewed (version moved while held)
        (expired[2].pk, 1),  # no_longer_held (confirmed)
        (expired[3].pk, 1),  # no_longer_held (cancelled)
        (fresh.pk, 1),  # not_expired at the later clock? no: fresh expires in 600 s
        (999_999, 1),  # not_found
        (expired[4].pk, 1),  # released
        (renewed.pk, 2),  # renewed hold at its new version, expired by the clock → released
    ]
    return offering, items


def test_bulk_release_gives_each_hold_the_outcome_it_would_get_alone(db):
    # given two identical worlds, judged at a clock past the short holds but not the fresh one
    later = timezone.now() + timedelta(seconds=300)
    _, bulk_items = _scenario()
    _, single_items = _scenario()
    # when
    bulk = release_many_if_expired(bulk_items, now=later)
    single = [services.release_if_expired(rid, v, now=later) for rid, v in single_items]
    # then: same outcome, position by position
    assert [bulk[rid] for rid, _ in bulk_items] == single
    assert [bulk[rid] for rid, _ in bulk_items] == [
        ReleaseOutcome.RELEASED,
        ReleaseOutcome.RENEWED,
        ReleaseOutcome.NO_LONGER_HELD,
        ReleaseOutcome.NO_LONGER_HELD,
        ReleaseOutcome.NOT_EXPIRED,
        ReleaseOutcome.NOT_FOUND,
        ReleaseOutcome.RELEASED,
        ReleaseOutcome.RELEASED,
    ]
    # and a second pass finds them released at this version
    again = release_many_if_expired(bulk_items, now=later)
    assert again[bulk_items[0][0]] == ReleaseOutcome.ALREADY_HANDLED
    assert services.seat_conservation_violations() == []


def test_a_batch_message_keeps_each_holds_key_and_rejects_bad_items_alone():
    now = timezone.now()
    raw = build_batch([(1, 1, now), (2, 3, now)], shard=0, trace_id="t")
    raw["items"].append({"reservation_id": "x", "version": 1})
    batch = validate_batch(raw)
    assert [m.idempotency_key for m in batch.items] == ["release:1:1", "release:2:3"]
    assert len(batch.rejected) == 1
    assert "must be an integer" in batch.rejected[0][1]


def test_a_batch_without_items_is_malformed():
    raw = build_batch([], shard=0, trace_id="t")
    try:
        validate_batch(raw)
    except MalformedMessage as exc:
        assert "items" in str(exc)
    else:
        raise AssertionError("an empty batch must be malformed")


@pytest.mark.django_db(transaction=True)
def test_every_malformed_item_of_a_batch_is_dead_lettered_and_the_valid_ones_released(broker):
    # given: a batch of two expired holds and three malformed items
    from cleanup.models import DeadLetter
    from cleanup.tasks import release_batch_task
    from tools.seed import seed_holds

    ids = seed_holds(2, offerings=1, expires_in=-60.0, name="mixed-batch")
    raw = build_batch([(rid, 1, timezone.now()) for rid in ids], shard=0, trace_id="mixed")
    raw["items"] += [
        {"reservation_id": "x", "version": 1},
        {"reservation_id": 7, "version": True},
        "not an object",
    ]
    # when: a worker runs it
    release_batch_task.push_request(id="task-mixed", retries=0)
    try:
        result = release_batch_task(raw)
    finally:
        release_batch_task.pop_request()
    # then: one malformed letter per bad item, none for the good ones, which are released
    assert result == {"outcomes": {"released": 2}, "rejected": 3}
    letters = DeadLetter.objects.filter(reason="malformed").order_by("pk")
    assert [(d.task_id, d.trace_id) for d in letters] == [("task-mixed", "mixed")] * 3
    assert [d.error for d in letters] == [
        "field 'reservation_id' must be an integer, got str",
        "field 'version' must be an integer, got bool",
        "item must be a JSON object, got str",
    ]


@pytest.mark.django_db(transaction=True)
def test_a_one_hold_message_and_a_batch_log_their_attempt_lines(broker, caplog):
    # given: two expired holds, one sent alone and one in a batch
    import logging

    from cleanup.release.messages import build
    from cleanup.tasks import release_batch_task, release_reservation_task
    from tools.seed import seed_holds

    alone, batched = seed_holds(2, offerings=1, expires_in=-60.0, name="lines")
    expires_at = timezone.now()
    caplog.set_level(logging.INFO, logger="cleanup.tasks")
    # when: a worker runs each
    results = []
    for task, message in (
        (release_reservation_task, build(alone, 1, expires_at, 0, "one")),
        (release_batch_task, build_batch([(batched, 1, expires_at)], 0, "many")),
    ):
        task.push_request(id=f"task-{message['trace_id']}", retries=1)
        try:
            results.append(task(message))
        finally:
            task.pop_request()
    # then: each returns and logs what operators and the tests read
    assert results == [
        {"outcome": "released", "reservation_id": alone},
        {"outcomes": {"released": 1}, "rejected": 0},
    ]
    one, many = (r for r in caplog.records if r.name == "cleanup.tasks")
    assert one.getMessage() == "release attempt"
    assert {k: getattr(one, k) for k in ("reservation_id", "version", "expires_at")} == {
        "reservation_id": alone,
        "version": 1,
        "expires_at": expires_at.isoformat(),
    }
    assert (one.attempt, one.outcome, one.trace_id, one.task_id) == (  # type: ignore[attr-defined]
        2,
        "released",
        "one",
        "task-one",
    )
    assert one.queue_age_s is None and one.duration_ms > 0  # type: ignore[attr-defined]
    assert many.getMessage() == "release batch attempt"
    assert {k: getattr(many, k) for k in ("holds", "rejected", "attempt", "outcomes")} == {
        "holds": 1,
        "rejected": 0,
        "attempt": 2,
        "outcomes": {"released": 1},
    }
    assert many.holds_by_outcome == {"released": [batched]}  # type: ignore[attr-defined]
    assert (many.trace_id, many.task_id, many.queue_age_s) == ("many", "task-many", None)  # type: ignore[attr-defined]
    assert many.duration_ms > 0  # type: ignore[attr-defined]


# --- the batch task, as a worker runs it -------------------------------------------------------


def _expired_holds(offering_id: int, count: int, prefix: str) -> list[tuple[int, int, datetime]]:
    """``count`` holds on the offering, expired a minute ago: (id, version, expiry) for
    ``build_batch``."""
    held = [services.hold_seat(offering_id, f"{prefix}{i}", 60).pk for i in range(count)]
    expire(*held)
    return [
        (hold.pk, hold.version, hold.expires_at)
        for hold in Reservation.objects.filter(pk__in=held).order_by("pk")
    ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("broker")
def test_a_batch_dead_letters_every_malformed_hold_and_releases_the_others(run_task):
    # given: a batch message of two good holds with three malformed items between them
    offering = services.create_offering("mixed batch", 2)
    good = _expired_holds(offering.pk, 2, "good")
    message = build_batch(good, shard=0, trace_id="mixed-batch")
    first, last = message["items"]
    malformed = [
        {**first, "reservation_id": "hold-seven"},  # not an integer
        {"reservation_id": 424242, "version": 1},  # no expiry, no key
        "not-an-object",
    ]
    message["items"] = [first, *malformed, last]
    # when: a worker runs it
    result = run_task(RELEASE_BATCH_TASK, message, task_id="mixed-batch-task")
    # then: one dead letter per malformed item, each keeping that item and naming its hold
    # where it has one; the good holds are released
    assert result == {"outcomes": {"released": 2}, "rejected": 3}
    letters = list(DeadLetter.objects.order_by("pk"))
    assert [(d.reason, d.task_name, d.task_id) for d in letters] == [
        ("malformed", RELEASE_BATCH_TASK, "mixed-batch-task")
    ] * 3
    wrong_type, incomplete, not_an_object = letters
    assert "hold-seven" in wrong_type.payload and "must be an integer" in wrong_type.error
    assert incomplete.reservation_id == 424242 and "424242" in incomplete.payload
    assert "not-an-object" in not_an_object.payload
    assert {h.status for h in Reservation.objects.filter(offering=offering)} == {"released"}


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("broker")
def test_a_batch_gives_back_one_seat_per_released_hold_of_each_offering(run_task):
    # given: two offerings of 5 seats; on the first 4 holds (3 expired) and a confirmed one,
    # on the second 2 expired holds; one batch message for the five expired holds
    crowded = services.create_offering("crowded", 5)
    other = services.create_offering("other", 5)
    confirmed = services.hold_seat(crowded.pk, "keeps", 600)
    services.confirm(confirmed.pk, confirmed.version)
    services.hold_seat(crowded.pk, "still-held", 600)
    expired = _expired_holds(crowded.pk, 3, "gone") + _expired_holds(other.pk, 2, "gone")
    # when
    result = run_task(RELEASE_BATCH_TASK, build_batch(expired, shard=0, trace_id="seats"))
    # then: five released, three seats back on the first offering and two on the second
    assert result == {"outcomes": {"released": 5}, "rejected": 0}
    seats = {o: services.availability(o.pk) for o in (crowded, other)}
    assert {
        o.name: (s["seats_available"], s["held"], s["confirmed"]) for o, s in seats.items()
    } == {"crowded": (3, 1, 1), "other": (5, 0, 0)}
    for s in seats.values():
        assert s["capacity"] == s["seats_available"] + s["held"] + s["confirmed"]
    assert services.seat_conservation_violations() == []
