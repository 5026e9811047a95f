"""The per-reservation hot path's shortcuts keep their guarantees: a first delivery is not
counted but a redelivery or a retry is (and the cap still counts the first); attempts are
tallied per hold; the release statement runs prepared, with a generic plan."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection

from cleanup.conf import cleanup_settings
from cleanup.models import DeadLetter
from cleanup.release import delivery_cap
from cleanup.release.messages import build, validate
from cleanup.release.release import Attempt, release
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


def test_a_first_delivery_is_not_counted_and_makes_no_round_trip(settings: Any) -> None:
    settings.CLEANUP_COUNTER_REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens: any use fails
    task: Any = release_reservation_task
    task.push_request(id="first", delivery_info={"redelivered": False}, retries=0)
    try:
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


def _envelope(message: dict[str, Any]) -> dict[str, Any]:
    import base64
    import json

    body = json.dumps([[message], {}, None]).encode()
    return {
        "body": base64.b64encode(body).decode(),
        "headers": {"id": uuid.uuid4().hex, "task": "cleanup.release_reservation"},
    }


def test_release_attempts_are_tallied_per_hold_and_reach_redis_within_seconds(
    settings: Any,
) -> None:
    assert settings.CLEANUP_COUNTER_REDIS_URL, "the tally lives in the counter's Redis"
    minute = delivery_cap.current_minute()
    delivery_cap.flush_tally()
    before = delivery_cap.attempts_from(minute)
    # when: three attempts are tallied, and nothing flushes them by hand
    delivery_cap.tally(3)
    # then: the process's flush thread adds them within a few seconds
    deadline = time.monotonic() + 5
    while delivery_cap.attempts_from(minute) - before < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert delivery_cap.attempts_from(minute) - before == 3


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


def test_the_release_statement_runs_prepared_with_a_generic_plan() -> None:
    connection.close()  # a new connection, set up as the workers' are
    assert _release_three() == ["released"] * 3
    [(statement, generic, custom)] = _prepared()
    assert "INSERT INTO cleanup_cleanupreceipt" in statement
    assert (generic, custom) == (3, 0)


def test_without_prepared_statements_the_release_is_the_same(settings: Any) -> None:
    settings.DATABASE_PREPARED_STATEMENTS = False
    connection.close()
    assert _release_three() == ["released"] * 3
    assert _prepared() == []


def test_timestamps_load_through_psycopgs_own_loader_and_infinity_still_loads() -> None:
    """Every timestamptz a query returns goes through ``common.db``'s loader (the sweep's
    claim reads 500 at a time): finite values through psycopg's own loader (its C one where
    psycopg-binary is installed: a Python subclass parsed each value in Python, ~40x slower),
    ±infinity as datetime.max/min, every value in UTC."""
    import importlib.util

    import psycopg

    from common import db

    with connection.cursor() as cur:
        cur.execute(
            "SELECT 'infinity'::timestamptz, '-infinity'::timestamptz, "
            "'2026-01-02 03:04:05.123456+02'::timestamptz"
        )
        values = cur.fetchone()
    assert values == (
        datetime.max.replace(tzinfo=UTC),
        datetime.min.replace(tzinfo=UTC),
        datetime(2026, 1, 2, 1, 4, 5, 123456, tzinfo=UTC),
    )
    assert all(value.tzinfo is UTC for value in values)
    loader = connection.connection.adapters.get_loader(
        psycopg.adapters.types["timestamptz"].oid, psycopg.pq.Format.TEXT
    )
    assert loader is db.InfinityTimestamptzLoader
    if importlib.util.find_spec("psycopg_binary") or importlib.util.find_spec("psycopg_c"):
        assert db._FINITE_LOADER is not None
        assert db._FINITE_LOADER.__module__.startswith(("psycopg_binary", "psycopg_c"))
