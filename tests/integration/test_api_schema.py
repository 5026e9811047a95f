"""Schema-driven requests: schemathesis reads the OpenAPI document from a live gunicorn, makes
requests from it for every operation, sends them, and checks each answer: never a 5xx, a
status code the document lists, its content type, its headers and its body schema.

Generated ids would almost never name an existing offering or hold, so about half the cases
get the id of a real offering (room for every hold) or of a hold of the calling client: the
success and conflict paths are exercised too, not only the 404s.
"""

from __future__ import annotations

from typing import Any

import hypothesis
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from reservations import clients, services
from reservations.models import ApiClient

pytestmark = [pytest.mark.slow]

EXAMPLES_PER_OPERATION = 40
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(autouse=True)
def _no_earlier_requests(clear_rate_limits: None) -> None:
    pass


@pytest.fixture
def web_options() -> dict[str, Any]:
    return {"workers": 2, "threads": 2}


def test_every_operation_answers_as_its_schema_says_and_never_with_a_5xx(web):
    # given a client with every scope, an offering and one of its holds
    client = ApiClient.objects.create(
        name="schemathesis", can_write=True, all_offerings=True, requests_per_minute=10**6
    )
    token = clients.issue_token(client)
    offering = services.create_offering("fuzzed", capacity=10**6)
    hold = services.hold_seat(offering.pk, "fuzz", client_id=client.pk)
    known = {"offering_id": offering.pk, "hold_id": hold.pk}
    auth = {"Authorization": f"Bearer {token}"}
    schema = schemathesis.openapi.from_url(f"{web.base_url}/api/v1/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) == len(schema.raw_schema["paths"]) + 1  # GET and POST share a path
    sent: dict[str, set[int]] = {}
    for operation in operations:

        @hypothesis.settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,  # the same cases on every run: a failure reproduces
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        @hypothesis.given(case=operation.as_strategy(), use_known=st.booleans())
        def check(case: Any, use_known: bool) -> None:
            if use_known and case.path_parameters:
                case.path_parameters.update(
                    {k: v for k, v in known.items() if k in case.path_parameters}
                )
            response = case.call_and_validate(base_url=web.base_url, headers=auth, checks=CHECKS)
            operation = case.operation
            sent.setdefault(f"{operation.method.upper()} {operation.path}", set()).add(
                response.status_code
            )

        # when
        check()
    # then (each call validated above); and the cases reached more than the refusals
    assert set(sent) == {f"{o.method.upper()} {o.path}" for o in operations}
    reached = set().union(*sent.values())
    assert {200, 201, 404} <= reached, sent
    # and a request the document calls valid is never refused as invalid
    assert 400 not in reached, sent
