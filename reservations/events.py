"""The domain events' contract: the message the outbox relay publishes for each event, the JSON
Schema of each kind (``reservations/event_schemas/<kind>.json``, installed with the package),
and the checks a consumer runs. docs/EVENTS.md.

``message`` builds what the relay publishes. ``check_envelope`` checks what a consumer needs to
route a message (an object, a ``schema_version`` this release knows, a kind, an id) with the
standard library only; ``validate`` checks the whole message against its kind's schema and needs
the ``jsonschema`` package, which the product itself does not (it never validates on publish).
Both raise ``InvalidEvent`` naming the field. Importing this module needs no Django set-up.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Mapping
from datetime import datetime
from importlib import resources
from typing import Any

# The envelope's schema_version: it changes only when a field is removed, renamed or retyped
# (docs/EVENTS.md, "The change rule"); a field added keeps it.
SCHEMA_VERSION = 1
# The schema versions a consumer built on this release understands.
KNOWN_SCHEMA_VERSIONS = frozenset({SCHEMA_VERSION})
# OutboxEvent.Kind's values (tests/unit/reservations/test_events.py holds them together),
# written out so that reading a schema needs no Django app registry.
KINDS = (
    "reservation.held",
    "reservation.renewed",
    "reservation.confirmed",
    "reservation.cancelled",
    "reservation.released",
)
SCHEMA_DIRECTORY = "event_schemas"
# RFC 3339's date-time (JSON Schema's "date-time" format): the separator and the UTC offset
# are required, which ``datetime.fromisoformat`` alone would not insist on.
_RFC3339 = re.compile(
    r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(?:\.\d+)?(?:[Zz]|[+-]\d\d:\d\d)", re.ASCII
)


class InvalidEvent(ValueError):
    """A message that is not a valid event; ``field`` names where (``payload.expires_at``;
    ``(message)`` for the message as a whole)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


def message(
    *,
    event_id: int,
    kind: str,
    reservation_id: int,
    version: int,
    payload: Mapping[str, Any],
    created_at: datetime,
) -> dict[str, Any]:
    """The JSON message the outbox relay publishes for one outbox event."""
    return {
        "schema_version": SCHEMA_VERSION,
        "event_id": event_id,
        "kind": kind,
        "reservation_id": reservation_id,
        "version": version,
        "payload": dict(payload),
        "created_at": created_at.isoformat(),
    }


@functools.cache
def _schema_text(kind: str) -> str:
    if kind not in KINDS:
        raise InvalidEvent("kind", f"{_preview(kind)} is not one of {', '.join(KINDS)}")
    path = resources.files(__package__ or "reservations") / SCHEMA_DIRECTORY / f"{kind}.json"
    return path.read_text(encoding="utf-8")


def load_schema(kind: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``kind``'s message, a copy the caller may change;
    ``InvalidEvent`` for a kind that has none."""
    schema: dict[str, Any] = json.loads(_schema_text(kind))
    return copy.deepcopy(schema)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_envelope(event: Any) -> None:
    """What a consumer needs before it hands a message on: a JSON object whose
    ``schema_version`` is one of ``KNOWN_SCHEMA_VERSIONS``, whose ``kind`` is one of ``KINDS``
    and whose ``event_id`` is a positive integer (the key to deduplicate by). Raises
    ``InvalidEvent``; needs no third-party package."""
    if not isinstance(event, dict):
        raise InvalidEvent("(message)", f"a JSON {type(event).__name__}, not an object")
    if "schema_version" not in event:
        raise InvalidEvent("schema_version", "missing")
    version = event["schema_version"]
    if not _is_int(version):
        raise InvalidEvent("schema_version", f"{_preview(version)} is not an integer")
    if version not in KNOWN_SCHEMA_VERSIONS:
        known = ", ".join(str(v) for v in sorted(KNOWN_SCHEMA_VERSIONS))
        raise InvalidEvent("schema_version", f"{version} is not one this consumer knows ({known})")
    if event.get("kind") not in KINDS:
        raise InvalidEvent(
            "kind", f"{_preview(event.get('kind'))} is not one of {', '.join(KINDS)}"
        )
    event_id = event.get("event_id")
    if not isinstance(event_id, int) or isinstance(event_id, bool) or event_id < 1:
        raise InvalidEvent("event_id", f"{_preview(event_id)} is not a positive integer")


def _rfc3339(value: object) -> bool:
    if not isinstance(value, str):
        return True  # formats apply to strings only; "type" says what the value must be
    if not _RFC3339.fullmatch(value):
        return False
    try:
        datetime.fromisoformat(value.upper())
    except ValueError:  # a month 13, a 25th hour
        return False
    return True


@functools.cache
def _validator(kind: str) -> Any:
    try:
        import jsonschema  # noqa: PLC0415 - a consumer's dependency, not the product's
    except ImportError as exc:
        raise ImportError(
            "reservations.events.validate needs the jsonschema package (pip install "
            "jsonschema); check_envelope does not"
        ) from exc
    formats = jsonschema.FormatChecker(formats=())
    formats.checks("date-time")(_rfc3339)
    return jsonschema.Draft202012Validator(json.loads(_schema_text(kind)), format_checker=formats)


def validate(event: Any) -> None:
    """Check a whole message against its kind's schema; ``InvalidEvent`` names the first field
    that is wrong (``check_envelope``'s checks first). Needs the ``jsonschema`` package."""
    check_envelope(event)
    error = min(_validator(event["kind"]).iter_errors(event), key=_error_order, default=None)
    if error is None:
        return
    path = [str(part) for part in error.absolute_path]
    if error.validator == "required":
        missing = [name for name in error.validator_value if name not in error.instance]
        path.append(str(missing[0]) if missing else "?")
        raise InvalidEvent(".".join(path), "missing")
    raise InvalidEvent(".".join(path) or "(message)", error.message[:300])


def _error_order(error: Any) -> tuple[int, str]:
    """The error to report first: the shallowest, then by field name (a stable choice)."""
    return (len(error.absolute_path), ".".join(str(p) for p in error.absolute_path))


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
