"""The JSON API over the reservation services, against a real PostgreSQL."""

from __future__ import annotations

import base64
import io
import json
import re
from typing import Any

import pytest
from django.test import Client, RequestFactory
from django.urls import resolve

from reservations import services
from reservations.models import (
    OutboxEvent,
    Reservation,
)
from tests.support.api import API_TOKEN, AUTH, call, error_code, hold_url
from tests.support.holds import expire


@pytest.fixture(autouse=True)
def _small_bodies(api_token: str, settings: Any) -> None:
    settings.RESERVATIONS_API_MAX_BODY_BYTES = 1024


@pytest.fixture
def api_client(client: Client) -> Client:
    return client


def post(
    client: Client,
    url: str,
    body: Any = None,
    *,
    raw: bytes | str | None = None,
    headers: dict[str, str] | None = None,
) -> Any:
    data = raw if raw is not None else json.dumps(body)
    return client.post(
        url,
        data=data,
        content_type="application/json",
        headers=AUTH if headers is None else headers,
    )


def get(client: Client, url: str, headers: dict[str, str] | None = None) -> Any:
    return client.get(url, headers=AUTH if headers is None else headers)


def serve(request: Any) -> Any:
    """A request made by hand (its headers as no client would send them) through the API's
    URLconf and view, as Django would serve it."""
    match = resolve(request.path)
    return match.func(request, *match.args, **match.kwargs)


def assert_error(response: Any, status: int, code: str, field: str | None = None) -> None:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    problem = json.loads(response.content)
    assert problem["code"] == code
    assert problem["type"] == f"/api/v1/problems/{code}"
    assert problem["status"] == status
    assert problem["title"]
    assert problem["detail"]
    assert problem["field"] == field
    assert problem["request_id"] == response["X-Request-ID"]


# --- success paths -------------------------------------------------------------------------


def test_holding_a_seat_returns_201_with_the_hold_and_takes_the_seat(api_client, offering):
    # when
    response = post(
        api_client,
        f"/api/v1/offerings/{offering.pk}/holds",
        {"holder": "learner-1", "ttl_seconds": 120},
    )
    # then
    assert response.status_code == 201
    body = response.json()
    hold = Reservation.objects.get(pk=body["id"])
    assert body == {
        "id": hold.pk,
        "offering_id": offering.pk,
        "holder": "learner-1",
        "status": "held",
        "version": 1,
        "expires_at": hold.expires_at.isoformat(),
        "released_version": None,
        "bucket": hold.pk % 1024,
        "created_at": hold.created_at.isoformat(),
        "released_at": None,
    }
    assert hold.holder == "learner-1"
    offering.refresh_from_db()
    assert offering.seats_available == offering.capacity - 1


def test_holding_without_ttl_uses_the_default_ttl(api_client, offering, settings):
    response = post(api_client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": "learner-1"})
    assert response.status_code == 201
    hold = Reservation.objects.get(pk=response.json()["id"])
    assert (hold.expires_at - hold.created_at).total_seconds() == pytest.approx(
        settings.RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS, abs=5
    )


def test_getting_a_hold_returns_its_current_state(api_client, offering):
    hold = services.hold_seat(offering.pk, "learner-1")
    response = get(api_client, f"/api/v1/holds/{hold.pk}")
    assert response.status_code == 200
    assert response.json()["id"] == hold.pk
    assert response.json()["status"] == "held"


def test_renewing_a_hold_bumps_its_version_and_extends_it(api_client, offering):
    # given
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=60)
    # when
    response = post(
        api_client, f"/api/v1/holds/{hold.pk}/renew", {"expected_version": 1, "ttl_seconds": 600}
    )
    # then
    assert response.status_code == 200
    assert response.json()["version"] == 2
    hold.refresh_from_db()
    assert response.json()["expires_at"] == hold.expires_at.isoformat()
    assert OutboxEvent.objects.filter(reservation=hold, kind="reservation.renewed").count() == 1


def test_confirming_a_hold_makes_it_confirmed(api_client, offering):
    hold = services.hold_seat(offering.pk, "learner-1")
    response = post(api_client, f"/api/v1/holds/{hold.pk}/confirm", {"expected_version": 1})
    assert response.status_code == 200
    assert response.json()["status"] == "confirmed"
    assert response.json()["version"] == 2


def test_cancelling_a_hold_gives_the_seat_back(api_client, offering):
    hold = services.hold_seat(offering.pk, "learner-1")
    response = post(api_client, f"/api/v1/holds/{hold.pk}/cancel", {"expected_version": 1})
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    offering.refresh_from_db()
    assert offering.seats_available == offering.capacity
    assert services.seat_conservation_violations() == []


def test_availability_counts_eligible_holds_as_available(api_client, offering):
    # given: one live hold and one expired hold on a 3-seat offering
    services.hold_seat(offering.pk, "live")
    expired = services.hold_seat(offering.pk, "gone", ttl_seconds=1)
    expire(expired)
    # when
    response = get(api_client, f"/api/v1/offerings/{offering.pk}/availability")
    # then
    assert response.status_code == 200
    assert response.json() == {
        "offering_id": offering.pk,
        "capacity": 3,
        "seats_available": 1,
        "held": 2,
        "eligible": 1,
        "confirmed": 0,
        "available": 2,
    }


# --- 400: bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    ['{"holder": ', "not json", "", "   ", b"\xff\xfe{}", "[" * 5000 + "]" * 5000],
    ids=["truncated", "garbage", "empty", "blank", "not-utf8", "deeply-nested"],
)
def test_a_body_that_is_not_json_is_a_400_naming_the_body(api_client, offering, settings, raw):
    settings.RESERVATIONS_API_MAX_BODY_BYTES = 16384
    response = post(api_client, f"/api/v1/offerings/{offering.pk}/holds", raw=raw)
    assert_error(response, 400, "invalid_json", "body")


@pytest.mark.parametrize("body", [[], ["holder"], "learner", 42, None, True])
def test_a_json_body_that_is_not_an_object_is_a_400(api_client, offering, body):
    response = post(api_client, f"/api/v1/offerings/{offering.pk}/holds", body)
    assert_error(response, 400, "invalid_json", "body")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"holder": 42}, "holder"),
        ({"holder": None}, "holder"),
        ({"holder": ["a"]}, "holder"),
        ({"holder": "x", "ttl_seconds": "60"}, "ttl_seconds"),
        ({"holder": "x", "ttl_seconds": True}, "ttl_seconds"),
        ({"holder": "x", "ttl_seconds": 60.5}, "ttl_seconds"),
        ({"holder": "x", "ttl_seconds": {}}, "ttl_seconds"),
    ],
)
def test_holding_with_a_wrongly_typed_field_is_a_400_naming_it(api_client, offering, body, field):
    response = post(api_client, f"/api/v1/offerings/{offering.pk}/holds", body)
    assert_error(response, 400, "invalid_type", field)
    assert not Reservation.objects.exists()


@pytest.mark.parametrize("action", ["renew", "confirm", "cancel"])
@pytest.mark.parametrize("version", [True, False, "1", 1.5, float("nan"), [1], {"v": 1}])
def test_a_version_that_is_not_an_integer_is_a_400(api_client, offering, action, version):
    # given
    hold = services.hold_seat(offering.pk, "learner-1")
    # when
    response = post(api_client, f"/api/v1/holds/{hold.pk}/{action}", {"expected_version": version})
    # then
    assert_error(response, 400, "invalid_type", "expected_version")
    hold.refresh_from_db()
    assert (hold.status, hold.version) == ("held", 1)


@pytest.mark.parametrize("action", ["renew", "confirm", "cancel"])
def test_an_integral_number_is_an_integer_as_json_schema_says(api_client, offering, action):
    # JSON has one number type; the document's "integer" includes 1.0 (and 1e0)
    hold = services.hold_seat(offering.pk, "learner-1")
    response = post(
        api_client,
        f"/api/v1/holds/{hold.pk}/{action}",
        raw='{"expected_version": 1.0}'
        if action != "renew"
        else '{"expected_version": 1e0, "ttl_seconds": 600.0}',
    )
    assert response.status_code == 200, response.content
    assert response.json()["version"] == 2


@pytest.mark.parametrize("action", ["renew", "confirm", "cancel"])
@pytest.mark.parametrize("version", [0, -1, 2**31, 10**30])
def test_a_version_out_of_range_is_a_400(api_client, offering, action, version):
    hold = services.hold_seat(offering.pk, "learner-1")
    response = post(api_client, f"/api/v1/holds/{hold.pk}/{action}", {"expected_version": version})
    assert_error(response, 400, "out_of_range", "expected_version")


@pytest.mark.parametrize("action", ["renew", "confirm", "cancel"])
def test_a_missing_expected_version_is_a_400(api_client, offering, action):
    hold = services.hold_seat(offering.pk, "learner-1")
    response = post(api_client, f"/api/v1/holds/{hold.pk}/{action}", {})
    assert_error(response, 400, "missing_field", "expected_version")


def test_holding_without_a_holder_is_a_400(api_client, offering):
    response = post(api_client, f"/api/v1/offerings/{offering.pk}/holds", {"ttl_seconds": 60})
    assert_error(response, 400, "missing_field", "holder")


@pytest.mark.parametrize(
    "holder",
    ["", "   ", "x" * 201, "nul\x00byte", "lone \ud800 surrogate"],
    ids=["empty", "blank", "too-long", "nul", "surrogate"],
)
def test_a_holder_the_database_cannot_store_is_a_400(api_client, offering, settings, holder):
    settings.RESERVATIONS_API_MAX_BODY_BYTES = 16384
    response = post(api_client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": holder})
    assert_error(response, 400, "invalid_value", "holder")


def test_an_unknown_field_is_a_400_naming_it(api_client, offering):
    response = post(
        api_client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": "x", "ttl": 60}
    )
    assert_error(response, 400, "unknown_field", "ttl")


@pytest.mark.parametrize("ttl", [0, -5, 86401, 10**40])
def test_a_ttl_out_of_range_is_a_400_from_the_service(api_client, offering, ttl):
    response = post(
        api_client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": "x", "ttl_seconds": ttl}
    )
    assert response.status_code == 400
    assert response.json()["field"] == "ttl_seconds"
    assert response.json()["code"] in {"invalid_ttl", "out_of_range"}
    assert not Reservation.objects.exists()


def test_renewing_with_a_ttl_out_of_range_is_a_400_and_changes_nothing(api_client, offering):
    hold = services.hold_seat(offering.pk, "learner-1")
    response = post(
        api_client, f"/api/v1/holds/{hold.pk}/renew", {"expected_version": 1, "ttl_seconds": 0}
    )
    assert_error(response, 400, "invalid_ttl", "ttl_seconds")
    hold.refresh_from_db()
    assert hold.version == 1


def test_a_non_numeric_content_length_is_a_400(offering):
    request = RequestFactory().post(
        f"/api/v1/offerings/{offering.pk}/holds",
        data=b'{"holder": "x"}',
        content_type="application/json",
        headers=AUTH,
    )
    request.META["CONTENT_LENGTH"] = "twelve"
    response = serve(request)
    assert_error(response, 400, "invalid_content_length")


# --- 401 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": f"Basic {API_TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {API_TOKEN}x"},
        {"Authorization": "Bearer t\u00f6ken"},
        {"Authorization": API_TOKEN},
    ],
    ids=["missing", "wrong", "basic", "empty", "longer", "non-ascii", "no-scheme"],
)
def test_a_missing_or_bad_token_is_a_401_and_changes_nothing(api_client, offering, headers):
    response = post(
        api_client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": "x"}, headers=headers
    )
    assert_error(response, 401, "unauthorized")
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert not Reservation.objects.exists()


def test_reading_a_hold_without_a_token_is_a_401(api_client, offering):
    hold = services.hold_seat(offering.pk, "learner-1")
    assert_error(get(api_client, f"/api/v1/holds/{hold.pk}", headers={}), 401, "unauthorized")


def test_the_bearer_scheme_is_case_insensitive(api_client, offering):
    response = post(
        api_client,
        f"/api/v1/offerings/{offering.pk}/holds",
        {"holder": "x"},
        headers={"Authorization": f"bearer {API_TOKEN}"},
    )
    assert response.status_code == 201


# --- 404 ----------------------------------------------------------------------------------


def test_holding_on_an_unknown_offering_is_a_404(api_client, db):
    response = post(api_client, "/api/v1/offerings/999999/holds", {"holder": "x"})
    assert_error(response, 404, "offering_not_found")


def test_availability_of_an_unknown_offering_is_a_404(api_client, db):
    assert_error(
        get(api_client, "/api/v1/offerings/999999/availability"), 404, "offering_not_found"
    )


@pytest.mark.parametrize("hold_id", [999999, 0, 2**63, 10**30])
def test_reading_an_unknown_hold_is_a_404(api_client, db, hold_id):
    assert_error(get(api_client, f"/api/v1/holds/{hold_id}"), 404, "reservation_not_found")


@pytest.mark.parametrize("action", ["renew", "confirm", "cancel"])
def test_changing_an_unknown_hold_is_a_404(api_client, db, action):
    response = post(api_client, f"/api/v1/holds/999999/{action}", {"expected_version": 1})
    assert_error(response, 404, "reservation_not_found")


# --- 405 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("put", "/api/v1/offerings/{o}/holds", "GET, HEAD, POST"),
        ("post", "/api/v1/holds", "GET, HEAD"),
        ("put", "/api/v1/holds/{h}/renew", "POST"),
        ("delete", "/api/v1/holds/{h}", "GET, HEAD"),
        ("post", "/api/v1/holds/{h}", "GET, HEAD"),
        ("patch", "/api/v1/offerings/{o}/availability", "GET, HEAD"),
    ],
)
def test_a_wrong_method_is_a_json_405_with_allow(api_client, offering, method, path, allow):
    hold = services.hold_seat(offering.pk, "learner-1")
    url = path.format(o=offering.pk, h=hold.pk)
    response = getattr(api_client, method)(url, headers=AUTH)
    assert_error(response, 405, "method_not_allowed")
    assert response["Allow"] == allow


# --- 409 ----------------------------------------------------------------------------------


def test_holding_on_a_full_offering_is_a_409_no_seats(api_client, make_offering):
    # given
    full = make_offering(capacity=1)
    services.hold_seat(full.pk, "first")
    # when
    response = post(api_client, f"/api/v1/offerings/{full.pk}/holds", {"holder": "second"})
    # then
    assert_error(response, 409, "no_seats_available")
    assert Reservation.objects.filter(offering=full).count() == 1


def test_holding_on_a_full_offering_reclaims_an_expired_hold(api_client, make_offering):
    # given
    full = make_offering(capacity=1)
    stale = services.hold_seat(full.pk, "first", ttl_seconds=1)
    expire(stale)
    # when
    response = post(api_client, f"/api/v1/offerings/{full.pk}/holds", {"holder": "second"})
    # then
    assert response.status_code == 201
    stale.refresh_from_db()
    assert stale.status == "released"
    assert services.seat_conservation_violations() == []


@pytest.mark.parametrize("action", ["renew", "confirm", "cancel"])
def test_a_stale_version_is_a_409(api_client, offering, action):
    # given: the hold moved to version 2
    hold = services.hold_seat(offering.pk, "learner-1")
    services.renew(hold.pk, 1)
    # when
    response = post(api_client, f"/api/v1/holds/{hold.pk}/{action}", {"expected_version": 1})
    # then
    assert_error(response, 409, "stale_version", "expected_version")
    hold.refresh_from_db()
    assert (hold.status, hold.version) == ("held", 2)


@pytest.mark.parametrize("action", ["renew", "confirm", "cancel"])
def test_changing_a_hold_that_is_no_longer_held_is_a_409(api_client, offering, action):
    hold = services.hold_seat(offering.pk, "learner-1")
    services.confirm(hold.pk, 1)
    response = post(api_client, f"/api/v1/holds/{hold.pk}/{action}", {"expected_version": 2})
    assert_error(response, 409, "not_held")


@pytest.mark.parametrize("action", ["renew", "confirm"])
def test_renewing_or_confirming_an_expired_hold_is_a_409(api_client, offering, action):
    # given
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=1)
    expire(hold)
    # when
    response = post(api_client, f"/api/v1/holds/{hold.pk}/{action}", {"expected_version": 1})
    # then
    assert_error(response, 409, "hold_expired")
    hold.refresh_from_db()
    assert (hold.status, hold.version) == ("held", 1)


def test_cancelling_an_expired_hold_is_still_allowed(api_client, offering):
    hold = services.hold_seat(offering.pk, "learner-1", ttl_seconds=1)
    expire(hold)
    response = post(api_client, f"/api/v1/holds/{hold.pk}/cancel", {"expected_version": 1})
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"


# --- 413 ----------------------------------------------------------------------------------


def test_a_body_over_the_limit_by_content_length_is_a_413(api_client, offering):
    body = {"holder": "x" * 2000}
    response = post(api_client, f"/api/v1/offerings/{offering.pk}/holds", body)
    assert_error(response, 413, "body_too_large")
    assert not Reservation.objects.exists()


def test_a_body_over_the_limit_without_content_length_is_a_413(offering):
    # given: a request whose declared length hides its real size (e.g. chunked upload)
    payload = json.dumps({"holder": "x" * 2000}).encode()
    request = RequestFactory().post(
        f"/api/v1/offerings/{offering.pk}/holds",
        data=payload,
        content_type="application/json",
        headers=AUTH,
    )
    del request.META["CONTENT_LENGTH"]
    request._stream = io.BytesIO(payload)  # type: ignore[attr-defined]
    # when
    response = serve(request)
    # then
    assert_error(response, 413, "body_too_large")
    assert not Reservation.objects.exists()


# Transient database errors (deadlocks, a real one between two sessions and a persistent one
# raised by PostgreSQL) are driven through the API in test_retry.py.


def test_the_api_is_csrf_exempt(offering):
    client = Client(enforce_csrf_checks=True)
    response = post(client, f"/api/v1/offerings/{offering.pk}/holds", {"holder": "x"})
    assert response.status_code == 201


# --- Location and listings, as an API client ----------------------------------------------


def pages(client: Client, url: str, token: str) -> list[list[int]]:
    found: list[list[int]] = []
    while True:
        body = call(client, "get", url, token).json()
        found.append([h["id"] for h in body["holds"]])
        if body["next_cursor"] is None:
            return found
        base = url.split("cursor=")[0].rstrip("&")
        url = f"{base}&cursor={body['next_cursor']}"


@pytest.mark.usefixtures("api_token")
def test_a_201_names_the_new_hold_in_its_location(client, offering, make_client):
    _, token = make_client()
    made = call(client, "post", hold_url(offering), token, {"holder": "ann"})
    assert made.status_code == 201
    assert made["Location"] == f"/api/v1/holds/{made.json()['id']}"
    assert call(client, "get", made["Location"], token).json() == made.json()


@pytest.mark.usefixtures("api_token")
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


@pytest.mark.usefixtures("api_token")
def test_listing_the_holds_of_an_offering_that_does_not_exist_is_a_404(client, make_client):
    _, token = make_client()
    response = call(client, "get", "/api/v1/offerings/999999/holds", token)
    assert response.status_code == 404
    assert error_code(response) == "offering_not_found"


@pytest.mark.usefixtures("api_token")
def test_an_offerings_holds_are_listed_page_by_page(client, make_offering, make_client):
    a, b = make_offering(capacity=5, name="a"), make_offering(capacity=5, name="b")
    _, token = make_client()
    ids = [call(client, "post", hold_url(a), token, {"holder": h}).json()["id"] for h in "xyz"]
    call(client, "post", hold_url(b), token, {"holder": "w"})
    assert pages(client, f"{hold_url(a)}?limit=2", token) == [ids[0:2], ids[2:3]]


@pytest.mark.usefixtures("api_token")
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
    assert response.json()["code"] == code
    assert response.json()["field"] == field


@pytest.mark.usefixtures("api_token")
def test_any_cursor_of_the_documented_shape_is_a_page_and_earlier_cursors_still_work(
    client, offering, make_client
):
    _, token = make_client()
    made = [
        call(client, "post", hold_url(offering), token, {"holder": "ann"}).json()["id"]
        for _ in range(3)
    ]
    url = f"/api/v1/offerings/{offering.pk}/holds?limit=1"
    first = call(client, "get", url, token).json()
    assert re.fullmatch(r"[A-Za-z0-9_-]{11}", first["next_cursor"])
    # a cursor past every id: an empty last page, not an error
    past = call(client, "get", f"{url}&cursor=___________", token)
    assert past.status_code == 200
    assert past.json() == {"holds": [], "next_cursor": None}
    # a cursor handed out before the shape changed (base64url of "after:<id>") goes on
    earlier = base64.urlsafe_b64encode(f"after:{made[0]}".encode()).decode().rstrip("=")
    following = call(client, "get", f"{url}&cursor={earlier}", token).json()
    assert [h["id"] for h in following["holds"]] == [made[1]]
