"""Error reports to Sentry (cleanup.error_reports): off without SENTRY_DSN; with it, an event that
reaches the transport names no holder, carries no credential, cookie, Idempotency-Key or secret
setting. docs/TRACING.md, "Errors to Sentry"."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import sentry_sdk
from django.core.exceptions import ImproperlyConfigured
from sentry_sdk.transport import Transport

from cleanup import error_reports

DSN = "https://public@sentry.invalid/1"
TOKEN = "tok_live_9f8e7d6c5b4a"
HOLDER = "Ann Holder"
SECRET_KEY = "django-insecure-secret"
# (the values travel in variables: the event's source lines show the code, not its data)
SECRETS = (HOLDER, TOKEN, "idem-key-42", "sessionid=abc123", SECRET_KEY)


class InMemoryTransport(Transport):
    """What sentry-sdk would send, kept in memory."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.envelopes: list[Any] = []

    def capture_envelope(self, envelope: Any) -> None:
        self.envelopes.append(envelope)

    def events(self) -> list[dict[str, Any]]:
        return [
            item.payload.json
            for envelope in self.envelopes
            for item in envelope.items
            if item.type == "event"
        ]


@pytest.fixture
def sentry(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemoryTransport]:
    """sentry-sdk configured as the settings do, sending to memory."""
    transport = InMemoryTransport()
    real_init = sentry_sdk.init

    def init(**options: Any) -> Any:
        return real_init(dsn=DSN, transport=transport, **options)

    monkeypatch.setattr(sentry_sdk, "init", init)
    assert error_reports.configure(environ={"SENTRY_DSN": DSN})
    try:
        yield transport
    finally:
        sentry_sdk.get_client().close()
        real_init()  # no DSN: a client that sends nothing


def a_failing_request_event() -> dict[str, Any]:
    return {
        "message": f"hold failed, header Authorization: Bearer {TOKEN}",
        "user": {"id": 7, "email": "ann@example.com", "ip_address": "10.0.0.7"},
        "request": {
            "url": "https://api.example/api/v1/offerings/1/holds",
            "method": "POST",
            "headers": {
                "Authorization": f"Bearer {TOKEN}",
                "Cookie": "sessionid=abc123",
                "Idempotency-Key": "idem-key-42",
                "X-Request-ID": "req-1",
            },
            "cookies": {"sessionid": "abc123"},
            "data": {"holder": "Ann Holder", "seats": 2},
            "query_string": "holder=Ann%20Holder",
            "env": {"REMOTE_ADDR": "10.0.0.7"},
        },
        "extra": {"holder": "Ann Holder", "reservation_id": 12},
        "contexts": {"settings": {"SECRET_KEY": "django-insecure-secret", "DEBUG": False}},
        "breadcrumbs": {
            "values": [{"message": f"Token {TOKEN}", "data": {"api_key": TOKEN, "seats": 2}}]
        },
        "exception": {
            "values": [
                {
                    "type": "ValueError",
                    "stacktrace": {
                        "frames": [
                            {
                                "function": "create_hold",
                                "vars": {
                                    "holder": "Ann Holder",
                                    "token": TOKEN,
                                    "headers": [["Idempotency-Key", "idem-key-42"]],
                                    "seats": 2,
                                },
                            }
                        ]
                    },
                }
            ]
        },
    }


def test_the_scrubber_leaves_no_personal_data_or_secret_and_keeps_the_rest() -> None:
    scrubbed = error_reports.scrub_event(a_failing_request_event())
    text = json.dumps(scrubbed)
    assert [secret for secret in SECRETS if secret in text] == []
    assert "user" not in scrubbed and "10.0.0.7" not in text
    # what helps find the bug stays
    assert scrubbed["request"]["headers"]["X-Request-ID"] == "req-1"
    assert scrubbed["extra"]["reservation_id"] == 12
    frame = scrubbed["exception"]["values"][0]["stacktrace"]["frames"][0]
    assert frame["function"] == "create_hold" and frame["vars"]["seats"] == 2


def test_an_error_reported_through_sentry_reaches_the_transport_scrubbed(
    sentry: InMemoryTransport,
) -> None:
    def create_hold(holder: str, token: str) -> None:
        raise ValueError("no seats")

    try:
        create_hold(HOLDER, TOKEN)
    except ValueError:
        sentry_sdk.set_context("settings", {"SECRET_KEY": SECRET_KEY})
        sentry_sdk.set_extra("holder", HOLDER)
        sentry_sdk.capture_exception()
    sentry_sdk.flush()
    (event,) = sentry.events()
    text = json.dumps(event)
    assert "no seats" in text and "create_hold" in text
    assert [secret for secret in SECRETS if secret in text] == []
    collected = sentry_sdk.get_client().options["data_collection"]
    assert collected["user_info"] is False and collected["cookies"] == {"mode": "off"}
    assert collected["http_bodies"] == [] and collected["queues"] is False


def test_without_a_dsn_nothing_is_configured() -> None:
    assert not error_reports.configure(environ={})
    assert not error_reports.configure(environ={"SENTRY_DSN": " "})


def test_with_a_dsn_and_no_sentry_sdk_the_start_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "sentry_sdk", None)
    with pytest.raises(ImproperlyConfigured, match=r"SENTRY_DSN .*\[tracing\]"):
        error_reports.configure(environ={"SENTRY_DSN": DSN})
