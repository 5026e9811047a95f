"""The delivery policy of the cleanup's tasks (cleanup.release.delivery): a first delivery is not
counted but a redelivery or a retry is (and the cap still counts the first), the last delivery
the cap allows runs and the next is dead-lettered, and on quorum queues the broker's own
delivery count saves the round trip."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release import delivery_cap
from cleanup.release.messages import build, validate
from cleanup.tasks import release_reservation_task
from reservations.models import Reservation
from tools.seed import seed_holds

pytestmark = pytest.mark.django_db(transaction=True)


def _count(delivery_info: dict[str, Any], retries: int) -> tuple[int, int]:
    """(the delivery's number, the counter after it) for one delivery of a fresh key."""
    key = f"release:{uuid.uuid4().int % 10**9}:1"
    message = {"idempotency_key": key}
    task: Any = release_reservation_task
    task.push_request(id=uuid.uuid4().hex, delivery_info=delivery_info, retries=retries)
    try:
        task.delivery_key = lambda args, kwargs: key
        number = task.count_delivery((message,), {})
    finally:
        del task.delivery_key
        task.pop_request()
    return number, delivery_cap.current(key)


def test_a_first_delivery_is_not_counted_and_makes_no_round_trip(
    django_assert_num_queries: Any,
) -> None:
    task: Any = release_reservation_task
    task.push_request(id="first", delivery_info={"redelivered": False}, retries=0)
    try:
        with django_assert_num_queries(0):
            assert task.count_delivery(({},), {}) == 1
    finally:
        task.pop_request()


@pytest.mark.parametrize(
    ("delivery_info", "retries"), [({"redelivered": True}, 0), ({}, 1), ({"redelivered": True}, 2)]
)
def test_a_message_that_only_says_it_is_a_redelivery_or_a_retry_spends_nothing(
    delivery_info: dict[str, Any], retries: int
) -> None:
    """On Redis the mark is whatever the publisher wrote: eight forged "redelivered" messages
    for a real hold's key used to spend its whole budget, and its genuine redelivery after a
    crash was then dead-lettered. The count is read, not raised."""
    assert _count(delivery_info, retries) == (1, 0)


def test_a_redelivery_counts_where_it_is_restored_and_the_cap_counts_the_first() -> None:
    # given: a message kombu's Redis transport has just restored (after a crash, say)
    hold = seed_holds(1, offerings=1, expires_in=-60, name="restored")[0]
    message = build(hold, 1, datetime.now(UTC), 0, "t")
    key = validate(message).idempotency_key
    envelope = _envelope(message)
    delivery_cap.count_restored(envelope)
    # when: it arrives, marked as a redelivery
    task: Any = release_reservation_task
    task.push_request(id=envelope["headers"]["id"], delivery_info={"redelivered": True}, retries=0)
    try:
        number = task.count_delivery((message,), {})
    finally:
        task.pop_request()
    # then: its second delivery, counted once
    assert (number, delivery_cap.current(key)) == (2, 1)


def test_on_rabbitmq_the_brokers_redelivered_flag_is_counted_as_it_arrives(settings: Any) -> None:
    """RabbitMQ sets ``redelivered`` in the delivery itself (no publisher can): counted."""
    settings.BROKER_IS_REDIS = False
    assert _count({"redelivered": True}, 0) == (2, 1)


def _redeliver(hold: int, earlier_redeliveries: int) -> dict[str, Any]:
    """Run the release task as a worker runs a Redis redelivery of ``hold``'s message, after
    ``earlier_redeliveries`` counted ones (kombu's restores count them as they happen)."""
    message = build(hold, 1, datetime.now(UTC), 0, "cap")
    key = validate(message).idempotency_key
    for _ in range(earlier_redeliveries):
        delivery_cap.increment(key)
    task: Any = release_reservation_task
    task.push_request(
        id=uuid.uuid4().hex,
        delivery_info={"redelivered": True},
        retries=0,
        called_directly=False,
        is_eager=False,
    )
    try:
        result: dict[str, Any] = task(message)
    finally:
        task.pop_request()
    return result


@pytest.mark.usefixtures("broker")  # the delivery counter lives there: empty at the start
def test_the_last_delivery_the_cap_allows_runs_and_the_next_is_dead_lettered(
    settings: Any,
) -> None:
    # given: two expired holds whose messages were redelivered again and again; one is on its
    # last allowed delivery (CLEANUP_MAX_DELIVERIES), the other one past it
    settings.BROKER_IS_REDIS = True
    cap = cleanup_settings().max_deliveries
    last_allowed, past_the_cap = seed_holds(2, offerings=1, expires_in=-60, name="cap")
    # when: each is delivered once more
    allowed = _redeliver(last_allowed, earlier_redeliveries=cap - 1)
    refused = _redeliver(past_the_cap, earlier_redeliveries=cap)
    # then: the delivery the cap allows releases its hold
    assert allowed == {"outcome": "released", "reservation_id": last_allowed}
    assert Reservation.objects.get(pk=last_allowed).status == "released"
    # and the one past it is dead-lettered instead, its hold untouched
    assert refused == {"outcome": "dead_lettered"}
    assert Reservation.objects.get(pk=past_the_cap).status == "held"
    letters = DeadLetter.objects.filter(reason=DeadLetter.Reason.DELIVERIES_EXHAUSTED)
    assert list(letters.values_list("reservation_id", "delivery_count")) == [
        (past_the_cap, cap + 1)
    ]


def _envelope(message: dict[str, Any], signed: bool = True) -> dict[str, Any]:
    import base64

    from cleanup.broker import signing

    body = json.dumps([[message], {}, None]).encode()
    task_id, name = uuid.uuid4().hex, "cleanup.release_reservation"
    headers = {"id": task_id, "task": name}
    if signed:
        headers.update(signing.signed_headers(task_id, name, [message], {}))
    return {"body": base64.b64encode(body).decode(), "headers": headers}


def test_a_restored_message_the_project_did_not_sign_is_not_counted() -> None:
    # given: entries planted in kombu's unacked hash with a real hold's key: unsigned, or
    # signed for other arguments
    hold = seed_holds(1, offerings=1, expires_in=-60, name="planted")[0]
    message = build(hold, 1, datetime.now(UTC), 0, "t")
    key = validate(message).idempotency_key
    forged = _envelope(message, signed=False)
    forged["headers"]["cleanup_signature"] = _envelope(build(hold, 2, datetime.now(UTC), 0, "t"))[
        "headers"
    ]["cleanup_signature"]
    # when: the restore brings them back
    delivery_cap.count_restored(_envelope(message, signed=False))
    delivery_cap.count_restored(forged)
    # then: nothing is counted against the hold
    assert delivery_cap.current(key) == 0


def test_another_tasks_restored_message_counts_under_its_own_id_whatever_it_carries() -> None:
    # given: another task's message (any task loops as a release can) carrying a hold's message
    hold = seed_holds(1, offerings=1, expires_in=-60, name="other task")[0]
    message = build(hold, 1, datetime.now(UTC), 0, "t")
    envelope = _envelope(message, signed=False)
    envelope["headers"]["task"] = "cleanup.sweep_shard"
    # when: the restore brings it back
    delivery_cap.count_restored(envelope)
    # then: its own loop is bounded, and the hold's budget is untouched
    assert delivery_cap.current(f"task:{envelope['headers']['id']}") == 1
    assert delivery_cap.current(validate(message).idempotency_key) == 0


# --- on quorum queues: the broker's own delivery count ----------------------------------------


@pytest.fixture
def counter_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def increment(key: str) -> int:
        calls.append(f"increment {key}")
        return 10

    def current(key: str) -> int:
        calls.append(f"current {key}")
        return 2

    monkeypatch.setattr(delivery_cap, "increment", increment)
    monkeypatch.setattr(delivery_cap, "current", current)
    return calls


def _count_delivery(task: Any, retries: int, **headers: Any) -> int:
    message = build(41, 1, datetime(2026, 1, 1, tzinfo=UTC), 0, "trace")
    task.push_request(
        id="t1", retries=retries, delivery_info={"redelivered": True}, called_directly=False,
        **headers,
    )  # fmt: skip
    try:
        return int(task.count_delivery((message,), {}))
    finally:
        task.pop_request()


def test_a_quorum_redelivery_is_counted_by_the_broker_without_a_round_trip(
    settings: Any, counter_calls: list[str]
) -> None:
    from cleanup.tasks import release_reservation_task as task

    settings.BROKER_IS_REDIS = False  # RabbitMQ: a redelivery is counted where it arrives
    settings.CLEANUP_RABBITMQ_QUEUE_TYPE = "quorum"
    headers = {"x-delivery-count": 3}
    # the broker's 3 earlier deliveries, and this one
    assert _count_delivery(task, 0, **headers) == 4
    assert counter_calls == []
    # a retry's redelivery: the retries counted under its key (2) + the broker's 3 + this one
    assert _count_delivery(task, 1, **headers) == 6
    assert counter_calls == ["current release:41:1"]
    # without the broker's header (or on classic queues) the redelivery is counted as before
    counter_calls.clear()
    assert _count_delivery(task, 0) == 11
    settings.CLEANUP_RABBITMQ_QUEUE_TYPE = "classic"
    assert _count_delivery(task, 0, **headers) == 11
    assert counter_calls == ["increment release:41:1", "increment release:41:1"]
