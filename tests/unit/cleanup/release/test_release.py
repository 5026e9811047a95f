"""Handling release messages (cleanup.release.release), as a worker runs the tasks: a batch decides
every hold as the per-reservation mode would, dead-letters its malformed items and failures hold
by hold, gives back one seat per released hold and logs one attempt line per hold; receipts
never block a real release; the release statement runs prepared, with a generic plan."""

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from cleanup.models import CleanupReceipt, DeadLetter
from cleanup.release import dead_letters
from cleanup.release.messages import (
    ReleaseMessage,
    build,
    build_batch,
    validate,
)
from cleanup.release.publish import RELEASE_BATCH_TASK
from cleanup.release.release import Attempt, release, release_batch
from cleanup.tasks import release_reservation_task
from reservations import services
from reservations.models import Reservation
from tests.support.holds import expire, seed_expired
from tools.seed import seed_holds


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
    from cleanup.tasks import release_batch_task
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


@pytest.mark.django_db(transaction=True)
def test_a_batch_locks_only_the_offerings_of_the_group_it_is_releasing(other_session) -> None:
    # given: a message of 200 expired holds in offering order (as the sweep sends them), the
    # first 100 on offering A, the next 100 on B, while another transaction holds B's row (as a
    # concurrent release of B's holds would)
    from django.db import OperationalError

    group = 100  # the holds per statement (cleanup.release.release.STATEMENT_HOLDS)
    ids = seed_holds(2 * group, offerings=2, expires_in=-60.0, name="grouped")
    on = dict(Reservation.objects.filter(pk__in=ids).values_list("pk", "offering_id"))
    a, b = on[ids[0]], on[ids[-1]]
    assert [on[i] for i in ids] == [a] * group + [b] * group
    message = [_message(rid) for rid in ids]
    attempt = Attempt(1, "w", "task-grouped", None)
    with other_session.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("SELECT 1 FROM reservations_offering WHERE id = %s FOR UPDATE", [b])
    try:
        with connection.cursor() as cur:
            cur.execute("SET lock_timeout = '300ms'")
        # when: a worker releases the message
        with pytest.raises(OperationalError, match="lock timeout"):
            release_batch(message, attempt)
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET lock_timeout")
        with other_session.cursor() as cur:
            cur.execute("ROLLBACK")
    # then: A's holds were released with their seats and receipts before the wait on B
    # (one statement for the whole message waited on B before releasing anything)
    status = dict(Reservation.objects.filter(pk__in=ids).values_list("pk", "status"))
    assert {rid: status[rid] for rid in ids[:group]} == dict.fromkeys(ids[:group], "released")
    assert {status[rid] for rid in ids[group:]} == {"held"}
    assert CleanupReceipt.objects.filter(reservation_id__in=ids).count() == group
    assert services.seat_conservation_violations() == []
    # and the message's redelivery releases the rest, each hold once
    outcomes = release_batch(message, Attempt(2, "w", "task-grouped", None))
    assert sorted(outcomes.values()) == ["already_handled"] * group + ["released"] * group
    assert set(Reservation.objects.filter(pk__in=ids).values_list("status", flat=True)) == {
        "released"
    }
    assert services.seat_conservation_violations() == []


# --- receipts never block a real release ------------------------------------------------------


def _message(hold_id: int, version: int = 1) -> ReleaseMessage:
    return validate(build(hold_id, version, timezone.now() - timedelta(minutes=1), 0, "t"))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["single", "batch"])
def test_a_message_for_a_hold_that_does_not_exist_yet_never_blocks_its_release(path) -> None:
    # given: a message naming the id the next hold will get, handled before the hold exists
    offering = services.create_offering("future", 2)
    first = services.hold_seat(offering.pk, "a", 60)
    future_id = first.pk + 1
    attempt = Attempt(1, "w@h", "task-1", 0.1)

    def handle() -> str:
        message = _message(future_id)
        if path == "single":
            return release(message, attempt)  # type: ignore[arg-type]
        return release_batch([message], attempt)[future_id]  # type: ignore[list-item]

    assert handle() == "not_found"
    # when: that hold is created, expires, and its release message comes
    later = services.hold_seat(offering.pk, "b", 60)
    assert later.pk == future_id
    expire(later.pk, due=False)
    # then: it is released, with exactly one 'released' receipt
    assert handle() == "released"
    assert Reservation.objects.get(pk=later.pk).status == "released"
    receipts = list(CleanupReceipt.objects.filter(reservation_id=future_id))
    assert [(r.idempotency_key, r.outcome) for r in receipts] == [
        (f"release:{future_id}:1", "released")
    ]
    offering.refresh_from_db()
    assert offering.seats_available == 1  # one seat back, one still held by the first hold
    assert handle() == "already_handled"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["single", "batch"])
def test_an_old_non_released_receipt_for_the_key_is_replaced_by_the_release(path) -> None:
    # given: a not_found receipt an older version wrote for a key whose hold now expired
    offering = services.create_offering("legacy", 1)
    hold = services.hold_seat(offering.pk, "a", 60)
    expire(hold.pk, due=False)
    CleanupReceipt.objects.create(
        idempotency_key=f"release:{hold.pk}:1",
        reservation_id=hold.pk,
        version=1,
        outcome="not_found",
    )
    attempt = Attempt(2, "w@h", "task-2", 0.1)
    # when
    if path == "single":
        outcome = release(_message(hold.pk), attempt)  # type: ignore[arg-type]
    else:
        outcome = release_batch([_message(hold.pk)], attempt)[hold.pk]  # type: ignore[list-item]
    # then
    assert outcome == "released"
    receipt = CleanupReceipt.objects.get(idempotency_key=f"release:{hold.pk}:1")
    assert (receipt.outcome, receipt.attempt, receipt.task_id) == ("released", 2, "task-2")
    assert Reservation.objects.get(pk=hold.pk).status == "released"


# --- the release statement, prepared ----------------------------------------------------------


def _prepared() -> list[tuple[str, int, int]]:
    with connection.cursor() as cur:
        cur.execute(
            "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
            "WHERE statement LIKE '%%released_rows%%'"
        )
        return list(cur.fetchall())


def _release_three() -> list[str]:
    ids = seed_holds(3, offerings=1, expires_in=-60.0, name="prepared")
    attempt = Attempt(1, "w", "t", None)
    outcomes = []
    for reservation_id in ids:
        message = build(reservation_id, 1, datetime(2000, 1, 1, tzinfo=UTC), 0, "prepared")
        outcomes.append(release(validate(message), attempt))
    return outcomes


@pytest.mark.django_db(transaction=True)
def test_the_release_statement_runs_prepared_with_a_generic_plan() -> None:
    connection.close()  # a new connection, set up as the workers' are
    assert _release_three() == ["released"] * 3
    [(statement, generic, custom)] = _prepared()
    assert "INSERT INTO cleanup_cleanupreceipt" in statement
    assert (generic, custom) == (3, 0)


@pytest.mark.django_db(transaction=True)
def test_without_prepared_statements_the_release_is_the_same(settings: Any) -> None:
    settings.DATABASE_PREPARED_STATEMENTS = False
    connection.close()
    assert _release_three() == ["released"] * 3
    assert _prepared() == []


# --- a batch's failures and attempt lines, hold by hold ---------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_failed_batch_is_dead_lettered_hold_by_hold_and_each_letter_settles_alone(broker):
    # given: a release batch of three holds that ran out of retries
    from django.db import OperationalError
    from django.utils import timezone

    from cleanup.models import CleanupReceipt, DeadLetter
    from cleanup.release.messages import build_batch
    from cleanup.tasks import release_batch_task

    ids = seed_expired(3, seconds_ago=1, offerings=1)
    message = build_batch([(rid, 1, timezone.now()) for rid in ids], 0, "failed-batch")
    # when: its final failure is dead-lettered (as the task does before acknowledging it)
    release_batch_task.push_request(id="task-1", retries=5)
    try:
        stored = release_batch_task._dead_letter_failure(
            OperationalError("db gone"), (message,), {}
        )
    finally:
        release_batch_task.pop_request()
    assert stored is not None
    # then: one letter per hold, each naming its hold and its key
    letters = list(DeadLetter.objects.order_by("reservation_id"))
    assert [(d.reservation_id, d.version, d.idempotency_key, d.reason) for d in letters] == [
        (rid, 1, f"release:{rid}:1", "retries_exhausted") for rid in sorted(ids)
    ]
    assert {d.task_id for d in letters} == {"task-1"}
    # and a later release of one of the holds settles that hold's letter only
    CleanupReceipt.objects.create(
        idempotency_key=f"release:{ids[0]}:1", reservation_id=ids[0], version=1, outcome="released"
    )
    assert dead_letters.resolve_released() == 1
    assert DeadLetter.objects.filter(resolved_at__isnull=True).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_batch_attempt_log_line_names_each_hold_with_its_outcome(broker, caplog):
    # given: a batch of three expired holds, one of them renewed after its message was built
    from datetime import timedelta

    from django.utils import timezone

    from cleanup.release.messages import build_batch
    from cleanup.tasks import release_batch_task

    ids = seed_expired(3, seconds_ago=1, offerings=1)
    message = build_batch([(rid, 1, timezone.now()) for rid in ids], 0, "named-batch")
    Reservation.objects.filter(pk=ids[1]).update(
        version=2, expires_at=timezone.now() + timedelta(minutes=5)
    )
    caplog.set_level(logging.INFO, logger="cleanup.tasks")
    # when: a worker runs it
    release_batch_task.push_request(id="task-named", retries=0)
    try:
        release_batch_task(message)
    finally:
        release_batch_task.pop_request()
    # then: its log line names which hold ended how, not only the counts
    (line,) = [r for r in caplog.records if r.getMessage() == "release batch attempt"]
    assert line.holds_by_outcome == {  # type: ignore[attr-defined]
        "released": [ids[0], ids[2]],
        "renewed": [ids[1]],
    }
    assert line.outcomes == {"released": 2, "renewed": 1}  # type: ignore[attr-defined]
