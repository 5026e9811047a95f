"""API clients and Idempotency-Key, through the JSON API against a real PostgreSQL: what a
client that retries, or a second careless client, sees."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from http import HTTPMethod
from typing import Any

import pytest
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, RequestFactory
from django.utils import timezone

from cleanup.tasks import prune_task
from reservations import api, clients, idempotency, services
from reservations import urls as api_urls
from reservations.models import ApiClient, ApiToken, IdempotencyKey, Offering, Reservation
from tests.support.api import API_TOKEN
from tests.support.holds import expire

MakeClient = Callable[..., tuple[ApiClient, str]]

pytestmark = pytest.mark.usefixtures("api_token")


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
    first = call(client, "post", hold_url(offering), API_TOKEN, body, key="dev-1")
    retry = call(client, "post", hold_url(offering), API_TOKEN, body, key="dev-1")
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
    expire(*Reservation.objects.filter(holder="ann"), ago=timedelta(0))
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


def test_the_prune_goes_on_past_a_full_batch_until_no_expired_key_is_left(db):
    # given: five expired keys, more than one batch of the prune's
    now = timezone.now()
    IdempotencyKey.objects.bulk_create(
        IdempotencyKey(
            key=f"expired-{n}",
            request_hash="h",
            response_status=201,
            response_body={},
            created_at=now - timedelta(days=2),
            expires_at=now - timedelta(days=1),
        )
        for n in range(5)
    )
    # when: the prune runs in batches of two
    deleted = idempotency.prune_expired(batch=2)
    # then: every expired key is gone, not only the first batch
    assert (deleted, IdempotencyKey.objects.count()) == (5, 0)


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
    assert call(client, "get", f"/api/v1/holds/{hold['id']}", API_TOKEN).status_code == 404


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


# --- an offering taken away ---------------------------------------------------------------------


def head(client: Client, url: str, token: str) -> Any:
    return client.head(url, headers={"Authorization": f"Bearer {token}"})


def take_away(api_client: ApiClient, offering: Offering, access: str) -> None:
    """What the admin does to stop a client using ``offering``: takes it off the client's
    offerings, or turns off "every offering" for a client that had it."""
    if access == "listed":
        api_client.offerings.remove(offering)
    else:
        api_client.all_offerings = False
        api_client.save(update_fields=["all_offerings"])


def give_back(api_client: ApiClient, offering: Offering, access: str) -> None:
    if access == "listed":
        api_client.offerings.add(offering)
    else:
        api_client.all_offerings = True
        api_client.save(update_fields=["all_offerings"])


@pytest.mark.parametrize("access", ["listed", "all_offerings"])
def test_a_hold_on_an_offering_taken_away_from_its_client_can_no_longer_be_read_or_changed(
    client, make_offering, make_client, access
):
    # given a client holding a seat on an offering it may use, and one on an offering it keeps
    lost, kept = make_offering(name="lost"), make_offering(name="kept")
    if access == "listed":
        api_client, token = make_client(offerings=[lost, kept])
    else:
        api_client, token = make_client(all_offerings=True, offerings=[kept])
    hold = call(client, "post", hold_url(lost), token, {"holder": "ann"}).json()
    other = call(client, "post", hold_url(kept), token, {"holder": "ann"}).json()
    url = f"/api/v1/holds/{hold['id']}"
    assert call(client, "get", url, token).status_code == 200
    # when the offering is taken away from it
    take_away(api_client, lost, access)
    # then the hold is answered as another offering's would be: it does not exist
    read = call(client, "get", url, token)
    changes = [
        call(client, "post", f"{url}/{action}", token, {"expected_version": 1})
        for action in ("renew", "confirm", "cancel")
    ]
    for response in (read, *changes):
        assert response.status_code == 404, response.content
        assert error_code(response) == "reservation_not_found"
    assert head(client, url, token).status_code == 404
    # the listings leave it out; the offering's own listing is refused like any other offering's
    listed = call(client, "get", "/api/v1/holds?holder=ann", token).json()
    assert [h["id"] for h in listed["holds"]] == [other["id"]]
    by_offering = call(client, "get", hold_url(lost), token)
    assert by_offering.status_code == 404
    assert error_code(by_offering) == "offering_not_found"
    # and nothing changed: the hold still holds its seat until it expires or the client is
    # given the offering back, when it is the client's again, as it was
    stored = Reservation.objects.get(pk=hold["id"])
    assert (stored.status, stored.version) == ("held", 1)
    assert seats_left(lost) == lost.capacity - 1
    give_back(api_client, lost, access)
    assert call(client, "get", url, token).json() == hold


def test_a_change_made_under_a_key_is_not_replayed_once_the_offering_is_taken_away(
    client, make_offering, make_client
):
    # given a renewal under a key, made while the client could use the offering
    lost = make_offering(name="lost")
    api_client, token = make_client(offerings=[lost])
    hold = call(client, "post", hold_url(lost), token, {"holder": "ann"}).json()
    url = f"/api/v1/holds/{hold['id']}/renew"
    first = call(client, "post", url, token, {"expected_version": 1}, key="renew-1")
    assert first.status_code == 200
    # when the client retries it after the offering was taken away
    take_away(api_client, lost, "listed")
    retry = call(client, "post", url, token, {"expected_version": 1}, key="renew-1")
    # then the stored answer, which shows the hold, is not given out
    assert retry.status_code == 404, retry.content
    assert error_code(retry) == "reservation_not_found"
    assert "Idempotent-Replayed" not in retry


# --- which methods need which scope -------------------------------------------------------------

# GET and HEAD need the read scope; every other method, served today or not, the write scope.
READ_METHODS = frozenset({"GET", "HEAD"})
API_ROUTES = [p for p in api_urls.urlpatterns if p.name not in {"openapi-json", "openapi-view"}]
# What a route needs to answer an allowed request with a success, so that "allowed" is seen to
# reach the view (otherwise: no query, and the body renew, confirm and cancel take).
QUERIES = {"holds": "?holder=ann"}
BODIES = {"offering-holds": {"holder": "ann"}}


def served_methods(client: Client, path: str) -> list[str]:
    """The methods ``path`` takes, from what the server answers: a method no route takes is a
    405 whose Allow lists them."""
    answer = client.generic("OPTIONS", path, headers={"Authorization": f"Bearer {API_TOKEN}"})
    assert answer.status_code == 405, (path, answer.content)
    methods = answer["Allow"].split(", ")
    assert methods and all(methods), answer["Allow"]
    return methods


def send(client: Client, method: str, url: str, token: str, body: Any) -> Any:
    return client.generic(
        method,
        url,
        data=json.dumps(body) if method not in READ_METHODS else "",
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


@pytest.mark.parametrize("route", API_ROUTES, ids=lambda p: p.name)
def test_every_served_method_needs_the_scope_it_reads_or_writes_with(
    client, offering, make_client, route
):
    # given a read-only and a write-only client, each with a hold of its own
    reader, reader_token = make_client("reader", can_write=False)
    writer, writer_token = make_client("writer", can_read=False)
    own = {
        token: services.hold_seat(offering.pk, "ann", client_id=api_client.pk)
        for api_client, token in ((reader, reader_token), (writer, writer_token))
    }

    def url(token: str) -> str:
        path = str(route.pattern).replace("<int:offering_id>", str(offering.pk))
        path = path.replace("<int:hold_id>", str(own[token].pk))
        assert "<" not in path, path
        return f"/api/v1/{path}{QUERIES.get(route.name, '')}"

    body = BODIES.get(route.name, {"expected_version": 1})
    for method in served_methods(client, url(reader_token)):
        reads = method in READ_METHODS
        refused_token, allowed_token = (
            (writer_token, reader_token) if reads else (reader_token, writer_token)
        )
        before = sorted(Reservation.objects.values_list("pk", "status", "version"))
        # when the client without the scope sends it
        refused = send(client, method, url(refused_token), refused_token, body)
        # then it is refused and nothing changed
        assert refused.status_code == 403, (method, refused.content)
        if method != "HEAD":  # a HEAD answer has no body
            assert error_code(refused) == "insufficient_scope"
            scope = "read" if reads else "write"
            assert f"no {scope} scope" in refused.json()["error"]["message"]
        assert sorted(Reservation.objects.values_list("pk", "status", "version")) == before
        # and the client with the scope is answered
        allowed = send(client, method, url(allowed_token), allowed_token, body)
        assert allowed.status_code in (200, 201), (method, allowed.content)


def _stand_in(request: HttpRequest, principal: clients.Principal) -> HttpResponse:
    return JsonResponse({"client": principal.name})


@pytest.mark.parametrize("method", [m.value for m in HTTPMethod])
def test_only_get_and_head_are_reads_whatever_method_a_route_takes(make_client, method):
    # The routes take GET, HEAD and POST today, and a method a route does not take is a 405
    # before any scope is checked; a route that took PUT, PATCH or DELETE must need the write
    # scope for it all the same. A stand-in route taking every method shows what it would answer.
    view = api.api_view(*(m.value for m in HTTPMethod))(_stand_in)
    _, reader = make_client("reader", can_write=False)
    _, writer = make_client("writer", can_read=False)
    reads = method in READ_METHODS
    refused_token, allowed_token = (writer, reader) if reads else (reader, writer)

    def answer(token: str) -> HttpResponse:
        request = RequestFactory().generic(
            method, "/api/v1/stand-in", headers={"Authorization": f"Bearer {token}"}
        )
        return view(request)

    refused = answer(refused_token)
    assert refused.status_code == 403, refused.content
    error = json.loads(refused.content)["error"]
    assert error["code"] == "insufficient_scope"
    assert f"no {'read' if reads else 'write'} scope" in error["message"]
    allowed = answer(allowed_token)
    assert allowed.status_code == 200, allowed.content
    assert json.loads(allowed.content) == {"client": "reader" if reads else "writer"}


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
