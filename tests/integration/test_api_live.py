"""The JSON API behind a real gunicorn (several processes, several threads each) with real
concurrent HTTP requests: what idempotency keys and rate limits do when requests overlap.

To make the overlap certain rather than likely, the test holds the offering's row lock from
its own connection while the requests arrive: the first request under a key takes the key
and then waits for the offering; every other one is then in flight at the same time, and the
test waits until PostgreSQL shows all of them waiting before it lets go.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from reservations import clients, services
from reservations.models import ApiClient, Offering, OutboxEvent, Reservation
from tests.support.fleet import blocked_backends, offering_locked, wait_until
from tests.support.web import Answer, WebServer

pytestmark = [pytest.mark.slow]

# Requests in flight at once. Each gunicorn process has a thread for every one of them: a
# process may accept more connections than the others, and a request waiting for a thread
# would never reach PostgreSQL while the others wait there.
CONCURRENT = 8


@pytest.fixture(autouse=True)
def _no_earlier_requests(clear_rate_limits: None) -> None:
    pass


@pytest.fixture
def web_options() -> dict[str, Any]:
    return {"workers": 2, "threads": CONCURRENT}


def client_token(name: str = "checkout", **fields: Any) -> str:
    fields.setdefault("can_write", True)
    fields.setdefault("all_offerings", True)
    return clients.issue_token(ApiClient.objects.create(name=name, **fields))


def all_at_once(
    web: WebServer, offering: Offering, requests: list[tuple[str, str, Any, dict[str, str]]]
) -> list[Answer]:
    """Send ``requests`` together while the offering is locked; answers in the same order."""
    connections = [web.connection() for _ in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        with offering_locked(offering.pk):
            futures = [
                pool.submit(web.request, method, path, body, headers, conn)
                for (method, path, body, headers), conn in zip(requests, connections, strict=True)
            ]
            # One waits for the offering's lock, every other one for the key's row.
            wait_until(
                lambda: len(blocked_backends()) >= len(requests),
                timeout=30,
                what=f"{len(requests)} requests waiting in PostgreSQL at once",
            )
        answers = [f.result(timeout=60) for f in futures]
    for conn in connections:
        conn.close()
    return answers


def test_simultaneous_requests_under_one_key_hold_one_seat_and_all_get_its_answer(web):
    # given a checkout that sends the same hold several times at once (retries that overlap)
    offering = services.create_offering("live", capacity=CONCURRENT + 2)
    headers = {"Authorization": f"Bearer {client_token()}", "Idempotency-Key": "order-77"}
    body = {"holder": "ann", "ttl_seconds": 120}
    url = f"/api/v1/offerings/{offering.pk}/holds"
    # when
    answers = all_at_once(web, offering, [("POST", url, body, headers)] * CONCURRENT)
    # then every request gets the one hold, and one seat is taken
    assert [a.status for a in answers] == [201] * CONCURRENT, [a.body for a in answers]
    assert len({a.body["id"] for a in answers}) == 1
    assert all(a.body == answers[0].body for a in answers)
    replayed = sorted(a.headers["Idempotent-Replayed"] for a in answers)
    assert replayed == ["false"] + ["true"] * (CONCURRENT - 1)
    assert Reservation.objects.filter(offering=offering).count() == 1
    offering.refresh_from_db()
    assert offering.seats_available == offering.capacity - 1
    assert OutboxEvent.objects.filter(kind="reservation.held").count() == 1


def test_simultaneous_different_requests_under_one_key_make_one_hold_and_refuse_the_rest(web):
    offering = services.create_offering("live", capacity=CONCURRENT + 2)
    token = client_token()
    url = f"/api/v1/offerings/{offering.pk}/holds"
    requests = [
        (
            "POST",
            url,
            {"holder": f"learner-{n}"},
            {"Authorization": f"Bearer {token}", "Idempotency-Key": "same-key"},
        )
        for n in range(CONCURRENT)
    ]
    answers = all_at_once(web, offering, requests)
    statuses = sorted(a.status for a in answers)
    assert statuses == [201] + [422] * (CONCURRENT - 1), [a.body for a in answers]
    refused = [a.body["code"] for a in answers if a.status == 422]
    assert set(refused) == {"idempotency_key_reused"}
    (hold,) = Reservation.objects.filter(offering=offering)
    (winner,) = [a for a in answers if a.status == 201]
    assert hold.pk == winner.body["id"]


def test_simultaneous_requests_under_different_keys_each_hold_a_seat(web):
    # the key serialises requests under one key, not the API
    offering = services.create_offering("live", capacity=CONCURRENT)
    token = client_token()
    url = f"/api/v1/offerings/{offering.pk}/holds"
    requests = [
        (
            "POST",
            url,
            {"holder": "ann"},
            {"Authorization": f"Bearer {token}", "Idempotency-Key": f"k{n}"},
        )
        for n in range(CONCURRENT)
    ]
    answers = [web.request(*r) for r in requests]
    assert [a.status for a in answers] == [201] * CONCURRENT
    offering.refresh_from_db()
    assert offering.seats_available == 0


def test_the_rate_limit_holds_across_gunicorns_processes(web):
    # given a client allowed five requests a minute, and a web of two processes
    offering = services.create_offering("live", capacity=1)
    headers = {"Authorization": f"Bearer {client_token(requests_per_minute=5)}"}
    url = f"/api/v1/offerings/{offering.pk}/availability"
    # when it sends twelve at once
    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda _: web.request("GET", url, None, headers), range(12)))
    # then five are answered, whichever process took them, and seven refused with Retry-After
    statuses = sorted(a.status for a in answers)
    assert statuses == [200] * 5 + [429] * 7
    assert all(1 <= int(a.headers["Retry-After"]) <= 60 for a in answers if a.status == 429)
