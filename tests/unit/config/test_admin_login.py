"""The client's address for the admin's lockouts (config.admin_login.client_ip): read through
TRUSTED_PROXY_COUNT proxies from the right of X-Forwarded-For, never from what a client wrote."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import RequestFactory

from config.admin_login import client_ip


def _request(forwarded: str | None, remote: str = "10.0.0.9") -> Any:
    request = RequestFactory().post("/admin/login/")
    request.META["REMOTE_ADDR"] = remote
    if forwarded is not None:
        request.META["HTTP_X_FORWARDED_FOR"] = forwarded
    return request


@pytest.mark.parametrize(
    ("count", "forwarded", "expected"),
    [
        (0, "203.0.113.5", "10.0.0.9"),  # no proxy: the header is the client's own writing
        (1, "203.0.113.5", "203.0.113.5"),
        (1, "198.51.100.1, 203.0.113.5", "203.0.113.5"),  # a forged entry on the left
        (2, "198.51.100.1, 203.0.113.5, 10.1.1.1", "203.0.113.5"),
        (2, "203.0.113.5", "203.0.113.5"),  # fewer entries than proxies: the leftmost
        (1, None, "10.0.0.9"),  # not through the proxy
        (1, "not-an-address", "10.0.0.9"),
        (1, "2001:db8::1", "2001:db8::1"),
    ],
)
def test_the_client_address_is_read_through_the_trusted_proxies(
    settings: Any, count: int, forwarded: str | None, expected: str
) -> None:
    settings.TRUSTED_PROXY_COUNT = count
    assert client_ip(_request(forwarded)) == expected
