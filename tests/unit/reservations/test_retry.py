"""Paths that decide what a learner or an operator sees when PostgreSQL misbehaves: the API's
transient errors (serialization failure, a raced conditional update) and non-transient ones,
``/readyz`` with the database gone, ``hold_seat``'s reclaim cap, and which dead letters a
periodic task's success settles.

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
from reservations.models import Offering, OutboxEvent, Reservation
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
    assert response.json()["error"]["code"] == "temporarily_unavailable"
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
def test_a_non_transient_database_error_is_not_retried_and_not_a_503(offering, sqlstate, error):
    client = Client(raise_request_exception=True)
    with failing("INSERT", "TRUE", sqlstate, times=100) as fired:
        with pytest.raises(error):
            post(client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": "x"})
        attempts = fired()
    assert attempts == 1
    assert not Reservation.objects.exists()


# --- /readyz with the database gone ---------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_readyz_is_503_while_the_database_is_unreachable_and_recovers(client, settings):
    # a metrics reader (the token) sees which check failed; anyone else sees only the status
    settings.METRICS_TOKEN = "r" * 40
    client.defaults["HTTP_AUTHORIZATION"] = "Bearer " + "r" * 40
    assert client.get("/readyz").status_code == 200
    # when: the server ends this process's session (a restart, a failover, an admin)
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        pid = cur.fetchone()[0]
    other = connection.copy()
    try:
        with other.cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [pid])
    finally:
        other.close()
    # then: not ready, naming the database
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["ready"] is False
    assert body["checks"]["database"]["ok"] is False
    assert body["checks"]["database"]["error"].split(":")[0] in {
        "OperationalError",
        "InterfaceError",
    }
    assert body["checks"]["broker"]["ok"] is True
    # and the broken handle is not reused: the next request reconnects and is ready
    assert client.get("/readyz").status_code == 200
    # when: the database cannot be reached at all (nothing listens on its port)
    real_port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = "9"
    try:
        response = client.get("/readyz")
    finally:
        connection.close()
        connection.settings_dict["PORT"] = real_port
    assert response.status_code == 503
    assert response.json()["checks"]["database"]["ok"] is False
    assert client.get("/readyz").status_code == 200


# --- hold_seat's reclaim cap ----------------------------------------------------------------


@pytest.mark.django_db
def test_a_full_offering_reclaims_at_most_the_cap_of_eligible_holds_per_request():
    # given: a full offering whose holds are all eligible, more of them than the cap
    extra = 10
    capacity = services.RECLAIM_LIMIT + extra
    offering = services.create_offering("reclaim-cap", capacity=capacity)
    held = [services.hold_seat(offering.pk, f"l{i}", 60).pk for i in range(capacity)]
    expire(*held)
    # when: one learner asks for a seat
    new = services.hold_seat(offering.pk, "newcomer", 60)
    # then: exactly the cap was released (the lowest ids: the lock order), one went to the
    # newcomer, the rest stay free; the other eligible holds are left to the cleanup
    released = sorted(
        Reservation.objects.filter(pk__in=held, status="released").values_list("pk", flat=True)
    )
    assert released == sorted(held)[: services.RECLAIM_LIMIT]
    assert Reservation.objects.filter(pk__in=held, status="held").count() == extra
    assert set(
        OutboxEvent.objects.filter(kind="reservation.released").values_list(
            "payload__reason", flat=True
        )
    ) == {"reclaimed"}
    assert OutboxEvent.objects.filter(kind="reservation.released").count() == len(released)
    assert Offering.objects.get(pk=offering.pk).seats_available == services.RECLAIM_LIMIT - 1
    assert new.status == "held"
    assert services.seat_conservation_violations() == []


# --- a periodic task's letters: settled by the next success of the same run -----------------


@pytest.mark.django_db
def test_a_periodic_success_settles_only_the_letters_of_the_same_run() -> None:
    from cleanup.models import DeadLetter
    from cleanup.operations import triage
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
    assert dead_letters.settle_periodic(shard0) == 2
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
