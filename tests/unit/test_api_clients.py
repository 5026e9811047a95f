"""API clients and Idempotency-Key, through the JSON API against a real PostgreSQL: what a
client that retries, or a second careless client, sees."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db.models.functions import Now
from django.test import Client

from cleanup.tasks import prune_task
from reservations import clients, idempotency, services
from reservations.models import ApiClient, ApiToken, IdempotencyKey, Offering, Reservation

DEV_TOKEN = "dev-shared-token"

MakeClient = Callable[..., tuple[ApiClient, str]]


@pytest.fixture(autouse=True)
def _settings(settings: Any) -> None:
    settings.RESERVATIONS_API_TOKEN = DEV_TOKEN


@pytest.fixture
def make_client(db: None) -> MakeClient:
    def _make(name: str = "checkout", **fields: Any) -> tuple[ApiClient, str]:
        offerings = fields.pop("offerings", ())
        fields.setdefault("can_write", True)
        fields.setdefault("all_offerings", not offerings)
        client = ApiClient.objects.create(name=name, **fields)
        client.offerings.set(offerings)
        return client, clients.issue_token(client)

    return _make


def call(
    client: Client,
    method: str,
    url: str,
    token: str,
    body: Any = None,
    *,
    key: str | None = None,
    raw: str | None = None,
) -> Any:
    headers = {"Authorization": f"Bearer {token}"}
    if key is not None:
        headers[idempotency.HEADER] = key
    if method == "get":
        return client.get(url, headers=headers)
    data = raw if raw is not None else json.dumps(body)
    return client.post(url, data=data, content_type="application/json", headers=headers)


def hold_url(offering: Offering) -> str:
    return f"/api/v1/offerings/{offering.pk}/holds"


def error_code(response: Any) -> str:
    return str(response.json()["error"]["code"])


def seats_left(offering: Offering) -> int:
    offering.refresh_from_db()
    return offering.seats_available


# --- Idempotency-Key ----------------------------------------------------------------------------


def test_a_retried_hold_under_the_same_key_replays_the_response_and_takes_one_seat(
    client, offering, make_client
):
    # given a checkout that timed out after its first attempt
    _, token = make_client()
    body = {"holder": "ann", "ttl_seconds": 120}
    first = call(client, "post", hold_url(offering), token, body, key="order-1001")
    # when it retries with the same key and request
    retry = call(client, "post", hold_url(offering), token, body, key="order-1001")
    # then it gets the same answer, and the learner holds one seat
    assert first.status_code == retry.status_code == 201
    assert retry.json() == first.json()
    assert retry["Location"] == first["Location"]
    assert first["Idempotent-Replayed"] == "false"
    assert retry["Idempotent-Replayed"] == "true"
    assert Reservation.objects.filter(offering=offering).count() == 1
    assert seats_left(offering) == offering.capacity - 1


def test_the_same_request_spelled_differently_is_still_the_same_request(
    client, offering, make_client
):
    _, token = make_client()
    first = call(
        client, "post", hold_url(offering), token, {"holder": "ann", "ttl_seconds": 60}, key="k"
    )
    again = call(
        client,
        "post",
        hold_url(offering),
        token,
        raw='{ "ttl_seconds" : 60,\n "holder": "ann" }',
        key="k",
    )
    assert again.status_code == 201
    assert again.json()["id"] == first.json()["id"]


def test_a_key_reused_for_a_different_request_is_refused_and_changes_nothing(
    client, offering, make_offering, make_client
):
    # given
    _, token = make_client()
    call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="order-1")
    other = make_offering(name="other")
    # when: another body, then another path, under the same key
    other_body = call(client, "post", hold_url(offering), token, {"holder": "bob"}, key="order-1")
    other_path = call(client, "post", hold_url(other), token, {"holder": "ann"}, key="order-1")
    # then
    for response in (other_body, other_path):
        assert response.status_code == 422, response.content
        assert response.json()["error"] == {
            "code": "idempotency_key_reused",
            "message": response.json()["error"]["message"],
            "field": "Idempotency-Key",
        }
    assert Reservation.objects.count() == 1
    assert seats_left(other) == other.capacity


def test_keys_belong_to_their_client(client, offering, make_client):
    _, first_token = make_client("first")
    _, second_token = make_client("second")
    a = call(client, "post", hold_url(offering), first_token, {"holder": "ann"}, key="shared-key")
    b = call(client, "post", hold_url(offering), second_token, {"holder": "ann"}, key="shared-key")
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] != b.json()["id"]
    assert b["Idempotent-Replayed"] == "false"


def test_the_development_tokens_keys_are_one_scope_of_their_own(client, offering, make_client):
    # the development token has no client row: its keys still meet each other, not a client's
    body = {"holder": "ann"}
    first = call(client, "post", hold_url(offering), DEV_TOKEN, body, key="dev-1")
    retry = call(client, "post", hold_url(offering), DEV_TOKEN, body, key="dev-1")
    _, token = make_client()
    other = call(client, "post", hold_url(offering), token, body, key="dev-1")
    assert retry.json() == first.json()
    assert retry["Idempotent-Replayed"] == "true"
    assert other["Idempotent-Replayed"] == "false"
    assert Reservation.objects.count() == 2


@pytest.mark.parametrize("action", ["renew", "confirm", "cancel"])
def test_a_retried_change_of_a_hold_replays_its_first_answer(client, offering, make_client, action):
    # given a hold at version 1, changed once under a key
    _, token = make_client()
    hold = call(client, "post", hold_url(offering), token, {"holder": "ann"}).json()
    url = f"/api/v1/holds/{hold['id']}/{action}"
    first = call(client, "post", url, token, {"expected_version": 1}, key=f"{action}-1")
    # when the client retries: without the key this is a 409 (the version moved on)
    retry = call(client, "post", url, token, {"expected_version": 1}, key=f"{action}-1")
    bare = call(client, "post", url, token, {"expected_version": 1})
    # then
    assert first.status_code == retry.status_code == 200
    assert retry.json() == first.json()
    assert bare.status_code == 409
    assert Reservation.objects.get(pk=hold["id"]).version == 2
    assert services.seat_conservation_violations() == []


def test_a_refusal_is_replayed_too_and_the_key_is_not_a_second_try(
    client, make_offering, make_client
):
    # given a full offering: the first attempt under the key is refused
    full = make_offering(capacity=1)
    _, token = make_client()
    call(client, "post", hold_url(full), token, {"holder": "ann"})
    refused = call(client, "post", hold_url(full), token, {"holder": "bob"}, key="bob-1")
    # when a seat frees up and the client retries under the same key
    Reservation.objects.filter(holder="ann").update(expires_at=Now(), next_attempt_at=Now())
    retry = call(client, "post", hold_url(full), token, {"holder": "bob"}, key="bob-1")
    # then the key's answer stands: it names one attempt, not "keep trying"
    assert refused.status_code == retry.status_code == 409
    assert error_code(retry) == "no_seats_available"
    assert retry["Idempotent-Replayed"] == "true"


def test_a_request_refused_before_it_ran_leaves_the_key_free(client, offering, make_client):
    _, token = make_client()
    bad = call(client, "post", hold_url(offering), token, {"holder": 7}, key="k-1")
    good = call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="k-1")
    assert bad.status_code == 400
    assert good.status_code == 201
    assert good["Idempotent-Replayed"] == "false"


def test_a_change_that_fails_stores_nothing_and_leaves_the_key_free(db):
    # given a change that raises (what a transient database error does, answered 503)
    def failing() -> idempotency.Response:
        raise services.TransientConflict("raced")

    with pytest.raises(services.TransientConflict):
        idempotency.run_once(None, "k-503", "hash", failing)
    assert not IdempotencyKey.objects.exists()
    # when the client retries, the change runs
    answer = idempotency.run_once(
        None, "k-503", "hash", lambda: idempotency.Response(201, {"id": 1})
    )
    assert answer == idempotency.Response(201, {"id": 1})
    assert IdempotencyKey.objects.get(key="k-503").response_status == 201


@pytest.mark.parametrize("key", ["", " ", "has space", "x" * 256, "caf\u00e9"])
def test_a_malformed_key_is_a_400_naming_the_header(client, offering, make_client, key):
    _, token = make_client()
    response = call(client, "post", hold_url(offering), token, {"holder": "ann"}, key=key)
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == "invalid_idempotency_key"
    assert response.json()["error"]["field"] == "Idempotency-Key"
    assert Reservation.objects.count() == 0


def test_an_expired_key_is_new_again_and_the_prune_deletes_expired_keys(
    client, offering, make_client, settings
):
    # given two keys, one past its lifetime
    _, token = make_client()
    first = call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="old")
    call(client, "post", hold_url(offering), token, {"holder": "bob"}, key="young")
    IdempotencyKey.objects.filter(key="old").update(expires_at=Now() - timedelta(seconds=1))
    # when the old key comes back, it is a new request
    again = call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="old")
    assert again.status_code == 201
    assert again.json()["id"] != first.json()["id"]
    # and the prune deletes what expired, nothing else
    IdempotencyKey.objects.filter(key="old").update(expires_at=Now() - timedelta(seconds=1))
    assert idempotency.prune_expired(batch=1) == 1
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["young"]
    stored = IdempotencyKey.objects.get(key="young")
    lifetime = (stored.expires_at - stored.created_at).total_seconds()
    assert lifetime == settings.RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS


# --- clients, tokens, scopes --------------------------------------------------------------------


def test_a_token_is_stored_only_as_its_digest_and_records_its_last_use(
    client, offering, make_client
):
    api_client, token = make_client()
    stored = ApiToken.objects.get(client=api_client)
    assert token not in json.dumps(list(ApiToken.objects.values()), default=str)
    assert stored.digest == hashlib.sha256(token.encode()).hexdigest()
    assert token.startswith(stored.prefix)
    assert stored.last_used_at is None
    response = call(client, "get", f"/api/v1/offerings/{offering.pk}/availability", token)
    assert response.status_code == 200
    stored.refresh_from_db()
    assert stored.last_used_at is not None


def test_a_revoked_token_or_a_deactivated_client_is_a_401(client, offering, make_client):
    api_client, token = make_client()
    _, second = make_client("second")
    url = f"/api/v1/offerings/{offering.pk}/availability"
    assert call(client, "get", url, token).status_code == 200
    assert clients.revoke_tokens(list(api_client.tokens.all())) == 1
    assert call(client, "get", url, token).status_code == 401
    ApiClient.objects.filter(name="second").update(is_active=False)
    response = call(client, "get", url, second)
    assert response.status_code == 401
    assert error_code(response) == "unauthorized"


def test_another_clients_hold_does_not_exist_for_this_one(client, offering, make_client):
    # given a hold made by one client
    _, owner = make_client("owner")
    _, other = make_client("other")
    hold = call(client, "post", hold_url(offering), owner, {"holder": "ann"}).json()
    # when another client reads, confirms or cancels it
    read = call(client, "get", f"/api/v1/holds/{hold['id']}", other)
    changes = [
        call(client, "post", f"/api/v1/holds/{hold['id']}/{action}", other, {"expected_version": 1})
        for action in ("renew", "confirm", "cancel")
    ]
    # then it does not exist for them, and nothing changed
    for response in (read, *changes):
        assert response.status_code == 404, response.content
        assert error_code(response) == "reservation_not_found"
    assert Reservation.objects.get(pk=hold["id"]).status == "held"
    assert call(client, "get", f"/api/v1/holds/{hold['id']}", owner).status_code == 200
    # the development token is a client of its own too
    assert call(client, "get", f"/api/v1/holds/{hold['id']}", DEV_TOKEN).status_code == 404


def test_a_read_only_client_cannot_change_anything_and_a_write_only_one_cannot_read(
    client, offering, make_client
):
    _, reader = make_client("reader", can_write=False)
    _, writer = make_client("writer", can_read=False)
    refused = call(client, "post", hold_url(offering), reader, {"holder": "ann"})
    assert refused.status_code == 403
    assert error_code(refused) == "insufficient_scope"
    assert Reservation.objects.count() == 0
    made = call(client, "post", hold_url(offering), writer, {"holder": "ann"})
    assert made.status_code == 201
    read = call(client, "get", made["Location"], writer)
    assert read.status_code == 403
    assert error_code(read) == "insufficient_scope"


def test_a_client_sees_only_the_offerings_it_was_given(client, make_offering, make_client):
    mine, theirs = make_offering(name="mine"), make_offering(name="theirs")
    _, token = make_client(offerings=[mine])
    assert call(client, "post", hold_url(mine), token, {"holder": "ann"}).status_code == 201
    for response in (
        call(client, "post", hold_url(theirs), token, {"holder": "ann"}),
        call(client, "get", f"/api/v1/offerings/{theirs.pk}/availability", token),
        call(client, "get", hold_url(theirs), token),
    ):
        assert response.status_code == 404, response.content
        assert error_code(response) == "offering_not_found"
    assert seats_left(theirs) == theirs.capacity


def test_a_client_over_its_rate_limit_gets_429_with_retry_after_and_others_do_not(
    client, offering, make_client
):
    # given a client allowed two requests a minute
    limited, token = make_client("limited", requests_per_minute=2)
    _, other = make_client("other")
    url = f"/api/v1/offerings/{offering.pk}/availability"
    # when it sends three
    answers = [call(client, "get", url, token).status_code for _ in range(2)]
    third = call(client, "get", url, token)
    # then the third is refused, saying when to come back; another client is not affected
    assert answers == [200, 200]
    assert third.status_code == 429
    assert error_code(third) == "rate_limited"
    assert 1 <= int(third["Retry-After"]) <= clients.RATE_WINDOW_SECONDS
    assert call(client, "get", url, other).status_code == 200
    refused_post = call(client, "post", hold_url(offering), token, {"holder": "ann"})
    assert refused_post.status_code == 429
    assert Reservation.objects.count() == 0
    # and once the window is over, it is answered again
    ApiClient.objects.filter(pk=limited.pk).update(
        window_started_at=Now() - timedelta(seconds=clients.RATE_WINDOW_SECONDS + 1)
    )
    assert call(client, "get", url, token).status_code == 200


# --- Location and listings ----------------------------------------------------------------------


def test_a_201_names_the_new_hold_in_its_location(client, offering, make_client):
    _, token = make_client()
    made = call(client, "post", hold_url(offering), token, {"holder": "ann"})
    assert made.status_code == 201
    assert made["Location"] == f"/api/v1/holds/{made.json()['id']}"
    assert call(client, "get", made["Location"], token).json() == made.json()


def pages(client: Client, url: str, token: str) -> list[list[int]]:
    found: list[list[int]] = []
    while True:
        body = call(client, "get", url, token).json()
        found.append([h["id"] for h in body["holds"]])
        if body["next_cursor"] is None:
            return found
        base = url.split("cursor=")[0].rstrip("&")
        url = f"{base}&cursor={body['next_cursor']}"


def test_a_holders_holds_are_listed_page_by_page_each_once(client, make_offering, make_client):
    # given five holds of ann on two offerings, one of bob, one of ann by another client
    a, b = make_offering(capacity=5, name="a"), make_offering(capacity=5, name="b")
    _, token = make_client()
    _, other = make_client("other")
    ids = [
        call(client, "post", hold_url(o), token, {"holder": "ann"}).json()["id"]
        for o in (a, b, a, b, a)
    ]
    call(client, "post", hold_url(a), token, {"holder": "bob"})
    call(client, "post", hold_url(a), other, {"holder": "ann"})
    # when listed two at a time
    found = pages(client, "/api/v1/holds?holder=ann&limit=2", token)
    # then
    assert found == [ids[0:2], ids[2:4], ids[4:5]]


def test_listing_the_holds_of_an_offering_that_does_not_exist_is_a_404(client, make_client):
    _, token = make_client()
    response = call(client, "get", "/api/v1/offerings/999999/holds", token)
    assert response.status_code == 404
    assert error_code(response) == "offering_not_found"


def test_an_offerings_holds_are_listed_page_by_page(client, make_offering, make_client):
    a, b = make_offering(capacity=5, name="a"), make_offering(capacity=5, name="b")
    _, token = make_client()
    ids = [call(client, "post", hold_url(a), token, {"holder": h}).json()["id"] for h in "xyz"]
    call(client, "post", hold_url(b), token, {"holder": "w"})
    assert pages(client, f"{hold_url(a)}?limit=2", token) == [ids[0:2], ids[2:3]]


@pytest.mark.parametrize(
    ("query", "code", "field"),
    [
        ("", "missing_field", "holder"),
        ("holder=", "invalid_value", "holder"),
        ("holder=ann&cursor=bm9wZQ", "invalid_cursor", "cursor"),
        ("holder=ann&cursor=%%%", "invalid_cursor", "cursor"),
        ("holder=ann&limit=0", "out_of_range", "limit"),
        ("holder=ann&limit=101", "out_of_range", "limit"),
        ("holder=ann&limit=ten", "invalid_type", "limit"),
        ("holder=ann&limit=1&limit=2", "invalid_value", "limit"),
        ("holder=ann&sort=id", "unknown_field", "sort"),
    ],
)
def test_a_bad_listing_query_is_a_400_naming_it(client, make_client, query, code, field):
    _, token = make_client()
    response = call(client, "get", f"/api/v1/holds?{query}", token)
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["field"] == field


def test_the_cleanups_hourly_prune_deletes_expired_idempotency_keys(client, offering, make_client):
    _, token = make_client()
    call(client, "post", hold_url(offering), token, {"holder": "ann"}, key="old")
    call(client, "post", hold_url(offering), token, {"holder": "bob"}, key="young")
    IdempotencyKey.objects.filter(key="old").update(expires_at=Now() - timedelta(seconds=1))
    result = prune_task.run()  # the task's body, as the worker runs it
    assert result["idempotency_keys"] == 1
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["young"]
