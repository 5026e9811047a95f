"""API clients (reservations.clients), through the JSON API against a real PostgreSQL: tokens
stored as digests, revoked or deactivated; what each client may see and do (its offerings, its
scopes, its rate limit), and what a second careless client sees. Idempotency-Key:
test_idempotency.py."""

from __future__ import annotations

import hashlib
import json
from http import HTTPMethod
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, RequestFactory
from django.urls import URLPattern

from reservations import api, clients, ratelimit, services
from reservations import urls as api_urls
from reservations.models import ApiClient, ApiToken, Offering, Reservation
from tests.support.api import API_TOKEN, call, error_code, hold_url, seats_left

pytestmark = pytest.mark.usefixtures("api_token")

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
    assert 1 <= int(third["Retry-After"]) <= ratelimit.WINDOW_SECONDS
    assert call(client, "get", url, other).status_code == 200
    refused_post = call(client, "post", hold_url(offering), token, {"holder": "ann"})
    assert refused_post.status_code == 429
    assert Reservation.objects.count() == 0
    assert third["RateLimit"] == f'"default";r=0;t={third["Retry-After"]}'


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
NOT_OPERATIONS = {"openapi-json", "openapi-view", "problem-type", "no-such-path"}
# One route per path (ninja adds one per operation, all serving the path's operations).
API_ROUTES = list(
    {
        str(p.pattern): p
        for p in reversed(api_urls.urlpatterns)
        if isinstance(p, URLPattern) and p.name not in NOT_OPERATIONS
    }.values()
)
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
            assert f"no {scope} scope" in refused.json()["detail"]
        assert sorted(Reservation.objects.values_list("pk", "status", "version")) == before
        # and the client with the scope is answered
        allowed = send(client, method, url(allowed_token), allowed_token, body)
        assert allowed.status_code in (200, 201), (method, allowed.content)


def _stand_in(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"client": request.auth.name})  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", [m.value for m in HTTPMethod])
def test_only_get_and_head_are_reads_whatever_method_a_route_takes(make_client, method):
    # The routes take GET, HEAD and POST today, and a method a route does not take is a 405
    # before any scope is checked; a route that took PUT, PATCH or DELETE must need the write
    # scope for it all the same. A stand-in operation taking every method, authenticated as
    # the API's operations are, shows what it would answer.
    view = api._answers()(_stand_in)
    _, reader = make_client("reader", can_write=False)
    _, writer = make_client("writer", can_read=False)
    reads = method in READ_METHODS
    refused_token, allowed_token = (writer, reader) if reads else (reader, writer)

    def answer(token: str) -> HttpResponse:
        request = RequestFactory().generic(
            method, "/api/v1/stand-in", headers={"Authorization": f"Bearer {token}"}
        )
        request.auth = api.BearerToken()(request)  # type: ignore[attr-defined]
        return view(request)

    refused = answer(refused_token)
    assert refused.status_code == 403, refused.content
    error = json.loads(refused.content)
    assert error["code"] == "insufficient_scope"
    assert f"no {'read' if reads else 'write'} scope" in error["detail"]
    allowed = answer(allowed_token)
    assert allowed.status_code == 200, allowed.content
    assert json.loads(allowed.content) == {"client": "reader" if reads else "writer"}
