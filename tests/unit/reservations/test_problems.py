"""Every answer under /api/v1/ is JSON; every error an RFC 9457 problem; every answer carries a
request id, which every log line of the request carries too."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest
from django.test import Client

from config.logging import JsonFormatter
from reservations import problems
from tests.support.api import AUTH, hold_url

pytestmark = pytest.mark.usefixtures("api_token")

PROBLEM_MEMBERS = {"type", "title", "status", "detail", "instance", "code", "field", "request_id"}


def assert_problem(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    problem = json.loads(response.content)
    assert set(problem) == PROBLEM_MEMBERS
    assert problem["status"] == status
    assert problem["code"] == code
    assert problem["type"] == f"/api/v1/problems/{code}"
    assert problem["request_id"] == response["X-Request-ID"]
    return problem


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/",
        "/api/v1/holds/null%2Cnull",
        "/api/v1/offerings/x/availability",
        "/api/v1/holds/1/explode",
        "/api/v1/holds/",
    ],
)
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE", "OPTIONS"])
def test_a_path_no_operation_has_is_a_json_404_problem_whatever_the_method(
    client: Client, db: None, path: str, method: str
) -> None:
    response = client.generic(method, path, headers=AUTH)
    problem = assert_problem(response, 404, "not_found")
    assert problem["instance"] == response.wsgi_request.path


def test_a_method_a_route_does_not_take_is_a_json_405_problem_with_allow(
    client: Client, offering: Any
) -> None:
    for path in (f"/api/v1/holds/{1}", "/api/v1/openapi.json"):
        response = client.put(path, headers=AUTH)
        assert_problem(response, 405, "method_not_allowed")
        assert "GET" in response["Allow"]


def test_a_domain_refusal_is_a_problem_naming_the_request(client: Client, offering: Any) -> None:
    for _ in range(offering.capacity):
        client.post(hold_url(offering), {"holder": "ann"}, "application/json", headers=AUTH)
    response = client.post(hold_url(offering), {"holder": "ann"}, "application/json", headers=AUTH)
    problem = assert_problem(response, 409, "no_seats_available")
    assert problem["title"] == "No seats available"
    assert problem["instance"] == hold_url(offering)
    assert problem["field"] is None


def test_each_problem_type_uri_resolves_to_its_description(client: Client, db: None) -> None:
    for code, known in problems.PROBLEM_TYPES.items():
        response = client.get(f"/api/v1/problems/{code}")
        assert response.status_code == 200, code
        assert response.json() == {
            "type": f"/api/v1/problems/{code}",
            "code": code,
            "title": known.title,
            "status": known.status,
            "description": known.description,
        }
    assert_problem(client.get("/api/v1/problems/no_such_thing"), 404, "not_found")


def test_a_well_formed_request_id_is_kept_and_any_other_replaced(
    client: Client, offering: Any
) -> None:
    url = f"/api/v1/offerings/{offering.pk}/availability"
    kept = client.get(url, headers={**AUTH, "X-Request-ID": "checkout-7f3a:1"})
    assert kept.status_code == 200
    assert kept["X-Request-ID"] == "checkout-7f3a:1"
    for bad in ("a b", "x" * 129, "new\nline", "<script>", ""):
        replaced = client.get(url, headers={**AUTH, "X-Request-ID": bad})
        assert replaced["X-Request-ID"] != bad
        assert problems.REQUEST_ID_PATTERN.fullmatch(replaced["X-Request-ID"])
    first, second = client.get(url, headers=AUTH), client.get(url, headers=AUTH)
    assert first["X-Request-ID"] != second["X-Request-ID"]  # generated afresh each time
    refused = client.get(url)  # and on refusals too
    assert_problem(refused, 401, "unauthorized")


@pytest.fixture
def json_log() -> Any:
    """What the project's JSON log handler (its formatter and the request-id filter) writes."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(problems.RequestIdLogFilter())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        root.removeHandler(handler)


def test_every_log_line_of_a_request_carries_its_id(
    client: Client, db: None, json_log: Any
) -> None:
    # when a request fails in a way the API and Django both log (a 404 logs "Not Found")
    response = client.get("/api/v1/holds/1", headers={**AUTH, "X-Request-ID": "trace-42"})
    assert response.status_code == 404
    logging.getLogger("after").warning("between requests")
    # then every line written while it ran names it, and a line after it does not
    lines = json_log()
    during = [line for line in lines if line["logger"] != "after"]
    assert during, lines
    assert {line.get("request_id") for line in during} == {"trace-42"}
    assert "request_id" not in [line for line in lines if line["logger"] == "after"][0]


def test_the_settings_log_handler_adds_the_request_id(settings: Any) -> None:
    # then the current span's trace ids (config.logging.TraceContextLogFilter)
    assert settings.LOGGING["handlers"]["console"]["filters"] == ["request_id", "trace_context"]
    assert settings.MIDDLEWARE[0] == "reservations.problems.ApiRequestMiddleware"


@pytest.mark.parametrize("method", ["OPTIONS", "DELETE", "PUT", "PATCH", "TRACE", "CONNECT"])
def test_any_other_method_is_a_405_problem_listing_the_paths_methods(
    client: Client, offering: Any, method: str
) -> None:
    response = client.generic(method, hold_url(offering), headers=AUTH)
    assert_problem(response, 405, "method_not_allowed")
    assert response["Allow"] == "GET, HEAD, POST"


def test_a_wrong_method_without_credentials_is_a_401_first(client: Client, offering: Any) -> None:
    # as before any other answer: nothing about the API is told to a caller without a token
    assert_problem(client.delete(hold_url(offering)), 401, "unauthorized")
