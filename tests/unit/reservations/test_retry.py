"""Transient database errors and the retry after one (reservations.retry), through the API: a
serialization failure, a real deadlock and a raced conditional update are retried and the seat
taken once; a persistent one is a 503 with Retry-After that changes nothing; a non-transient
error is never retried.

Database errors are raised by PostgreSQL itself (a trigger raising the real SQLSTATE), so the
product sees exactly what the driver gives it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import OperationalError, ProgrammingError, connection
from django.test import Client

from reservations import api, services
from reservations.models import OutboxEvent, Reservation
from reservations.retry import TRANSIENT_ATTEMPTS
from tests.support.api import AUTH
from tests.support.holds import expire

pytestmark = pytest.mark.usefixtures("api_token")


def post(client: Client, url: str, body: Any) -> Any:
    return client.post(url, data=json.dumps(body), content_type="application/json", headers=AUTH)


@contextmanager
def failing(event: str, when: str, sqlstate: str, times: int) -> Iterator[Any]:
    """A trigger on reservations_reservation raising ``sqlstate`` on its first ``times`` firings;
    yields a function returning how often it fired."""
    with connection.cursor() as cur:
        cur.execute("CREATE SEQUENCE failure_paths_fired")
        cur.execute(
            f"""
            CREATE FUNCTION failure_paths_fail() RETURNS trigger AS $$
            BEGIN
              IF nextval('failure_paths_fired') <= {int(times)} THEN
                RAISE EXCEPTION 'injected %', '{sqlstate}' USING ERRCODE = '{sqlstate}';
              END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER failure_paths_fail BEFORE {event} ON reservations_reservation
              FOR EACH ROW WHEN ({when}) EXECUTE FUNCTION failure_paths_fail();
            """
        )

    def fired() -> int:
        with connection.cursor() as cur:
            cur.execute("SELECT last_value, is_called FROM failure_paths_fired")
            value, called = cur.fetchone()
            return int(value) if called else 0

    try:
        yield fired
    finally:
        with connection.cursor() as cur:
            cur.execute(
                "DROP TRIGGER IF EXISTS failure_paths_fail ON reservations_reservation; "
                "DROP FUNCTION IF EXISTS failure_paths_fail(); "
                "DROP SEQUENCE IF EXISTS failure_paths_fired"
            )


# --- the API's transient and non-transient errors -------------------------------------------


@pytest.mark.django_db
def test_a_serialization_failure_is_retried_and_the_hold_is_taken_once(client, offering):
    with failing("INSERT", "TRUE", "40001", times=1) as fired:
        response = post(client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": "x"})
        attempts = fired()
    assert response.status_code == 201, response.content
    assert attempts == 2
    assert Reservation.objects.count() == 1
    assert OutboxEvent.objects.filter(kind="reservation.held").count() == 1
    offering.refresh_from_db()
    assert offering.seats_available == offering.capacity - 1


@pytest.mark.django_db
@pytest.mark.parametrize("sqlstate", ["40001", "40P01"], ids=["serialization failure", "deadlock"])
def test_a_persistent_transient_failure_is_a_503_with_retry_after_and_changes_nothing(
    client, offering, sqlstate
):
    hold = services.hold_seat(offering.pk, "learner")
    with failing("UPDATE", "NEW.status = 'confirmed'", sqlstate, times=100) as fired:
        response = post(client, f"/api/v1/holds/{hold.pk}/confirm", {"expected_version": 1})
        attempts = fired()
    assert response.status_code == 503
    assert response.json()["code"] == "temporarily_unavailable"
    assert response["Retry-After"] == str(api.RETRY_AFTER_SECONDS)
    assert attempts == TRANSIENT_ATTEMPTS
    hold.refresh_from_db()
    assert (hold.status, hold.version) == ("held", 1)
    assert not OutboxEvent.objects.filter(kind="reservation.confirmed").exists()


@pytest.mark.django_db(transaction=True)
def test_a_real_deadlock_is_retried_and_the_seat_is_taken_once(client, caplog):
    """Two real sessions take the same two locks in opposite orders; PostgreSQL detects the
    deadlock, aborts the API's transaction (40P01), and the API runs it again."""
    from tests.support.fleet import conninfo

    # given: a full offering whose one hold has expired, so a new hold locks the offering and
    # then that hold, to reclaim it (offerings before reservations)
    offering = services.create_offering("deadlock", capacity=1)
    stale = services.hold_seat(offering.pk, "stale", ttl_seconds=60)
    expire(stale, due=False)
    # and a rogue session holding that hold's row, which then wants the offering: it waits
    # far longer before checking for a deadlock, so the API's session (1 s) is the one
    # PostgreSQL aborts
    rogue = psycopg.connect(conninfo())
    watcher = psycopg.connect(conninfo(), autocommit=True)
    rogue.execute("SET deadlock_timeout = '60s'")
    rogue.execute("SELECT id FROM reservations_reservation WHERE id = %s FOR UPDATE", [stale.pk])
    rogue_pid = rogue.info.backend_pid
    errors: list[BaseException] = []

    def rogue_takes_the_offering() -> None:
        try:
            deadline = time.monotonic() + 30
            while not watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> %s",
                [rogue_pid],
            ).fetchone()[0]:  # type: ignore[index]
                assert time.monotonic() < deadline, "the API never waited for the hold's row"
                time.sleep(0.02)
            rogue.execute(
                "SELECT id FROM reservations_offering WHERE id = %s FOR UPDATE", [offering.pk]
            )
            rogue.commit()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            rogue.rollback()

    thread = threading.Thread(target=rogue_takes_the_offering)
    thread.start()
    try:
        # when
        with caplog.at_level("WARNING", logger="reservations.retry"):
            response = post(client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": "x"})
    finally:
        thread.join(60)
        rogue.close()
        watcher.close()
    # then: the API's first attempt was the deadlock's victim, and the second took the seat
    assert errors == []
    retried = [r for r in caplog.records if r.getMessage() == "transient database error, retrying"]
    assert [getattr(r, "error", None) for r in retried] == ["DeadlockDetected"]
    assert response.status_code == 201, response.content
    stale.refresh_from_db()
    assert stale.status == "released"
    assert Reservation.objects.filter(offering=offering, status="held").count() == 1
    assert OutboxEvent.objects.filter(kind="reservation.released").count() == 1
    offering.refresh_from_db()
    assert offering.seats_available == 0


@pytest.mark.django_db
def test_a_raced_conditional_update_is_retried(client, offering, monkeypatch):
    # TransientConflict is what the services raise when a row changed between a conditional
    # update and the re-read that explains it; the API retries it like a deadlock.
    real = services.renew
    calls: list[int] = []

    def raced_once(*args: Any, **kwargs: Any) -> Reservation:
        calls.append(1)
        if len(calls) == 1:
            raise services.TransientConflict("changed during renew")
        return real(*args, **kwargs)

    monkeypatch.setattr(services, "renew", raced_once)
    hold = services.hold_seat(offering.pk, "learner")
    response = post(client, f"/api/v1/holds/{hold.pk}/renew", {"expected_version": 1})
    assert response.status_code == 200, response.content
    assert response.json()["version"] == 2
    assert len(calls) == 2


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("sqlstate", "error"),
    [
        ("57014", OperationalError),  # query_canceled (a statement timeout): not transient
        ("P0001", ProgrammingError),  # raise_exception: a bug, not contention
    ],
)
def test_a_non_transient_database_error_is_not_retried_and_not_a_503(
    offering, sqlstate, error, caplog
):
    client = Client(raise_request_exception=True)
    with failing("INSERT", "TRUE", sqlstate, times=100) as fired:
        response = post(client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": "x"})
        attempts = fired()
    assert attempts == 1
    assert not Reservation.objects.exists()
    # a 500 problem (never Django's HTML page), with the error and its traceback in the log
    assert response.status_code == 500
    assert response.json()["code"] == "internal_error"
    (logged,) = [r for r in caplog.records if r.message == "unhandled error in an API request"]
    assert logged.exc_info is not None and logged.exc_info[0] is error


def test_a_non_transient_operational_error_is_not_retried(offering, monkeypatch):
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Reservation:
        calls.append(1)
        raise OperationalError("server closed the connection")

    with pytest.raises(OperationalError):
        api.call_with_retries(broken)
    assert len(calls) == 1
