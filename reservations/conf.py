"""The Django settings the apps read beside the cleanup's own (``cleanup.conf``), with the value
each takes when a project sets none: a host project needs to set none of them. The example
project reads each from the environment (config/settings/base.py, docs/CONFIGURATION.md)."""

from __future__ import annotations

from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    # The one shared bearer token, for local development and tests only (empty: off).
    "RESERVATIONS_API_TOKEN": "",
    # How long a response stays replayable under its Idempotency-Key.
    "RESERVATIONS_IDEMPOTENCY_KEY_TTL_SECONDS": 86400,
    "RESERVATIONS_DEFAULT_HOLD_TTL_SECONDS": 600,
    "RESERVATIONS_MAX_HOLD_TTL_SECONDS": 86400,
    # The Redis counting each API client's requests (reservations.ratelimit); empty: the
    # cleanup's counter Redis, CLEANUP_COUNTER_REDIS_URL.
    "RESERVATIONS_API_RATE_LIMIT_REDIS_URL": "",
    # The largest request body the API reads (its largest request is well under 2 KB).
    "RESERVATIONS_API_MAX_BODY_BYTES": 16384,
    # How DATABASES["default"] reaches PostgreSQL: "none" (directly, or a session pooler) or
    # "transaction" (a transaction pooler; session state then goes over DATABASE_DIRECT).
    "DATABASE_POOLING": "none",
    # A DATABASES-style entry of a direct connection, probed at start-up when given.
    "DATABASE_DIRECT": None,
    # The alias whose connection holds session state (advisory locks, beat's lock).
    "DATABASE_SESSION_ALIAS": "default",
}


def value(name: str) -> Any:
    """The setting, or its default above."""
    return getattr(settings, name, DEFAULTS[name])


def prepared_statements() -> bool:
    """Whether the release statement runs prepared: always, except behind a transaction
    pooler, which cannot keep prepared statements (``DATABASE_PREPARED_STATEMENTS`` states it)."""
    stated = getattr(settings, "DATABASE_PREPARED_STATEMENTS", None)
    return bool(stated) if stated is not None else value("DATABASE_POOLING") != "transaction"
