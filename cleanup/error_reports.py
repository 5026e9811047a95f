"""Error reports to Sentry when ``SENTRY_DSN`` is set, with personal data and secrets scrubbed.

``configure()`` runs once from the settings (every process: web, worker, beat; sentry-sdk
restarts its sending thread in a forked child). With ``SENTRY_DSN`` unset it does nothing and
imports nothing. Otherwise it starts sentry-sdk with its Django and Celery integrations,
``data_collection`` that collects no user, client address, cookies, request bodies, queue
payloads or query data (sentry-sdk's successor to ``send_default_pii``), and
``before_send=scrub_event``, which replaces what could still name a person or open a door:
request headers that carry credentials (Authorization, Cookie, Idempotency-Key, API keys),
cookies, the request's body and query string, the user, and every value whose key names a
holder or a secret, wherever in the event it is (stack frames' local variables, extras,
contexts, breadcrumbs), and any bearer token inside a string. Sentry's traces stay off:
the traces are OpenTelemetry's (cleanup.tracing).

``SENTRY_DSN`` (and ``SENTRY_ENVIRONMENT``, ``SENTRY_RELEASE``) are sentry-sdk's own variables,
read by sentry-sdk; this module only checks whether a DSN is set. The package is the wheel's
``tracing`` extra: with a DSN set and the package missing, start-up fails naming the extra.

Docs: docs/TRACING.md, "Errors to Sentry".
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, cast

from django.core.exceptions import ImproperlyConfigured

DSN_VARIABLE = "SENTRY_DSN"
# What sentry-sdk collects by itself, before ``scrub_event``: the same as its former
# ``send_default_pii=False`` but stricter (no cookies, bodies or queue payloads at all), with
# stack frames' local variables kept because ``scrub_event`` cleans them.
DATA_COLLECTION: dict[str, Any] = {
    "user_info": False,
    "cookies": {"mode": "off"},
    "http_headers": {
        "request": {
            "mode": "denylist",
            "terms": ["forwarded", "-ip", "remote-", "via", "-user", "idempotency"],
        }
    },
    "http_bodies": [],
    "url_query_params": {"mode": "off"},
    "database_query_data": False,
    "queues": False,
    "stack_frame_variables": True,
}
FILTERED = "[Filtered]"
# Keys whose values are replaced wherever they appear in an event (case-insensitive, any part
# of the key): credentials and the settings that hold them, and who holds a seat.
SENSITIVE_KEY = re.compile(
    r"secret|passw|token|auth|cookie|session|csrf|signature|api[_-]?key|private|dsn|credential"
    r"|idempotency|holder|email|phone|x-forwarded-for|remote_addr",
    re.IGNORECASE,
)
# Request parts dropped whole: they can carry any of the above in a shape the key check misses.
DROPPED_REQUEST_PARTS = ("cookies", "data", "query_string", "env")
# A bearer (or basic) credential inside any string, such as a logged header line.
CREDENTIAL_IN_TEXT = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
# How deep the scrubber walks an event (sentry-sdk bounds its own depth well below this).
MAX_DEPTH = 20


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return bool(environ.get(DSN_VARIABLE, "").strip())


def configure(environ: Mapping[str, str] = os.environ) -> bool:
    """Start sentry-sdk if ``SENTRY_DSN`` is set; whether it was."""
    if not enabled(environ):
        return False
    try:
        import sentry_sdk  # noqa: PLC0415 - the optional tracing extra
        from sentry_sdk.integrations.celery import CeleryIntegration  # noqa: PLC0415
        from sentry_sdk.integrations.django import DjangoIntegration  # noqa: PLC0415
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"SENTRY_DSN is set but {exc.name} is missing: install the tracing extra "
            "(pip install 'reservation-cleanup[tracing]'), or unset SENTRY_DSN"
        ) from exc
    sentry_sdk.init(
        # dsn, environment and release come from SENTRY_DSN, SENTRY_ENVIRONMENT, SENTRY_RELEASE
        integrations=[DjangoIntegration(), CeleryIntegration()],
        data_collection=cast(Any, DATA_COLLECTION),  # a TypedDict in sentry-sdk
        before_send=cast(Any, scrub_event),  # sentry-sdk types its Event as a TypedDict
        max_request_body_size="never",
        traces_sample_rate=None,
    )
    return True


def scrub_event(event: dict[str, Any], hint: Any = None) -> dict[str, Any]:
    """The event with personal data and secrets replaced (see the module's docstring)."""
    event.pop("user", None)
    request = event.get("request")
    if isinstance(request, dict):
        for part in DROPPED_REQUEST_PARTS:
            if part in request:
                request[part] = FILTERED
    scrubbed: dict[str, Any] = _scrub(event, 0)
    return scrubbed


def _scrub(value: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        return FILTERED
    if isinstance(value, dict):
        return {
            key: FILTERED if _sensitive(key) else _scrub(item, depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        # Headers arrive as [name, value] pairs as well as a mapping.
        if len(value) == 2 and isinstance(value[0], str) and _sensitive(value[0]):
            return [value[0], FILTERED]
        return [_scrub(item, depth + 1) for item in value]
    if isinstance(value, str):
        return CREDENTIAL_IN_TEXT.sub(r"\1 " + FILTERED, value)
    return value


def _sensitive(key: Any) -> bool:
    return isinstance(key, str) and SENSITIVE_KEY.search(key) is not None
