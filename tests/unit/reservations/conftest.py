"""Fixtures of the domain's tests."""

from __future__ import annotations

from typing import Any

import pytest

from reservations import clients
from reservations.models import ApiClient
from tests.support.api import MakeClient


@pytest.fixture
def make_client(db: None, clear_rate_limits: None) -> MakeClient:
    """Makes an API client (writing, with every offering unless given ``offerings``) and
    issues its token."""

    def _make(name: str = "checkout", **fields: Any) -> tuple[ApiClient, str]:
        offerings = fields.pop("offerings", ())
        fields.setdefault("can_write", True)
        fields.setdefault("all_offerings", not offerings)
        client = ApiClient.objects.create(name=name, **fields)
        client.offerings.set(offerings)
        return client, clients.issue_token(client)

    return _make
