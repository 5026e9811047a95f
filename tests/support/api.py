"""The JSON API's development token (``RESERVATIONS_API_TOKEN``), for tests that call the API
without an API client of their own."""

from __future__ import annotations

from typing import Any

import pytest

API_TOKEN = "api-test-token"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}


@pytest.fixture
def api_token(settings: Any) -> str:
    """The API accepts ``API_TOKEN`` (sent as ``AUTH``) for this test."""
    settings.RESERVATIONS_API_TOKEN = API_TOKEN
    return API_TOKEN
