"""The JSON API as the tests call it: the development token (``RESERVATIONS_API_TOKEN``) for
tests without an API client of their own, and requests made as a client with a token."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
from django.test import Client

from reservations import idempotency, ratelimit
from reservations.models import ApiClient, Offering

API_TOKEN = "api-test-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


@pytest.fixture
def api_token(settings: Any) -> str:
    """The API accepts ``API_TOKEN`` (sent as ``AUTH``) for this test."""
    settings.RESERVATIONS_API_TOKEN = API_TOKEN
    return API_TOKEN


# ``make_client(name="checkout", **fields)`` (tests/unit/reservations/conftest.py): a new API
# client and its token.
MakeClient = Callable[..., tuple[ApiClient, str]]


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
    """A GET, or a POST of ``body`` as JSON (``raw`` as it is), with ``token`` and the
    Idempotency-Key ``key`` when given."""
    headers = {"Authorization": f"Bearer {token}"}
    if key is not None:
        headers[idempotency.HEADER] = key
    if method == "get":
        return client.get(url, headers=headers)
    data = raw if raw is not None else json.dumps(body)
    return client.post(url, data=data, content_type="application/json", headers=headers)


@pytest.fixture
def clear_rate_limits() -> None:
    """No request counted by an earlier run: client ids start again in a new test database,
    and the limiter's Redis keeps a client's requests for a minute."""
    url = ratelimit.redis_url()
    if url:
        store = redis.Redis.from_url(url)
        for key in store.scan_iter(match=f"{ratelimit.KEY_PREFIX}*"):
            store.delete(key)


def hold_url(offering: Offering) -> str:
    return f"/api/v1/offerings/{offering.pk}/holds"


def error_code(response: Any) -> str:
    return str(response.json()["code"])


def seats_left(offering: Offering) -> int:
    offering.refresh_from_db()
    return offering.seats_available
