"""The release message contract: build it, validate it (→ a reason for a dead letter).

A message is a small JSON object. Unknown extra fields are tolerated (a rolling deploy may add
fields); a missing field, a wrong type or an inconsistent key makes it ``malformed``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

SCHEMA_VERSION = 1
MAX_TRACE_ID = 64
# What the columns can hold: ids are PostgreSQL bigint, versions and shards integer.
BIGINT_MAX = 2**63 - 1
INT_MAX = 2**31 - 1


class MalformedMessage(ValueError):
    """The message cannot be acted on; ``str(exc)`` is the dead letter's reason text."""


def idempotency_key(reservation_id: int, version: int) -> str:
    return f"release:{reservation_id}:{version}"


@dataclass(frozen=True)
class ReleaseMessage:
    reservation_id: int
    version: int
    expires_at: datetime
    idempotency_key: str
    shard: int
    trace_id: str
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def for_hold(
        cls, reservation_id: int, version: int, expires_at: datetime, shard: int, trace_id: str
    ) -> ReleaseMessage:
        """The message that releases hold ``reservation_id`` at ``version``."""
        return cls(
            reservation_id=reservation_id,
            version=version,
            expires_at=expires_at,
            idempotency_key=idempotency_key(reservation_id, version),
            shard=shard,
            trace_id=trace_id,
        )

    def as_dict(self) -> dict[str, Any]:
        """The message as it travels (the task's one argument)."""
        return {
            "schema_version": self.schema_version,
            "reservation_id": self.reservation_id,
            "version": self.version,
            "expires_at": self.expires_at.isoformat(),
            "idempotency_key": self.idempotency_key,
            "shard": self.shard,
            "trace_id": self.trace_id,
        }


def build(
    reservation_id: int, version: int, expires_at: datetime, shard: int, trace_id: str
) -> dict[str, Any]:
    """``ReleaseMessage.for_hold(...).as_dict()``: the JSON a task is handed, for callers that
    run a task directly or write a message by hand."""
    return ReleaseMessage.for_hold(reservation_id, version, expires_at, shard, trace_id).as_dict()


def _int(raw: dict[str, Any], name: str, minimum: int, maximum: int = INT_MAX) -> int:
    if name not in raw:
        raise MalformedMessage(f"missing field {name!r}")
    value = raw[name]
    # bool is an int subclass; a JSON true is not a reservation id.
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedMessage(f"field {name!r} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise MalformedMessage(f"field {name!r} must be >= {minimum}, got {value}")
    if value > maximum:
        raise MalformedMessage(f"field {name!r} must be <= {maximum}, got {str(value)[:40]}")
    return value


def _str(raw: dict[str, Any], name: str, max_length: int) -> str:
    if name not in raw:
        raise MalformedMessage(f"missing field {name!r}")
    value = raw[name]
    if not isinstance(value, str):
        raise MalformedMessage(f"field {name!r} must be a string, got {type(value).__name__}")
    if len(value) > max_length:
        raise MalformedMessage(f"field {name!r} is longer than {max_length} characters")
    # PostgreSQL text holds neither NUL nor a lone surrogate (which is not UTF-8 at all).
    if "\x00" in value:
        raise MalformedMessage(f"field {name!r} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedMessage(f"field {name!r} is not valid Unicode text") from None
    return value


def _schema_version(raw: dict[str, Any]) -> int:
    schema_version = _int(raw, "schema_version", 1)
    if schema_version != SCHEMA_VERSION:
        raise MalformedMessage(
            f"unsupported schema_version {schema_version} (this worker reads {SCHEMA_VERSION})"
        )
    return schema_version


def validate(raw: object) -> ReleaseMessage:
    """Return the message, or raise ``MalformedMessage`` saying what is wrong."""
    if not isinstance(raw, dict):
        raise MalformedMessage(f"message must be a JSON object, got {type(raw).__name__}")
    schema_version = _schema_version(raw)
    reservation_id = _int(raw, "reservation_id", 1, BIGINT_MAX)
    version = _int(raw, "version", 1)
    shard = _int(raw, "shard", 0)
    key = _str(raw, "idempotency_key", 120)
    trace_id = _str(raw, "trace_id", MAX_TRACE_ID)
    expires_raw = _str(raw, "expires_at", 64)
    try:
        expires_at = datetime.fromisoformat(expires_raw)
    except ValueError:
        raise MalformedMessage(
            f"field 'expires_at' is not an ISO 8601 time: {expires_raw!r}"
        ) from None
    if expires_at.tzinfo is None:
        raise MalformedMessage("field 'expires_at' has no time zone")
    expected_key = idempotency_key(reservation_id, version)
    if key != expected_key:
        raise MalformedMessage(f"idempotency_key {key!r} does not match {expected_key!r}")
    return ReleaseMessage(
        reservation_id=reservation_id,
        version=version,
        expires_at=expires_at,
        idempotency_key=key,
        shard=shard,
        trace_id=trace_id,
        schema_version=schema_version,
    )


# --- Batched mode ---------------------------------------------------------------------------
# One message carries up to CLEANUP_RELEASE_BATCH_SIZE holds; each item keeps its own id,
# version, expiry and idempotency key, so each hold is decided exactly as on its own.
BATCH_KIND = "release_batch"
MAX_BATCH_ITEMS = 1000  # ~150 bytes per item: far below 256 KB


@dataclass(frozen=True)
class BatchMessage:
    items: tuple[ReleaseMessage, ...]
    rejected: tuple[tuple[Any, str], ...]  # (raw item, reason) for items that are malformed
    shard: int
    trace_id: str

    @classmethod
    def for_holds(
        cls, holds: Iterable[tuple[int, int, datetime]], shard: int, trace_id: str
    ) -> BatchMessage:
        """The message that releases each (reservation_id, version, expires_at) of ``holds``."""
        return cls(
            items=tuple(
                ReleaseMessage.for_hold(rid, version, expires_at, shard, trace_id)
                for rid, version, expires_at in holds
            ),
            rejected=(),
            shard=shard,
            trace_id=trace_id,
        )

    @property
    def batch_key(self) -> str:

        keys = sorted(m.idempotency_key for m in self.items)
        digest = hashlib.sha1("\n".join(keys).encode(), usedforsecurity=False).hexdigest()
        return f"batch:{digest[:24]}"

    def as_dict(self) -> dict[str, Any]:
        """The message as it travels: the envelope once, and per item only what is its own
        (its schema version, shard and trace id are the envelope's). Items that were
        rejected when it was read are not part of it."""
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": BATCH_KIND,
            "shard": self.shard,
            "trace_id": self.trace_id,
            "items": [
                {
                    "reservation_id": m.reservation_id,
                    "version": m.version,
                    "expires_at": m.expires_at.isoformat(),
                    "idempotency_key": m.idempotency_key,
                }
                for m in self.items
            ],
        }


def build_batch(
    holds: list[tuple[int, int, datetime]], shard: int, trace_id: str
) -> dict[str, Any]:
    """``BatchMessage.for_holds(...).as_dict()``: the JSON a task is handed, for callers that
    run a task directly or write a message by hand."""
    return BatchMessage.for_holds(holds, shard, trace_id).as_dict()


def validate_batch(raw: object) -> BatchMessage:
    """Validate the envelope (malformed → the whole message is a dead letter); each item is
    validated on its own, and malformed items are returned in ``rejected`` with a reason."""
    if not isinstance(raw, dict):
        raise MalformedMessage(f"message must be a JSON object, got {type(raw).__name__}")
    schema_version = _schema_version(raw)
    if raw.get("kind") != BATCH_KIND:
        raise MalformedMessage(f"field 'kind' must be {BATCH_KIND!r}")
    shard = _int(raw, "shard", 0)
    trace_id = _str(raw, "trace_id", MAX_TRACE_ID)
    items = raw.get("items")
    if not isinstance(items, list) or not items:
        raise MalformedMessage("field 'items' must be a non-empty list")
    if len(items) > MAX_BATCH_ITEMS:
        raise MalformedMessage(f"field 'items' has more than {MAX_BATCH_ITEMS} entries")
    good: list[ReleaseMessage] = []
    rejected: list[tuple[Any, str]] = []
    for item in items:
        try:
            if not isinstance(item, dict):
                raise MalformedMessage(f"item must be a JSON object, got {type(item).__name__}")
            good.append(
                validate(
                    {**item, "schema_version": schema_version, "shard": shard, "trace_id": trace_id}
                )
            )
        except MalformedMessage as exc:
            rejected.append((item, str(exc)))
    return BatchMessage(tuple(good), tuple(rejected), shard, trace_id)
