"""Bounds every broker message must meet before anything decodes it deeply or hands it on.

A worker's main process decodes a message, builds a request and hands it to a pool child.
Several of those steps raise *outside* any task when the message is hostile (an over-deep JSON
document, a garbage ``timelimit`` header, a body that is not ``[args, kwargs, embed]``), and an
exception there stops the whole worker; the message then comes back and stops the next one. The
consumer (``cleanup.consumer``) and the Redis transport (``cleanup.redis_transport``) call these
checks first; each returns ``None`` for a message that may go on, or the reason it may not,
which becomes the dead letter's error text. Docs: docs/HARDENING.md.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from datetime import datetime
from typing import Any

from django.conf import settings

# Release messages nest 3 levels ([args, kwargs, embed] → message), batches 5. Well below
# what json and pickle recurse through (~1,000 levels raise RecursionError).
MAX_NESTING = 32

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def max_bytes() -> int:
    return int(settings.CLEANUP_MAX_MESSAGE_BYTES)


def _as_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8", "surrogatepass")
    return bytes(data)


def nesting_depth(data: bytes | str, limit: int = MAX_NESTING) -> int:
    """Bracket depth of a JSON text, strings skipped; stops counting once past ``limit``.

    Cheap on the common path: a document with fewer brackets than the limit cannot be deeper.
    """
    raw = _as_bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub(b'""', raw)):
        if match.group() in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        else:
            depth -= 1
    return deepest


def check_raw(data: bytes | str, what: str = "message body", slack: float = 1.0) -> str | None:
    """Size and nesting of raw bytes, before they are decoded. ``slack`` scales the size cap
    for an envelope that carries the body base64-encoded (4/3 of it) plus headers."""
    size = len(data)
    limit = int(max_bytes() * slack)
    if size > limit:
        return f"{what} of {size} bytes exceeds CLEANUP_MAX_MESSAGE_BYTES ({limit} bytes)"
    if nesting_depth(data) > MAX_NESTING:
        return f"{what} is nested deeper than {MAX_NESTING} levels"
    return None


def _number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _time(value: Any) -> bool:
    if isinstance(value, str):
        try:
            datetime.fromisoformat(value)
        except ValueError:
            return False
        return True
    return isinstance(value, datetime)


def _optional_text(value: Any) -> bool:
    return value is None or (isinstance(value, str) and len(value) <= 1024)


# The task headers Celery's request reads in the worker's main process, and what each must be.
_HEADER_CHECKS: dict[str, tuple[Any, str]] = {
    "id": (lambda v: isinstance(v, str) and 0 < len(v) <= 255, "a task id string"),
    "root_id": (_optional_text, "a string or null"),
    "parent_id": (_optional_text, "a string or null"),
    "group": (_optional_text, "a string or null"),
    "shadow": (_optional_text, "a string or null"),
    "origin": (_optional_text, "a string or null"),
    "lang": (_optional_text, "a string or null"),
    "argsrepr": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "kwargsrepr": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "timelimit": (
        lambda v: (
            v is None
            or (
                isinstance(v, list | tuple)
                and len(v) == 2
                and all(x is None or _number(x) for x in v)
            )
        ),
        "[hard, soft] seconds (numbers or null)",
    ),
    "eta": (lambda v: v is None or _time(v), "an ISO 8601 time or null"),
    "expires": (lambda v: v is None or _time(v), "an ISO 8601 time or null"),
    "retries": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31,
        "a non-negative integer",
    ),
    "ignore_result": (lambda v: v is None or isinstance(v, bool), "a boolean or null"),
    "group_index": (
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
        "an integer or null",
    ),
    "replaced_task_nesting": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1000,
        "a small integer",
    ),
    "stamped_headers": (
        lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
        "a list of strings or null",
    ),
    "stamps": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "enqueued_at": (lambda v: v is None or _number(v), "a Unix time or null"),
}


def check_headers(headers: dict[str, Any]) -> str | None:
    """Every header Celery reads has the type it expects (``task`` is checked by the caller)."""
    for name, (ok, expected) in _HEADER_CHECKS.items():
        if name in headers and not ok(headers[name]):
            return f"header {name!r} must be {expected}, got {_preview(headers[name])}"
    if "id" not in headers:
        return "header 'id' is missing"
    return None


def check_payload(payload: Any) -> str | None:
    """A decoded task body must be ``[args, kwargs, embed]``: a list, an object, an object or
    null (Celery unpacks it without looking)."""
    if not isinstance(payload, list | tuple) or len(payload) != 3:
        return f"task body must be [args, kwargs, embed], got {_preview(payload)}"
    args, kwargs, embed = payload
    if not isinstance(args, list | tuple):
        return f"task body's args must be a list, got {type(args).__name__}"
    if not isinstance(kwargs, dict):
        return f"task body's kwargs must be an object, got {type(kwargs).__name__}"
    if embed is not None and not isinstance(embed, dict):
        return f"task body's embed must be an object or null, got {type(embed).__name__}"
    return None


def check_envelope(payload: Any) -> str | None:
    """A Redis list entry decoded from JSON must be a kombu envelope that kombu can turn into
    a message and bookkeep as unacked: body, headers, properties with a delivery tag and
    delivery info, and a body its ``body_encoding`` can decode."""
    if not isinstance(payload, dict):
        return f"not a broker envelope: a JSON {type(payload).__name__}"
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        return "not a broker envelope: 'properties' is missing or not an object"
    if not isinstance(properties.get("delivery_tag"), str):
        return "not a broker envelope: 'properties.delivery_tag' is not a string"
    info = properties.get("delivery_info")
    if not isinstance(info, dict) or not all(
        isinstance(info.get(k), str) for k in ("exchange", "routing_key")
    ):
        return "not a broker envelope: 'properties.delivery_info' lacks exchange/routing_key"
    headers = payload.get("headers")
    if headers is not None and not isinstance(headers, dict):
        return "not a broker envelope: 'headers' is not an object"
    for key in ("content-type", "content-encoding"):
        if payload.get(key) is not None and not isinstance(payload.get(key), str):
            return f"not a broker envelope: {key!r} is not a string"
    body = payload.get("body")
    if body is not None and not isinstance(body, str):
        return "not a broker envelope: 'body' is not a string"
    encoding = properties.get("body_encoding")
    if encoding not in (None, "base64"):
        return f"not a broker envelope: unsupported body_encoding {_preview(encoding)}"
    if body and encoding == "base64":
        try:
            base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            return "not a broker envelope: 'body' is not valid base64"
    return None


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
