"""Every page carries a Content-Security-Policy (config.security)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("path", ["/admin/login/", "/api/v1/openapi.json", "/healthz"])
def test_every_page_carries_a_content_security_policy(client, db, path):
    response = client.get(path)
    policy = response["Content-Security-Policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["default-src"] == "'self'"
    assert directives["script-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'"
