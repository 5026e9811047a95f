"""Load PostgreSQL's ``'infinity'`` timestamps into Python.

A hold claimed more times than allowed is set aside with ``next_attempt_at = 'infinity'`` (never
due again until requeued). psycopg cannot turn ``infinity`` into a ``datetime`` and raises, so
any ORM read of such a row — the admin list, a service's return value — would fail. This loader
maps ``±infinity`` to ``datetime.max/min`` (UTC) and is registered on every new connection,
keeping Django's time-zone handling (it carries the same ``timezone`` attribute Django checks).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db.backends.signals import connection_created
from psycopg.types.datetime import TimestamptzLoader

INFINITY = datetime.max.replace(tzinfo=UTC)
MINUS_INFINITY = datetime.min.replace(tzinfo=UTC)


class InfinityTimestamptzLoader(TimestamptzLoader):
    timezone = UTC  # what Django compares before re-registering its own loader

    def load(self, data: Any) -> datetime:
        raw = bytes(data)
        if raw == b"infinity":
            return INFINITY
        if raw == b"-infinity":
            return MINUS_INFINITY
        return super().load(data).replace(tzinfo=self.timezone)  # type: ignore[no-any-return]


def _register(sender: Any, connection: Any, **_: Any) -> None:
    # settings.TIME_ZONE is UTC with USE_TZ, so Django's own loader is a UTC one too.
    if connection.vendor == "postgresql":
        connection.connection.adapters.register_loader("timestamptz", InfinityTimestamptzLoader)


def install() -> None:
    connection_created.connect(_register, dispatch_uid="reservations.infinity_loader")
