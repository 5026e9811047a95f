"""The OpenAPI document: served publicly, browsable by staff, and stating what the operations
that generate it accept and answer."""

from __future__ import annotations

import re

import pytest

from reservations import problems

pytestmark = pytest.mark.usefixtures("api_token")


def test_the_document_is_public_openapi_3_with_the_error_body_and_strict_bodies(client, db):
    # given no credentials at all
    response = client.get("/api/v1/openapi.json")
    # then
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.")
    schemas = document["components"]["schemas"]
    assert set(schemas["Error"]["required"]) >= {"type", "title", "status", "code", "request_id"}
    for body in ("HoldRequest", "RenewRequest", "VersionRequest"):
        assert schemas[body]["additionalProperties"] is False
    create = document["paths"]["/api/v1/offerings/{offering_id}/holds"]["post"]
    assert "Location" in create["responses"]["201"]["headers"]
    assert "Retry-After" in create["responses"]["429"]["headers"]
    assert {p["name"] for p in create["parameters"]} == {"offering_id", "Idempotency-Key"}
    assert document["components"]["securitySchemes"]["BearerToken"]["scheme"] == "bearer"


def test_the_browsable_page_is_for_staff_and_needs_no_cdn(client, admin_client, db):
    anonymous = client.get("/api/v1/docs")
    assert anonymous.status_code == 302
    assert anonymous["Location"].startswith("/admin/login/")
    page = admin_client.get("/api/v1/docs")
    assert page.status_code == 200
    html = page.content.decode()
    assert "swagger-ui" in html
    assert "/api/v1/openapi.json" in html
    assert not re.search(r"""src=["']https?://""", html)  # bundled, not fetched from a CDN


def test_every_operation_is_tagged_described_and_lists_its_problems(client, db):
    document = client.get("/api/v1/openapi.json").json()
    for path, item in document["paths"].items():
        for method, operation in item.items():
            where = f"{method.upper()} {path}"
            assert operation["tags"] and operation["tags"] != ["default"], where
            assert operation["summary"] and operation["description"], where
            for parameter in operation.get("parameters", []):
                # OpenAPI: a parameter's examples are a map of Example Objects
                assert isinstance(parameter.get("examples", {}), dict), (where, parameter)
            for status, response in operation["responses"].items():
                assert "X-Request-ID" in response["headers"], (where, status)
                if int(status) < 400:
                    continue
                (content_type,) = response["content"]
                assert content_type == "application/problem+json", (where, status)
                examples = response["content"][content_type]["examples"]
                assert examples, (where, status)
                for code, example in examples.items():
                    # each listed code is a problem of this status, and named in the text
                    assert problems.PROBLEM_TYPES[code].status == int(status), (where, code)
                    assert f"`{code}`" in response["description"]
                    assert example["value"]["code"] == code


def test_the_document_states_the_bounds_the_server_enforces(client, db, settings):
    document = client.get("/api/v1/openapi.json").json()
    schemas = document["components"]["schemas"]
    ttl = schemas["HoldRequest"]["properties"]["ttl_seconds"]["anyOf"][0]
    assert (ttl["minimum"], ttl["maximum"]) == (1, settings.RESERVATIONS_MAX_HOLD_TTL_SECONDS)
    version = schemas["VersionRequest"]["properties"]["expected_version"]
    assert (version["type"], version["minimum"]) == ("integer", 1)
    assert "holder" in schemas["Hold"]["required"]
    for field in ("seats_available", "available", "eligible"):
        assert schemas["Availability"]["properties"][field]["description"]
    listing = document["paths"]["/api/v1/holds"]["get"]["parameters"]
    cursor = next(p for p in listing if p["name"] == "cursor")["schema"]
    assert cursor["pattern"] == "^[A-Za-z0-9_-]{11}$"
    created = document["paths"]["/api/v1/offerings/{offering_id}/holds"]["post"]["responses"]
    assert created["201"]["links"]["RenewHold"]["operationId"] == "renew_hold"
